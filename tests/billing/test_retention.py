"""Retention of the raw ledger (billing/retention.py): a month's partition is dropped only after
its UTC rollups match its raw rows and it was exported; the export is the month's rows."""
from __future__ import annotations

from typing import Any

import csv
import hashlib
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
import redis
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models import F

from billing.ledger import drain_tenant
from billing.models import LedgerExport, UsageRecord, UsageRollup
from billing.partitions import ensure_partitions, month_of, monthly_partitions, shift
from billing.reports import Month
from billing.retention import apply_retention, export_month, oldest_kept
from quotas.engine import QuotaEngine
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.test_ledger import call
from tests.billing.test_partitions import restamp

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def old_month() -> Month:
    """Three months back: past a one-month retention."""
    return shift(month_of(datetime.now(UTC)), -3)


def drain_into(client: redis.Redis, tenant: Tenant, month: Month, calls: dict[str, str],
               project_slug: str = "web") -> None:
    """Calls made as the gateway makes them, each ending in `month` (drained through the drain,
    so the rollups are what the drain keeps), then the month's partition made (its rows moved
    out of the default partition)."""
    engine = QuotaEngine(client)
    project = create_project(tenant, project_slug, actor="test")
    key = issue_key(project, actor="test").api_key
    for day, (rid, model) in enumerate(calls.items(), start=1):
        call(engine, tenant, project, key.pk, rid, model=model)
        restamp(client, tenant, month.start + timedelta(days=day, hours=5))
        assert drain_tenant(client, tenant.pk) == 1
    ensure_partitions()


def month_rows(month: Month) -> int:
    return UsageRecord.objects.filter(ended_at__gte=month.start, ended_at__lt=month.end).count()


def test_a_verified_exported_month_is_dropped_and_its_rollups_stay(
        client: redis.Redis, acme: Tenant, tmp_path: Path) -> None:
    month = old_month()
    drain_into(client, acme, month, {"r1": "gpt-4o", "r2": "gpt-4o-mini", "r3": "gpt-4o"})
    with connection.cursor() as cursor:
        assert month in monthly_partitions(cursor)
    rollup_requests = sum(UsageRollup.objects.filter(
        zone="UTC", day__gte=month.start.date(), day__lt=month.end.date())
        .values_list("requests", flat=True))
    assert rollup_requests == 3

    outcomes = apply_retention(keep_months=1, export_dir=tmp_path)
    assert [(o.month, o.action, o.rows) for o in outcomes] == [(month, "dropped", 3)]
    with connection.cursor() as cursor:
        assert month not in monthly_partitions(cursor)
    assert month_rows(month) == 0
    # The rollups are now the month's record; the export holds its rows.
    assert sum(UsageRollup.objects.filter(
        zone="UTC", day__gte=month.start.date(), day__lt=month.end.date())
        .values_list("requests", flat=True)) == 3
    export = LedgerExport.objects.get(month=month.start.date())
    assert export.rows == 3 and export.dropped_at is not None
    assert Path(export.path) == (tmp_path / f"ledger-{month}.csv").resolve()


def test_a_tampered_rollup_refuses_the_drop_and_nothing_is_dropped(
        client: redis.Redis, acme: Tenant, tmp_path: Path) -> None:
    month = old_month()
    drain_into(client, acme, month, {"t1": "gpt-4o", "t2": "gpt-4o"})
    export_month(month, tmp_path / "t.csv")
    UsageRollup.objects.filter(zone="UTC", day__gte=month.start.date(),
                               day__lt=month.end.date()).update(
        cost_micros=F("cost_micros") + 1)

    [outcome] = apply_retention(keep_months=1, force=True, export_dir=tmp_path)
    assert (outcome.action, outcome.rows) == ("refused", 2)
    assert "rollups differ" in outcome.reason and "cost_micros" in outcome.reason
    with connection.cursor() as cursor:
        assert month in monthly_partitions(cursor)
    assert month_rows(month) == 2
    assert LedgerExport.objects.get(month=month.start.date()).dropped_at is None
    # The command says so and fails.
    out = StringIO()
    with pytest.raises(CommandError, match="refused"):
        call_command("ledger_retention", "--keep-months", "1", stdout=out)
    assert f"{month} refused" in out.getvalue()


def test_a_month_not_exported_is_refused_unless_forced_and_dry_run_drops_nothing(
        client: redis.Redis, acme: Tenant, settings) -> None:
    settings.TOLLGATE_LEDGER_EXPORT_DIR = ""
    month = old_month()
    drain_into(client, acme, month, {"n1": "gpt-4o"})

    [refused] = apply_retention(keep_months=1)
    assert refused.action == "refused" and "not exported" in refused.reason
    [dry] = apply_retention(keep_months=1, force=True, dry_run=True)
    assert (dry.action, dry.rows) == ("would drop", 1)
    assert month_rows(month) == 1
    out = StringIO()
    call_command("ledger_retention", "--keep-months", "1", "--force", "--dry-run", stdout=out)
    assert f"{month} would drop (1 rows)" in out.getvalue()
    assert month_rows(month) == 1

    [forced] = apply_retention(keep_months=1, force=True)
    assert forced.action == "dropped" and month_rows(month) == 0


def test_rows_that_came_after_the_export_refuse_the_drop(
        client: redis.Redis, acme: Tenant, tmp_path: Path, settings) -> None:
    settings.TOLLGATE_LEDGER_EXPORT_DIR = ""
    month = old_month()
    drain_into(client, acme, month, {"e1": "gpt-4o"})
    export_month(month, tmp_path / "early.csv")
    drain_into(client, acme, month, {"e2": "gpt-4o"}, "web2")  # a late drain into the month
    [outcome] = apply_retention(keep_months=1)
    assert outcome.action == "refused"
    assert "exported with 1 rows, the partition has 2" in outcome.reason


