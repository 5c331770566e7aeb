"""Cost reports for finance, straight from the ledger (billing.UsageRecord).

Per tenant and month: one row per (day, project, API key, model) with requests, input tokens,
output tokens and cost, then a total row. Platform-wide (for operators): one row per tenant.
Figures are sums of the ledger's integers, so the totals equal the ledger to the micro-dollar;
money is printed in US dollars with six decimals (exact: micro-dollars / 10^6).

Columns (tenant report): day, project, api_key, model, requests, input_tokens, output_tokens,
cost_usd. Columns (platform report): tenant, plan, requests, input_tokens, output_tokens, cost_usd.
Released and swept requests count as requests with zero tokens and zero cost.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from django.db.models import Count, Sum
from django.db.models.functions import TruncDate

from billing.models import UsageRecord
from tenants.models import Tenant

TENANT_COLUMNS = ("day", "project", "api_key", "model", "requests", "input_tokens",
                  "output_tokens", "cost_usd")
PLATFORM_COLUMNS = ("tenant", "plan", "requests", "input_tokens", "output_tokens", "cost_usd")


@dataclass(frozen=True)
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


_SUMS = {"requests": Count("id"), "input_tokens": Sum("input_tokens"),
         "output_tokens": Sum("output_tokens"), "cost": Sum("cost_micros")}


def _totals(groups: list[dict]) -> tuple[int, int, int, int]:
    return tuple(sum(g[name] for g in groups)  # type: ignore[return-value]
                 for name in ("requests", "input_tokens", "output_tokens", "cost"))


def tenant_month(tenant: Tenant, month: Month) -> Report:
    groups = list(
        UsageRecord.objects.filter(tenant=tenant, ended_at__gte=month.start, ended_at__lt=month.end)
        .annotate(day=TruncDate("ended_at", tzinfo=UTC))
        .values("day", "project__slug", "api_key__public_id", "served_model")
        .annotate(**_SUMS)
        .order_by("day", "project__slug", "api_key__public_id", "served_model")
    )
    rows = [(g["day"].isoformat(), g["project__slug"] or "(deleted)",
             g["api_key__public_id"] or "(deleted)", g["served_model"], g["requests"],
             g["input_tokens"], g["output_tokens"], usd(g["cost"])) for g in groups]
    requests, input_tokens, output_tokens, cost = _totals(groups)
    return Report(
        title=f"{tenant.slug} {month}",
        columns=TENANT_COLUMNS,
        rows=rows,
        totals=("total", "", "", "", requests, input_tokens, output_tokens, usd(cost)),
        cost_micros=cost,
    )


def platform_month(month: Month) -> Report:
    groups = list(
        UsageRecord.objects.filter(ended_at__gte=month.start, ended_at__lt=month.end)
        .values("tenant__slug", "tenant__plan__name")
        .annotate(**_SUMS)
        .order_by("tenant__slug")
    )
    rows = [(g["tenant__slug"], g["tenant__plan__name"], g["requests"], g["input_tokens"],
             g["output_tokens"], usd(g["cost"])) for g in groups]
    requests, input_tokens, output_tokens, cost = _totals(groups)
    return Report(
        title=f"all tenants {month}",
        columns=PLATFORM_COLUMNS,
        rows=rows,
        totals=("total", "", requests, input_tokens, output_tokens, usd(cost)),
        cost_micros=cost,
    )


def to_csv(report: Report) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(report.columns)
    writer.writerows(report.rows)
    writer.writerow(report.totals)
    return out.getvalue().encode()


def to_xlsx(report: Report) -> bytes:
    from openpyxl import Workbook
    from openpyxl.styles import Font

    book = Workbook()
    sheet = book.active
    sheet.title = report.title[:31]
    sheet.append(list(report.columns))
    for cell in sheet[1]:
        cell.font = Font(bold=True)
    cost_column = len(report.columns)
    for row in [*report.rows, report.totals]:
        # Decimals go in as numbers with six places shown; tokens as integers.
        sheet.append([float(v) if isinstance(v, Decimal) else v for v in row])
        sheet.cell(row=sheet.max_row, column=cost_column).number_format = "0.000000"
    for cell in sheet[sheet.max_row]:
        cell.font = Font(bold=True)
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()
