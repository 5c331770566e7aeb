"""The ledger's daily rollup (billing/rollups.py): the drain keeps it exact (redelivered events,
corrections, unmetered and released calls, concurrent drains of one stream), verify() compares
it with the raw rows, and rollup_rebuild recomputes it."""
from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

import pytest
import redis
from django.core.management import CommandError, call_command
from django.db.models import Sum

from billing.ledger import drain_all, drain_tenant
from billing.models import UsageHourly, UsageRecord, UsageRollup
from billing.rollups import RawRowsMissing, rebuild, verify
from tenants.models import Project, Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing import rollup_events as ev

pytestmark = pytest.mark.django_db

KOLKATA = "Asia/Kolkata"  # UTC+05:30: a half-hour zone, its day starts at 18:30 UTC


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def tenant_in(slug: str, zone: str) -> tuple[Tenant, Project, int]:
    tenant = create_tenant(slug, plan_name="standard", actor="test")
    # A tenant whose days were always in `zone` (no change of cycle recorded).
    Tenant.objects.filter(pk=tenant.pk).update(time_zone=zone)
    tenant.refresh_from_db()
    project = create_project(tenant, "web", actor="test")
    return tenant, project, issue_key(project, actor="test").api_key.pk


def at(month: int, day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, month, day, hour, minute, tzinfo=UTC)


def stream_of(project: int, key: int) -> list[dict[str, str]]:
    """Two months of calls of every kind, several near Kolkata's and UTC's midnights."""
    p = {"project": project, "key": key}
    return [
        ev.settled("s1", at(10, 31, 18, 29), **p, inp=10, out=5, money=75),  # Oct 31 both
        ev.settled("s2", at(10, 31, 18, 30), **p, inp=20, out=7, money=101),  # Nov 1 Kolkata
        ev.settled("s3", at(11, 1, 0, 0), **p, model="gpt-4o-mini", money=516_123, cached=40),
        ev.unmetered("u1", at(11, 15, 12), **p),
        ev.released("r1", at(11, 15, 13), **p),
        ev.swept("w1", at(11, 20, 23, 50), **p),  # corrected below, in a later batch
        ev.swept("w2", at(11, 30, 19), **p),  # Dec 1 in Kolkata, Nov 30 in UTC; never corrected
        ev.settled("big", at(11, 21, 10), **p, inp=900, out=300, held=1000, money=9),  # over hold
        ev.settled("s4", at(12, 1, 0, 30), **p, money=3),
        ev.corrected("c-only", at(11, 2, 8), **p),  # its swept row never reached the ledger
    ]


def rollup_sums(tenant: Tenant, zone: str) -> dict[str, int]:
    return {k: int(v or 0) for k, v in UsageRollup.objects.filter(tenant=tenant, zone=zone)
            .aggregate(**{f: Sum(f) for f in UsageRollup.SUM_FIELDS}).items()}


def raw_sums(tenant: Tenant) -> dict[str, int]:
    rows = list(UsageRecord.objects.filter(tenant=tenant))
    out = {f: 0 for f in UsageRollup.SUM_FIELDS}
    for r in rows:
        out["requests"] += 1
        for f in ("input_tokens", "output_tokens", "cached_input_tokens", "cache_write_tokens",
                  "reasoning_tokens", "cost_micros", "over_hold_tokens"):
            out[f] += getattr(r, f)
        out["over_hold_requests"] += r.over_hold_tokens > 0
        out["swept_input_tokens"] += r.swept_input_tokens or 0
        out["swept_output_tokens"] += r.swept_output_tokens or 0
        out["swept_cost_micros"] += r.swept_cost_micros or 0
    return out