def test_the_daily_export_runs_before_the_lock_and_a_row_written_meanwhile_is_kept(
        client: redis.Redis, acme: Tenant, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The task exports the month before it locks the partition (the lock then holds only the
    count, the rollup check and the drop, not an export of hours). A row the drain writes into
    the month between the export and the lock is not lost: the count no longer matches the
    export, the drop is refused, and the next run exports again and drops."""
    from billing import retention

    month = old_month()
    drain_into(client, acme, month, {"w1": "gpt-4o", "w2": "gpt-4o-mini"})
    real_export = retention.export_month
    exports: list[int] = []

    outside = len(connection.savepoint_ids)  # the test's own transaction

    def export_then_a_late_row(month_: Month, out: Path) -> Any:
        # Not inside the transaction that locks the partition (its savepoint, in a test).
        assert len(connection.savepoint_ids) == outside
        done = real_export(month_, out)
        exports.append(done.rows)
        if len(exports) == 1:
            drain_into(client, acme, month, {"w3": "gpt-4o"}, "late")
        return done

    monkeypatch.setattr(retention, "export_month", export_then_a_late_row)
    [first] = apply_retention(keep_months=1, export_dir=tmp_path)
    assert first.action == "refused" and month_rows(month) == 3
    assert "exported with 2 rows, the partition has 3" in first.reason
    [second] = apply_retention(keep_months=1, export_dir=tmp_path)
    assert (second.action, second.rows) == ("dropped", 3) and exports == [2, 3]
    assert LedgerExport.objects.get(month=month.start.date()).rows == 3
    with (tmp_path / f"ledger-{month}.csv").open() as handle:
        assert len(handle.read().splitlines()) == 1 + 3

def test_retention_off_or_within_the_kept_months_drops_nothing(
        client: redis.Redis, acme: Tenant, tmp_path: Path) -> None:
    month = old_month()
    drain_into(client, acme, month, {"k1": "gpt-4o"})
    assert apply_retention(keep_months=0, export_dir=tmp_path) == []
    assert apply_retention(export_dir=tmp_path) == []  # the setting's default: keep everything
    assert apply_retention(keep_months=3, export_dir=tmp_path) == []
    assert month_rows(month) == 1
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert oldest_kept(now, 1) == Month(2026, 11) and oldest_kept(now, 12) == Month(2025, 12)


def test_the_export_is_the_months_rows_with_inert_text(
        client: redis.Redis, acme: Tenant, tmp_path: Path) -> None:
    month = old_month()
    drain_into(client, acme, month, {"x1": "gpt-4o", "x2": "=HYPERLINK(\"http://x\")",
                                     "x3": "gpt-4o"})
    # A row of the month before and one of the month after are not in it.
    UsageRecord.objects.create(request_id="before", tenant=acme, model="m", served_model="m",
                               status="settled", started_at=month.start - timedelta(hours=1),
                               ended_at=month.start - timedelta(microseconds=1))
    UsageRecord.objects.create(request_id="after", tenant=acme, model="m", served_model="m",
                               status="settled", started_at=month.end, ended_at=month.end)
    out = StringIO()
    call_command("ledger_export", str(month), "--out", str(tmp_path / "m.csv"), stdout=out)
    path = tmp_path / "m.csv"
    assert "3 rows" in out.getvalue()
    with path.open(newline="", encoding="utf-8") as handle:
        lines = list(csv.reader(handle))
    header, body = lines[0], lines[1:]
    assert header == [f.column for f in UsageRecord._meta.concrete_fields]
    got = {line[header.index("request_id")]: dict(zip(header, line, strict=True))
           for line in body}
    assert set(got) == {"x1", "x2", "x3"}
    for record in UsageRecord.objects.filter(request_id__in=got):
        cells = got[record.request_id]
        assert int(cells["id"]) == record.pk
        assert int(cells["cost_micros"]) == record.cost_micros
        assert int(cells["input_tokens"]) == record.input_tokens
        assert cells["tenant_id"] == str(record.tenant_id)
        assert datetime.fromisoformat(cells["ended_at"]) == record.ended_at
        assert cells["corrected_at"] == ""  # NULL
    # A model name a spreadsheet would run is written inert.
    assert got["x2"]["model"] == "'=HYPERLINK(\"http://x\")"
    export = LedgerExport.objects.get(month=month.start.date())
    assert export.rows == 3
    assert export.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not list(tmp_path.glob("*.partial"))  # each run's own .partial, renamed when done


def test_the_export_of_a_bad_month_is_refused() -> None:
    with pytest.raises(CommandError, match="YYYY-MM"):
        call_command("ledger_export", "2026-13", "--out", "/tmp/never.csv")


def test_the_beat_tasks_make_partitions_and_apply_the_setting(
        client: redis.Redis, acme: Tenant, tmp_path: Path, settings) -> None:
    from billing.tasks import ensure_ledger_partitions, ledger_retention

    schedule = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert {"billing.tasks.ensure_ledger_partitions",
            "billing.tasks.ledger_retention"} <= schedule
    month = old_month()
    drain_into(client, acme, month, {"b1": "gpt-4o"})
    assert ensure_ledger_partitions() == 0  # drain_into made them already
    settings.TOLLGATE_LEDGER_RETENTION_MONTHS = 1
    settings.TOLLGATE_LEDGER_EXPORT_DIR = str(tmp_path)
    assert ledger_retention() == 1
    assert month_rows(month) == 0 and (tmp_path / f"ledger-{month}.csv").exists()
