"""make bench-ledger's synthetic ledger (config/bench_ledger.py): valid rows in their months, and
rollups that verify against them (the bench's figures are of a ledger the drain could have
written). Timings are the bench's to print, not asserted here."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection

from billing.models import UsageRecord
from billing.partitions import default_name, month_of, shift
from billing.rollups import rebuild, verify
from config.bench_ledger import _setup_tenants, load

pytestmark = pytest.mark.django_db


def test_the_synthetic_rows_are_valid_ledger_rows_that_the_rollups_match() -> None:
    tenants = _setup_tenants(3)
    load(3000, tenants, months=3)
    assert UsageRecord.objects.filter(request_id__startswith="bench-").count() == 3000
    now = datetime.now(UTC)
    first = shift(month_of(now), -2)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {default_name()}")
        assert cursor.fetchone()[0] == 0  # every row in its month's partition
        cursor.execute("SELECT count(DISTINCT tableoid) FROM billing_usagerecord")
        assert cursor.fetchone()[0] == 3
    big = UsageRecord.objects.filter(tenant_id=tenants[0][0]).count()
    assert 300 < big < 900  # about BIG_SHARE of them
    statuses = set(UsageRecord.objects.values_list("status", flat=True).distinct())
    assert {"settled", "partial", "released", "swept"} <= statuses
    assert UsageRecord.objects.filter(corrected_at__isnull=False).exists()
    rebuild(first.start.date(), shift(month_of(now), 1).start.date())
    assert verify(first.start.date(), shift(month_of(now), 1).start.date()) == []
