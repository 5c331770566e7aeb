"""make bench-ledger's synthetic ledger (config/bench_ledger.py): valid rows in their months, every
rollup group present on every day already at a small size (so both of the bench's sizes have the
same group set), and rollups that verify against the rows (the bench's figures are of a ledger the
drain could have written). Timings are the bench's to print, not asserted here."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from billing.models import UsageHourly, UsageRecord, UsageRollup
from billing.partitions import default_name, month_of, shift
from billing.rollups import UTC_ZONE, hourly_kept_since, rebuild, verify
from config.bench_ledger import MODELS, STATUSES, _setup_tenants, load

pytestmark = pytest.mark.django_db


def test_the_synthetic_rows_are_valid_ledger_rows_that_the_rollups_match() -> None:
    tenants = _setup_tenants(2)
    now = datetime.now(UTC)
    first = shift(month_of(now), -1)
    days = (now.date() - first.start.date()).days + 1
    per_day = len(tenants) * len(MODELS) * (len(STATUSES) + 1)  # corrected is its own group
    rows = per_day * days + 500  # every group once a day, then random rows
    load(rows, tenants, months=2)
    assert UsageRecord.objects.filter(request_id__startswith="bench-").count() == rows
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {default_name()}")
        assert cursor.fetchone()[0] == 0  # every row in its month's partition
        cursor.execute("SELECT count(DISTINCT tableoid) FROM billing_usagerecord")
        assert cursor.fetchone()[0] == 2
    statuses = set(UsageRecord.objects.values_list("status", flat=True).distinct())
    assert {s for s, _ in STATUSES} == statuses
    assert UsageRecord.objects.filter(corrected_at__isnull=False).exists()
    end = shift(month_of(now), 1).start.date()
    rebuild(first.start.date(), end)
    assert verify(first.start.date(), end) == []
    ids = [t for t, _, _ in tenants]
    rollups = UsageRollup.objects.filter(tenant_id__in=ids, zone=UTC_ZONE)
    # Every group on every day: the group set does not depend on how many rows were loaded.
    assert rollups.count() == per_day * days
    assert rollups.values("day").distinct().count() == days
    assert rollups.filter(corrected=True).values("day").distinct().count() == days
    # The hourly table the forecasts read, filled by the same rebuild: the raw rows' requests
    # and tokens per (tenant, UTC hour, project, key) over the hours it keeps, and none before
    # (compared from an hour later, and checked to an hour earlier: the hour the table keeps
    # from may have moved on since the rebuild).
    kept = hourly_kept_since()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tenant_id, date_trunc('hour', ended_at, 'UTC'), project_id, api_key_id, "
            "count(*), sum(input_tokens + output_tokens) FROM billing_usagerecord "
            "WHERE tenant_id = ANY(%s) AND ended_at >= %s GROUP BY 1, 2, 3, 4",
            [ids, kept + timedelta(hours=1)])
        raw = set(cursor.fetchall())
    hourly = UsageHourly.objects.filter(tenant_id__in=ids)
    assert raw and set(hourly.filter(hour__gte=kept + timedelta(hours=1)).values_list(
        "tenant_id", "hour", "project_id", "api_key_id", "requests", "tokens")) == raw
    assert not hourly.filter(hour__lt=kept - timedelta(hours=1)).exists()
