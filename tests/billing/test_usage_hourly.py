"""The ledger's tokens per UTC hour (billing.UsageHourly): the drain keeps them in the statement
of its daily rollup (inserts and corrections), rollup_rebuild recomputes them, the daily
partition task prunes them, and the forecasts read them (billing.forecast._ledger_hours) with
the same answer the raw rows gave."""
from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis
from django.db import connection
from django.db.models import F, Sum
from django.db.models.functions import Trunc
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.forecast import _ledger_hours
from billing.ledger import drain_all
from billing.models import UsageHourly, UsageRecord
from billing.rollups import hour_of, hourly_kept_since, prune_hourly, rebuild
from billing.tasks import ensure_ledger_partitions
from quotas.limits import KEY, PROJECT, TENANT
from tenants.models import ApiKey, Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing import rollup_events as ev

pytestmark = pytest.mark.django_db
HOUR_MS = 3_600_000
Hours = dict[tuple[str, int | None], dict[int, int]]


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def raw_hours(tenant: Tenant, start_ms: int, end_ms: int) -> Hours:
    """What _ledger_hours answered before the hourly table: the raw rows of [start, end) summed
    by UTC hour, per tenant, project and key (zero hours left out)."""
    rows = (UsageRecord.objects
            .filter(tenant=tenant, ended_at__gte=datetime.fromtimestamp(start_ms / 1000, UTC),
                    ended_at__lt=datetime.fromtimestamp(end_ms / 1000, UTC))
            .annotate(hour=Trunc("ended_at", "hour", tzinfo=UTC))
            .values("hour", "project_id", "api_key_id")
            .annotate(tokens=Sum(F("input_tokens") + F("output_tokens"))).order_by())
    out: Hours = {}
    for row in rows:
        hour = _ms(row["hour"])
        for scope in ((TENANT, None), (PROJECT, row["project_id"]), (KEY, row["api_key_id"])):
            if scope[0] != TENANT and scope[1] is None:
                continue
            hours = out.setdefault(scope, {})
            hours[hour] = hours.get(hour, 0) + int(row["tokens"] or 0)
    return {scope: {h: t for h, t in hours.items() if t} for scope, hours in out.items()
            if any(hours.values())}


def hourly_rows(tenant: Tenant) -> set[tuple[datetime, int | None, int | None, int, int]]:
    return set(UsageHourly.objects.filter(tenant=tenant).values_list(
        "hour", "project_id", "api_key_id", "requests", "tokens"))


def busy_tenant(client: redis.Redis) -> tuple[Tenant, datetime, dict[str, int]]:
    """A tenant with two projects and three keys, drained over four recent UTC hours: settled,
    unmetered, released and swept calls, corrections (in the swept row's batch, in a later
    batch, and one whose swept row never came), calls without a project or key, and a key
    deleted before its calls were drained (its rows' key NULL). Returns it, the first hour and
    the ids."""
    tenant = create_tenant(f"hourly-{uuid.uuid4().hex[:8]}", plan_name="standard", actor="test")
    web = create_project(tenant, "web", actor="test")
    batch = create_project(tenant, "batch", actor="test")
    web_key = issue_key(web, actor="test").api_key
    web_key2 = issue_key(web, actor="test").api_key
    batch_key = issue_key(batch, actor="test").api_key
    ids = {"web": web.pk, "batch": batch.pk, "web_key": web_key.pk, "web_key2": web_key2.pk,
           "batch_key": batch_key.pk}
    # Two days back: inside the hours the table keeps, whole hours before now.
    first = hour_of(timezone.now() - timedelta(days=2))
    t = tenant.slug
    w = {"project": web.pk, "key": web_key.pk}
    w2 = {"project": web.pk, "key": web_key2.pk}
    b = {"project": batch.pk, "key": batch_key.pk}
    ev.push(client, tenant.pk, [
        ev.settled(f"{t}-1", first + timedelta(minutes=5), **w, inp=100, out=50),
        ev.settled(f"{t}-2", first + timedelta(minutes=59, seconds=59), **w2, inp=7, out=3),
        ev.settled(f"{t}-3", first + timedelta(hours=1), **b, inp=1000, out=1),
        ev.unmetered(f"{t}-4", first + timedelta(hours=1, minutes=30), **w),
        ev.released(f"{t}-5", first + timedelta(hours=1, minutes=31), **b),
        ev.settled(f"{t}-6", first + timedelta(hours=2), project=None, key=None, inp=40, out=2),
        ev.settled(f"{t}-7", first + timedelta(hours=2, minutes=10), project=web.pk, key=None,
                   inp=11, out=0),
        ev.swept(f"{t}-w1", first + timedelta(hours=2, minutes=20), **w, inp=100, out=900),
        ev.swept(f"{t}-w2", first + timedelta(hours=3, minutes=1), **b, inp=300, out=0),
        ev.corrected(f"{t}-w2", first + timedelta(hours=3, minutes=5), **b, inp=30, out=70),
        ev.corrected(f"{t}-c-only", first + timedelta(hours=3, minutes=40), **w2, inp=5,
                     out=6),
        ev.swept(f"{t}-w3", first + timedelta(hours=3, minutes=50), **w2, inp=50, out=50),
    ])
    web_key2.delete()  # deleted before the drain: its rows' (and their hours') key is NULL
    assert drain_all(client, batch=4, tenant_ids=[tenant.pk]).events == 12
    # A late settle of w1 and a late release of w3, drained after their swept rows.
    ev.push(client, tenant.pk, [
        ev.corrected(f"{t}-w1", first + timedelta(hours=5), **w, inp=20, out=30),
        {**ev.released(f"{t}-w3", first + timedelta(hours=5), project=web.pk, key=None),
         "outcome": "corrected"},
    ])
    assert drain_all(client, tenant_ids=[tenant.pk]).corrected == 2
    return tenant, first, ids


