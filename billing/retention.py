"""Retention of the raw ledger: export a month's rows to CSV, and drop raw month partitions
older than TOLLGATE_LEDGER_RETENTION_MONTHS once the daily rollups stand in for them.

A month's partition (billing/partitions.py) is dropped only when, in one transaction holding the
partition against writes (SHARE lock: a late drain or correction into it waits; a correction's
UPDATE names its rows' month, so one into another month does not):
1. billing.rollups.verify finds no mismatch between the month's UTC rollups and its raw rows
   (every group and every sum, to the micro-dollar): after the drop the rollups are the only
   record, so they must be exactly the rows';
2. the month was exported (billing.LedgerExport) and the export's row count is the partition's
   (rows that came after the export would be lost), or the caller forces the drop. The daily task
   exports the month itself first when TOLLGATE_LEDGER_EXPORT_DIR is set, before taking the lock
   (an export takes hours at hundreds of millions of rows; a row written meanwhile makes the
   counts differ: refused, exported again on the next run); without it, it drops only months
   exported by `manage.py ledger_export`, and reports the others as refused.

Refusals are returned (and logged by the task), never raised: one month's mismatch does not stop
the check of the next.

The export streams the rows out of PostgreSQL with COPY ... TO STDOUT (no month is held in
memory) as CSV, one column per UsageRecord field, with text cells made inert for spreadsheets
(billing.reports.inert_text: a model name beginning with "=" is not a formula).
"""
from __future__ import annotations

import csv
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.db import connection, models, transaction

from billing.models import LedgerExport, UsageRecord
from billing.partitions import TABLE, drop_month, month_of, monthly_partitions, shift
from billing.reports import Month, inert_text
from billing.rollups import verify

log = logging.getLogger(__name__)


# -- export -------------------------------------------------------------------------------------

def _columns() -> list[models.Field]:
    return list(UsageRecord._meta.concrete_fields)


@dataclass(frozen=True)
class Exported:
    month: Month
    rows: int
    sha256: str
    path: Path