def test_the_drain_sums_each_row_once_on_its_utc_and_its_local_day(
        client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-kolkata", KOLKATA)
    events = stream_of(project.pk, key)
    ev.push(client, tenant.pk, events)
    assert drain_tenant(client, tenant.pk) == len(events)
    # Redelivered: the whole batch again (a drain that died after its commit, before XDEL).
    ev.push(client, tenant.pk, events)
    assert drain_tenant(client, tenant.pk) == len(events)
    # The late settle of w1, twice (redelivered).
    late = ev.corrected("w1", at(11, 21, 0, 10), project=project.pk, key=key, inp=100, out=200,
                        money=2000)
    ev.push(client, tenant.pk, [late, late])
    drain_tenant(client, tenant.pk)

    assert UsageRecord.objects.filter(tenant=tenant).count() == len(events)
    raw = raw_sums(tenant)
    assert rollup_sums(tenant, "UTC") == raw
    assert rollup_sums(tenant, KOLKATA) == raw
    assert raw["over_hold_requests"] == 1 and raw["over_hold_tokens"] == 200
    assert verify(date(2026, 10, 1), date(2027, 1, 1)) == []

    kolkata_days = dict(UsageRollup.objects.filter(tenant=tenant, zone=KOLKATA, status="settled",
                                                   served_model="gpt-4o", corrected=False)
                        .values_list("day").annotate(n=Sum("requests")))
    utc_days = dict(UsageRollup.objects.filter(tenant=tenant, zone="UTC", status="settled",
                                               served_model="gpt-4o", corrected=False)
                    .values_list("day").annotate(n=Sum("requests")))
    # s1 at 18:29 UTC is Oct 31 23:59 in Kolkata; s2 a minute later is Nov 1 there.
    assert kolkata_days[date(2026, 10, 31)] == 1 and utc_days[date(2026, 10, 31)] == 2
    assert kolkata_days[date(2026, 11, 1)] == 1
    # The correction moved w1 out of the swept group into settled / corrected, same day.
    moved = UsageRollup.objects.get(tenant=tenant, zone="UTC", day=date(2026, 11, 20),
                                    status="settled", corrected=True)
    assert (moved.requests, moved.cost_micros, moved.swept_cost_micros) == (1, 2000, 5000)
    assert (moved.swept_input_tokens, moved.swept_output_tokens) == (100, 900)
    emptied = UsageRollup.objects.get(tenant=tenant, zone="UTC", day=date(2026, 11, 20),
                                      status="swept", corrected=False)
    assert (emptied.requests, emptied.input_tokens, emptied.cost_micros) == (0, 0, 0)


def test_a_utc_tenant_has_one_rollup_row_per_group(client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-utc", "UTC")
    ev.push(client, tenant.pk, [ev.settled("x1", at(11, 3, 5), project=project.pk, key=key),
                                ev.settled("x2", at(11, 3, 6), project=project.pk, key=key)])
    drain_tenant(client, tenant.pk)
    assert list(UsageRollup.objects.filter(tenant=tenant).values_list("zone", "day", "requests")
                ) == [("UTC", date(2026, 11, 3), 2)]


def test_a_deleted_project_keeps_its_id_in_the_rollup_and_verify_still_agrees(
        client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-deleted", KOLKATA)
    ev.push(client, tenant.pk, [ev.settled("d1", at(11, 4, 5), project=project.pk, key=key)])
    drain_tenant(client, tenant.pk)
    project_id = project.pk
    UsageRecord.objects.filter(project_id=project_id).update(project=None)  # SET_NULL's effect
    assert UsageRollup.objects.filter(tenant=tenant, project_id=project_id).count() == 2
    assert verify(date(2026, 11, 1), date(2026, 12, 1), tenant_id=tenant.pk) == []


def test_verify_names_a_group_whose_rollup_differs() -> None:
    tenant, project, key = tenant_in("roll-verify", "UTC")
    ev.create_usage(request_id="v1", tenant=tenant, project=project, api_key_id=key,
                    model="gpt-4o", served_model="gpt-4o", input_tokens=5, output_tokens=5,
                    cost_micros=77, status="settled", started_at=at(11, 9, 1),
                    ended_at=at(11, 9, 1))
    assert verify(date(2026, 11, 9), date(2026, 11, 10)) == []
    UsageRollup.objects.filter(tenant=tenant).update(cost_micros=76)
    [mismatch] = verify(date(2026, 11, 9), date(2026, 11, 10))
    assert (mismatch.tenant_id, mismatch.day, mismatch.field, mismatch.rollup, mismatch.raw) == (
        tenant.pk, date(2026, 11, 9), "cost_micros", 76, 77)


def test_rollup_rebuild_recomputes_rows_drained_before_the_rollup(client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-rebuild", KOLKATA)
    events = stream_of(project.pk, key)
    ev.push(client, tenant.pk, events)
    drain_tenant(client, tenant.pk)
    expected = sorted(UsageRollup.objects.filter(tenant=tenant, requests__gt=0).values_list(
        "zone", "day", "project_id", "api_key_id", "served_model", "status", "corrected",
        *UsageRollup.SUM_FIELDS))
    UsageRollup.objects.filter(tenant=tenant).delete()  # as before migration 0012
    assert verify(date(2026, 10, 1), date(2027, 1, 1)) != []
    call_command("rollup_rebuild", "--tenant", "roll-rebuild")
    got = sorted(UsageRollup.objects.filter(tenant=tenant, requests__gt=0).values_list(
        "zone", "day", "project_id", "api_key_id", "served_model", "status", "corrected",
        *UsageRollup.SUM_FIELDS))
    assert got == expected
    # One month only, twice: the same rows (a rebuild replaces, never adds).
    call_command("rollup_rebuild", "--tenant", "roll-rebuild", "--month", "2026-11")
    call_command("rollup_rebuild", "--month", "2026-11")
    assert sorted(UsageRollup.objects.filter(tenant=tenant, requests__gt=0).values_list(
        "zone", "day", "project_id", "api_key_id", "served_model", "status", "corrected",
        *UsageRollup.SUM_FIELDS)) == expected


def test_rollup_rebuild_refuses_days_whose_raw_rows_are_gone(client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-gone", "UTC")
    ev.push(client, tenant.pk, [ev.settled("g1", at(11, 5, 5), project=project.pk, key=key)])
    drain_tenant(client, tenant.pk)
    UsageRecord.objects.filter(tenant=tenant).delete()  # a dropped month
    with pytest.raises(RawRowsMissing):
        rebuild(date(2026, 11, 1), date(2026, 12, 1), tenant=tenant)
    with pytest.raises(CommandError, match="no raw rows"):
        call_command("rollup_rebuild", "--tenant", "roll-gone", "--day", "2026-11-05")
    assert UsageRollup.objects.get(tenant=tenant).requests == 1


@pytest.mark.e2e
def test_two_drains_of_one_stream_keep_the_rollup_equal_to_the_raw_rows(
        client: redis.Redis, django_db_blocker: Any) -> None:
    """Two drains read the same entries before either commits (a drain task on two workers):
    the second's inserts wait for the first's commit and insert nothing, so nothing is summed
    twice; the correction in the batch is applied (and moved in the rollup) once."""
    import os
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from tests.gateway.conftest import committed

    slug = f"roll-race-{os.getpid()}-{time.monotonic_ns()}"

    def setup() -> tuple[Tenant, Project, int]:
        return tenant_in(slug, KOLKATA)

    tenant, project, key = committed(django_db_blocker, setup)
    events = stream_of(project.pk, key) + [
        ev.corrected("w1", at(11, 21, 0, 10), project=project.pk, key=key)]
    events = [{**e, "request_id": f"{slug}-{e['request_id']}"} for e in events]
    ev.push(client, tenant.pk, events)
    both_read = threading.Barrier(2)

    class ReadTogether:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def xrange(self, *args: Any, **kwargs: Any) -> Any:
            entries = client.xrange(*args, **kwargs)
            both_read.wait(timeout=30)
            return entries

    def drain() -> int:
        try:
            return drain_tenant(ReadTogether(), tenant.pk)
        finally:
            connection.close()

    try:
        with django_db_blocker.unblock(), ThreadPoolExecutor(2) as pool:
            assert [f.result() for f in [pool.submit(drain) for _ in range(2)]] == [
                len(events)] * 2

        def check() -> None:
            assert UsageRecord.objects.filter(tenant=tenant).count() == len(events) - 1
            raw = raw_sums(tenant)
            assert raw["swept_cost_micros"] == 10_000  # w1 corrected once (5000), c-only (5000)
            assert rollup_sums(tenant, "UTC") == raw
            assert rollup_sums(tenant, KOLKATA) == raw
            assert verify(date(2026, 10, 1), date(2027, 1, 1), tenant_id=tenant.pk) == []
            # The hourly table (upserted in the rollup's statement) counted once too.
            hourly = UsageHourly.objects.filter(tenant=tenant).aggregate(
                r=Sum("requests"), t=Sum("tokens"))
            assert (hourly["r"], hourly["t"]) == (
                raw["requests"], raw["input_tokens"] + raw["output_tokens"])

        committed(django_db_blocker, check)
    finally:
        def clean() -> None:
            UsageRollup.objects.filter(tenant=tenant).delete()
            UsageHourly.objects.filter(tenant=tenant).delete()
            UsageRecord.objects.filter(tenant=tenant).delete()
        committed(django_db_blocker, clean)


def test_drain_all_moves_every_tenant_with_its_rollup(client: redis.Redis) -> None:
    tenant, project, key = tenant_in("roll-all", KOLKATA)
    ev.push(client, tenant.pk, [ev.settled("a1", at(11, 6, 20), project=project.pk, key=key)])
    assert drain_all(client).events >= 1
    assert rollup_sums(tenant, KOLKATA) == rollup_sums(tenant, "UTC") == raw_sums(tenant)