def test_the_forecasts_hours_are_the_raw_rows_sums(client: redis.Redis) -> None:
    tenant, first, ids = busy_tenant(client)
    # A key deleted after the drain: its raw rows' key becomes NULL, its hourly rows keep the
    # id; it is no scope of a forecast any more, and the tenant's and project's sums hold.
    assert UsageRecord.objects.filter(api_key_id=ids["batch_key"]).count() == 3
    ApiKey.objects.filter(pk=ids["batch_key"]).delete()
    assert not UsageRecord.objects.filter(api_key_id=ids["batch_key"]).exists()
    start, end = _ms(first) - 24 * HOUR_MS, _ms(timezone.now()) + 1
    raw = raw_hours(tenant, start, end)
    with CaptureQueriesContext(connection) as queries:
        hourly = _ledger_hours(tenant, {PROJECT, KEY}, start, end)
    assert len(queries.captured_queries) == 1  # every scope in one query
    # Every scope a forecast can ask for: the tenant, the projects, the live key.
    for scope in [(TENANT, None), (PROJECT, ids["web"]), (PROJECT, ids["batch"]),
                  (KEY, ids["web_key"])]:
        assert hourly.get(scope, {}) == raw.get(scope, {}), scope
    # The deleted key's hours stay under its id only in the hourly table.
    assert (KEY, ids["batch_key"]) in hourly and (KEY, ids["batch_key"]) not in raw
    assert {scope for scope in hourly if scope != (KEY, ids["batch_key"])} == set(raw)
    f = _ms(first)
    assert raw[(TENANT, None)] == {
        f: 160,  # 150 + 10
        f + HOUR_MS: 1001 + 100,  # settled + unmetered; the release carries nothing
        f + 2 * HOUR_MS: 42 + 11 + 50,  # w1 corrected to 20 + 30 in its ended hour
        f + 3 * HOUR_MS: 100 + 11,  # w2 corrected to 30 + 70, c-only 5 + 6, w3 released: 0
    }
    # Only the tenant's scope asked: the per-hour sums, one query, no project or key.
    assert _ledger_hours(tenant, set(), start, end) == {(TENANT, None): raw[(TENANT, None)]}


def test_rollup_rebuild_recomputes_the_hourly_rows(client: redis.Redis) -> None:
    tenant, first, _ids = busy_tenant(client)
    drained = hourly_rows(tenant)
    # What the drain left: one row per (hour, project, key) with requests, and a corrected
    # row's delta in its hour (w1's 1,000 swept tokens became 50 at first + 2 h).
    assert (first + timedelta(hours=2), None, None, 1, 42) in drained
    UsageHourly.objects.filter(tenant=tenant).delete()  # as before migration 0014
    rebuild(first.date() - timedelta(days=1), first.date() + timedelta(days=2), tenant=tenant)
    assert hourly_rows(tenant) == drained
    # Rebuilding again changes nothing (the range's rows are replaced, not added to).
    rebuild(first.date(), first.date() + timedelta(days=1), tenant=tenant)
    assert hourly_rows(tenant) == drained


def test_rebuild_and_prune_keep_only_the_forecasts_history() -> None:
    tenant = create_tenant(f"prune-{uuid.uuid4().hex[:8]}", plan_name="standard", actor="test")
    kept_since = hourly_kept_since()
    old, recent = kept_since - timedelta(hours=1), kept_since + timedelta(hours=1)
    for hour in (old, recent):
        UsageHourly.objects.create(tenant=tenant, hour=hour, requests=1, tokens=10)
    # The daily partition task prunes the hours older than the forecasts read.
    ensure_ledger_partitions()
    assert list(UsageHourly.objects.filter(tenant=tenant).values_list("hour", flat=True)) == [
        recent]
    assert prune_hourly() == 0
    # A rebuild over old days does not bring their hours back (it deletes them).
    UsageHourly.objects.create(tenant=tenant, hour=old, requests=1, tokens=10)
    ev_old = old - timedelta(minutes=1)
    UsageRecord.objects.create(
        request_id=f"{tenant.slug}-old", tenant=tenant, model="gpt-4o", served_model="gpt-4o",
        input_tokens=5, output_tokens=5, cost_micros=0, status=UsageRecord.Status.SETTLED,
        started_at=ev_old, ended_at=ev_old)
    rebuild(old.date() - timedelta(days=1), old.date() + timedelta(days=1), tenant=tenant,
            force=True)
    assert not UsageHourly.objects.filter(tenant=tenant, hour__lt=kept_since).exists()