def export_month(month: Month, out: Path) -> Exported:
    """Write every raw ledger row of `month` (UTC, ended_at) to the CSV file `out`: a header of
    column names, then one line per row (NULL as an empty cell; timestamps in UTC as PostgreSQL
    writes them; booleans t / f). Streamed by COPY TO STDOUT; recorded in LedgerExport (a new
    export of the month replaces the record). Rows are in no particular order."""
    fields = _columns()
    names = [f.column for f in fields]
    text = [isinstance(f, models.CharField) for f in fields]
    select = (f"SELECT {', '.join(connection.ops.quote_name(n) for n in names)} "
              f"FROM {connection.ops.quote_name(TABLE)} "
              f"WHERE ended_at >= '{month.start.isoformat()}'::timestamptz "
              f"AND ended_at < '{month.end.isoformat()}'::timestamptz")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    rows = 0
    # Its own name per run: two runs at once (the command beside the beat's) never write into
    # one file.
    partial = out.with_name(f"{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    # One snapshot for the whole copy (REPEATABLE READ would be stricter; a single COPY statement
    # already reads one snapshot).
    with transaction.atomic(), connection.cursor() as cursor, \
            partial.open("w", newline="", encoding="utf-8") as handle:
        cursor.execute("SET LOCAL TIME ZONE 'UTC'")
        writer = csv.writer(handle)
        writer.writerow(names)
        with cursor.cursor.copy(f"COPY ({select}) TO STDOUT") as copy:
            for row in copy.rows():
                writer.writerow(["" if value is None else (inert_text(value) if is_text else value)
                                 for value, is_text in zip(row, text, strict=True)])
                rows += 1
    with partial.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    partial.replace(out)
    done = Exported(month, rows, digest.hexdigest(), out.resolve())
    LedgerExport.objects.update_or_create(
        month=month.start.date(),
        defaults={"rows": rows, "sha256": done.sha256, "path": str(done.path),
                  "exported_at": datetime.now(UTC), "dropped_at": None})
    return done


# -- retention ----------------------------------------------------------------------------------

def oldest_kept(now: datetime, keep_months: int) -> Month:
    """The oldest month kept: the current month and `keep_months` whole months before it."""
    return shift(month_of(now), -keep_months)


@dataclass(frozen=True)
class Outcome:
    month: Month
    action: str  # "dropped", "would drop", "refused"
    rows: int
    reason: str = ""

    def __str__(self) -> str:
        tail = f": {self.reason}" if self.reason else ""
        return f"{self.month} {self.action} ({self.rows} rows){tail}"


def _refusal(month: Month) -> str:
    mismatches = verify(month.start.date(), month.end.date())
    if not mismatches:
        return ""
    first = mismatches[0]
    return (f"rollups differ from the raw rows in {len(mismatches)} sums (first: tenant "
            f"{first.tenant_id} {first.day} {first.served_model} {first.status} {first.field}: "
            f"rollup {first.rollup}, raw {first.raw})")


def apply_retention(*, keep_months: int | None = None, now: datetime | None = None,
                    dry_run: bool = False, force: bool = False,
                    export_dir: str | Path | None = None) -> list[Outcome]:
    """Drop the month partitions older than `keep_months` (TOLLGATE_LEDGER_RETENTION_MONTHS by
    default; 0 keeps everything) that pass the checks above, oldest first; with `dry_run`, only
    say what would be dropped. `force` drops a verified month that was not exported (the rollup
    check is never skipped). `export_dir` (TOLLGATE_LEDGER_EXPORT_DIR by default): export a
    month there first when it has no current export."""
    keep = settings.TOLLGATE_LEDGER_RETENTION_MONTHS if keep_months is None else keep_months
    if keep <= 0:
        return []
    if export_dir is None:
        export_dir = settings.TOLLGATE_LEDGER_EXPORT_DIR or None
    cutoff = oldest_kept(now or datetime.now(UTC), keep)
    with connection.cursor() as cursor:
        partitions = monthly_partitions(cursor)
    expired = sorted((m for m in partitions if (m.year, m.month) < (cutoff.year, cutoff.month)),
                     key=lambda m: (m.year, m.month))
    outcomes = []
    for month in expired:
        outcome = _retire(month, partitions[month], dry_run=dry_run, force=force,
                          export_dir=Path(export_dir) if export_dir else None)
        (log.warning if outcome.action == "refused" else log.info)("ledger retention: %s",
                                                                  outcome)
        outcomes.append(outcome)
    return outcomes


def _current_export(month: Month) -> LedgerExport | None:
    return LedgerExport.objects.filter(month=month.start.date(), dropped_at__isnull=True).first()


def _count(partition: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(partition)}")
        return int(cursor.fetchone()[0])


def _retire(month: Month, partition: str, *, dry_run: bool, force: bool,
            export_dir: Path | None) -> Outcome:
    if export_dir is not None and not dry_run:
        # The export (hours for hundreds of millions of rows) runs before the partition is
        # locked, in its own snapshot: the lock below holds only the count, the rollup check
        # and the drop, not the export (a drain's write into any month would wait for it). A
        # row written into the month meanwhile shows as a count the export does not match:
        # refused below, exported again on the next run.
        export = _current_export(month)
        if export is None or export.rows != _count(partition):
            export_month(month, export_dir / f"ledger-{month}.csv")
    with transaction.atomic():
        with connection.cursor() as cursor:
            # Writes into the month wait until the check and the drop are done.
            cursor.execute(f"LOCK TABLE {connection.ops.quote_name(partition)} IN SHARE MODE")
        rows = _count(partition)
        refused = _refusal(month)
        if refused:
            return Outcome(month, "refused", rows, refused)
        export = _current_export(month)
        exported = export is not None and export.rows == rows
        if not exported and not force:
            why = ("not exported" if export is None
                   else f"exported with {export.rows} rows, the partition has {rows}")
            return Outcome(month, "refused", rows,
                           f"{why}: run `manage.py ledger_export {month} --out FILE` "
                           "(or drop it anyway with --force)")
        if dry_run:
            if exported:
                note = ""
            elif export_dir is not None:
                note = f"would be exported to {export_dir} first"
            else:
                note = "not exported (forced)"
            return Outcome(month, "would drop", rows, note)
        drop_month(month)
        LedgerExport.objects.filter(month=month.start.date()).update(
            dropped_at=datetime.now(UTC))
        return Outcome(month, "dropped", rows)
