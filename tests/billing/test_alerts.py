"""Threshold alerts and the pending-holds health check, over the session's Redis (the engine of
quotas.runtime) and PostgreSQL; one test in a real Celery worker with beat."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail

from billing.alerts import (
    check_pending_health,
    check_thresholds,
)
from billing.models import AlertState, WebhookDelivery
from billing.webhooks import create_endpoint, verify_signature
from quotas.client import make_redis
from quotas import active, keys
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.cycles import calendar_for, schedule_for
from quotas.windows import Calendar, WindowKind
from tenants.models import Membership, Tenant
from tenants.services import create_project, create_tenant
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
LIMIT = 10_000


@pytest.fixture
def engine() -> QuotaEngine:
    return get_engine()


@pytest.fixture
def allow_private(settings: Any) -> Any:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    return settings


def make_tenant(slug: str, plan: str = "free", **overrides: Any) -> Tenant:
    tenant = create_tenant(slug, plan_name=plan, actor="test",
                           **{"tokens_per_day": LIMIT, **overrides})
    return Tenant.objects.select_related("plan").get(pk=tenant.pk)


def add_owner(tenant: Tenant, username: str, email: str, role: str = "owner") -> None:
    user = get_user_model().objects.create_user(username, email=email)
    Membership.objects.create(user=user, tenant=tenant, role=role)


def spend(engine: QuotaEngine, tenant: Tenant, tokens: int, rid: str, *,
          scopes: tuple[ScopeLimit, ...] | None = None, settle: bool = True) -> None:
    """What the gateway does: reserve in the tenant's windows, then settle with the actual
    tokens (or keep the hold)."""
    scopes = scopes or (ScopeLimit("tenant", DAY, LIMIT),)
    hold = engine.reserve(ReserveRequest(tenant_tag(tenant.pk), rid, tokens, scopes,
                                         schedule=schedule_for(tenant))).hold
    assert hold is not None, f"{rid} refused"
    if settle:
        engine.settle(hold, tokens)


def today() -> str:
    """Today's window id: the tenants here are all in UTC."""
    return Calendar().window(DAY, get_engine().clock.now_ms()).id


def this_cycle(tenant: Tenant) -> str:
    """The tenant's current cycle window: the free plan's resets daily (c2026-12-01)."""
    return calendar_for(tenant).window(MONTH, get_engine().clock.now_ms()).id


def fired(tenant: Tenant) -> list[tuple[str, str, int]]:
    return list(AlertState.objects.filter(tenant=tenant).order_by("fired_at", "pk")
                .values_list("scope", "window", "threshold"))


def test_each_threshold_fires_once_then_exhaustion(
        engine: QuotaEngine, allow_private: Any) -> None:
    acme = make_tenant("acme")
    add_owner(acme, "olga", "olga@acme.test")
    add_owner(acme, "mike", "mike@acme.test", role="member")
    with Receiver() as receiver:
        both, _ = create_endpoint(acme, receiver.url, ["quota.threshold", "quota.exhausted"],
                                  actor="t")
        only_exhausted, _ = create_endpoint(acme, receiver.url, ["quota.exhausted"], actor="t")
    spend(engine, acme, 8_900, "r1")
    assert check_thresholds([acme.pk]) == [] and fired(acme) == []

    spend(engine, acme, 100, "r2")  # exactly 10% left
    [alert] = check_thresholds([acme.pk])
    assert (alert.scope, alert.window, alert.threshold, alert.event_type) == (
        "tenant", today(), 10, "quota.threshold")
    assert (alert.limit, alert.used, alert.pending, alert.remaining) == (LIMIT, 9_000, 0, 1_000)
    [delivery] = WebhookDelivery.objects.filter(pk__in=alert.delivery_ids)
    assert delivery.endpoint_id == both.pk and delivery.status == "pending"
    assert {k: v for k, v in delivery.payload.items() if k not in ("id", "created")} == {
        "type": "quota.threshold", "tenant": "acme", "scope": "tenant", "window": today(),
        "limit": LIMIT, "used": 9_000, "pending": 0, "remaining": 1_000, "threshold": 10}
    assert alert.emailed == ("olga@acme.test",)
    [message] = mail.outbox
    assert message.to == ["olga@acme.test"] and "10%" in message.subject
    assert check_thresholds([acme.pk]) == []  # once per window

    spend(engine, acme, 700, "r3")  # 3% left: 5% fires, 10% does not again
    assert [a.threshold for a in check_thresholds([acme.pk])] == [5]

    spend(engine, acme, 300, "r4")  # nothing left
    [exhausted] = check_thresholds([acme.pk])
    assert (exhausted.threshold, exhausted.event_type, exhausted.remaining) == (
        0, "quota.exhausted", 0)
    assert sorted(WebhookDelivery.objects.filter(pk__in=exhausted.delivery_ids)
                  .values_list("endpoint_id", flat=True)) == sorted([both.pk, only_exhausted.pk])
    assert fired(acme) == [("tenant", today(), 10), ("tenant", today(), 5), ("tenant", today(), 0)]
    assert WebhookDelivery.objects.filter(endpoint__tenant=acme).count() == 4
    assert len(mail.outbox) == 3 and "exhausted" in mail.outbox[-1].subject
    assert check_thresholds([acme.pk]) == []


def test_a_jump_past_several_thresholds_fires_each_highest_first(engine: QuotaEngine) -> None:
    acme = make_tenant("acme", alert_thresholds=[5, 50, 10])
    spend(engine, acme, 9_990, "big")
    assert [a.threshold for a in check_thresholds([acme.pk])] == [50, 10, 5]
    assert mail.outbox == []  # no owner with an address: no mail, and no error


def test_holds_in_flight_count_against_remaining(engine: QuotaEngine) -> None:
    acme = make_tenant("acme")
    spend(engine, acme, 8_000, "done")
    spend(engine, acme, 1_200, "in-flight", settle=False)
    [alert] = check_thresholds([acme.pk])
    assert (alert.threshold, alert.used, alert.pending, alert.remaining) == (10, 8_000, 1_200, 800)


def test_credit_from_a_recharge_counts_as_remaining(engine: QuotaEngine) -> None:
    acme = make_tenant("acme")
    spend(engine, acme, 9_500, "a")
    engine.recharge(tenant_tag(acme.pk), ScopeLimit("tenant", DAY, LIMIT), 5_000)
    assert check_thresholds([acme.pk]) == []


def test_unlimited_and_untouched_tenants_never_alert(engine: QuotaEngine) -> None:
    free = make_tenant("free", tokens_per_day=-1)
    spend(engine, free, 50_000, "x", scopes=(ScopeLimit("tenant", DAY, -1),))
    idle = make_tenant("idle")
    assert check_thresholds([free.pk, idle.pk, 987_654]) == []


def test_projects_with_their_own_limit_and_monthly_budgets(engine: QuotaEngine) -> None:
    acme = make_tenant("acme", monthly_token_budget=20_000)
    web = create_project(acme, "web", actor="t", tokens_per_day=1_000)
    create_project(acme, "batch", actor="t")  # no limit of its own: not watched
    scopes = (ScopeLimit("tenant", DAY, LIMIT), ScopeLimit("tenant", MONTH, 20_000),
              ScopeLimit(f"project:{web.pk}", DAY, 1_000))
    spend(engine, acme, 960, "p1", scopes=scopes)
    alerts = check_thresholds([acme.pk])
    assert [(a.scope, a.label, a.window, a.threshold) for a in alerts] == [
        (f"project:{web.pk}", "project:web", today(), 10),
        (f"project:{web.pk}", "project:web", today(), 5)]
    # The month budget: 19_000 of 20_000 used (5% left) while the day is fine.
    engine.recharge(tenant_tag(acme.pk), ScopeLimit(f"project:{web.pk}", DAY, 1_000), 100_000)
    engine.recharge(tenant_tag(acme.pk), ScopeLimit("tenant", DAY, LIMIT), 100_000)
    spend(engine, acme, 18_040, "p2", scopes=scopes)
    alerts = check_thresholds([acme.pk])
    assert [(a.scope, a.window, a.threshold) for a in alerts] == [
        ("tenant", this_cycle(acme), 10), ("tenant", this_cycle(acme), 5)]
    assert this_cycle(acme) == f"c{today()[1:]}"  # the free plan's cycle is the day
    delivery_free = [a for a in alerts if a.delivery_ids]
    assert delivery_free == []  # no endpoint configured


# -- the edge of a window, and refusals --------------------------------------------------------


def yesterday() -> Any:
    """Yesterday's day window (UTC), on the Redis clock."""
    today_window = Calendar().window(DAY, get_engine().clock.now_ms())
    return Calendar().window(DAY, today_window.start_ms - 1)


def counter_in(engine: QuotaEngine, tenant: Tenant, window_id: str, *, limit: int, used: int,
               scope: str = "tenant") -> str:
    """A counter of an ended window, as the reserve and settle scripts left it; counters live
    on for two days after their window (QUOTA_COUNTER_GRACE_SECONDS)."""
    key = keys.counter_key(tenant_tag(tenant.pk), scope, window_id)
    engine.client.hset(key, mapping={"limit": limit, "used": used, "pending": 0, "credit": 0})
    engine.client.expire(key, 2 * 86400)
    return key


def test_a_settle_at_23_59_59_9_is_alerted_after_midnight_for_its_day(
        engine: QuotaEngine) -> None:
    """The drain moves the event after midnight: the alert is for the window the hold was made
    in (from the event's `created`), not for the new day."""
    from billing.tasks import drain_usage

    acme = make_tenant("acme")
    add_owner(acme, "olga", "olga@acme.test")
    day = yesterday()
    # 8_900 used before; the last call of the day, reserved at 23:59:59.9, settles 150 more.
    counter_in(engine, acme, day.id, limit=LIMIT, used=9_050)
    engine.client.xadd(keys.usage_stream_key(tenant_tag(acme.pk)), {
        "request_id": "last-call", "outcome": "settled", "held": 200, "actual": 150,
        "money": 0, "created": day.end_ms - 100, "ended": day.end_ms + 400, "meta": "{}",
        "event": json.dumps({"in": 100, "out": 50, "outcome": "complete"})})
    # Written as lua/settle.lua writes it; the engine that runs the script marks the tenant for
    # the jobs (quotas/active.py), so this does too.
    active.mark(engine.client, [tenant_tag(acme.pk)])

    assert drain_usage() == 1
    assert fired(acme) == [("tenant", day.id, 10)]
    [message] = mail.outbox
    assert "10%" in message.subject and day.id in message.body
    assert check_thresholds([acme.pk]) == []  # the beat finds it done


def test_a_drain_run_that_fails_part_way_checks_the_windows_it_committed(
        engine: QuotaEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tenants' last calls of yesterday, drained after midnight; PostgreSQL goes away after
    the first tenant's batch committed. That batch's events are gone from its stream, so no
    later run brings its window back, and the per-minute check looks at current windows only:
    the failing run itself alerts for what it committed, then raises. The second tenant's
    events wait in its stream, and the next run alerts for them."""
    from django.db import OperationalError

    from billing import ledger
    from billing.tasks import drain_usage

    day = yesterday()
    acme, globex = make_tenant("acme"), make_tenant("globex")
    for tenant in (acme, globex):
        counter_in(engine, tenant, day.id, limit=LIMIT, used=9_050)
        engine.client.xadd(keys.usage_stream_key(tenant_tag(tenant.pk)), {
            "request_id": f"last-call-{tenant.slug}", "outcome": "settled", "held": 200,
            "actual": 150, "money": 0, "created": day.end_ms - 100, "ended": day.end_ms + 400,
            "meta": "{}", "event": json.dumps({"in": 100, "out": 50, "outcome": "complete"})})
    active.mark(engine.client, [tenant_tag(acme.pk), tenant_tag(globex.pk)])
    write = ledger._write

    def gone_after_acme(batches: Any, zones: Any) -> int:
        if any(b.tenant_id == globex.pk for b in batches):
            raise OperationalError("server closed the connection unexpectedly")
        return write(batches, zones)

    with monkeypatch.context() as outage:
        outage.setattr(ledger, "_PREFETCH_TENANTS", 1)  # acme's group commits before globex's
        outage.setattr(ledger, "_write", gone_after_acme)
        with pytest.raises(OperationalError):
            drain_usage()
    assert fired(acme) == [("tenant", day.id, 10)]
    assert fired(globex) == []
    assert engine.client.xlen(keys.usage_stream_key(tenant_tag(acme.pk))) == 0
    assert engine.client.xlen(keys.usage_stream_key(tenant_tag(globex.pk))) == 1
    assert drain_usage() == 1
    assert fired(globex) == [("tenant", day.id, 10)]
    assert fired(acme) == [("tenant", day.id, 10)]  # once


def test_the_beat_checks_the_previous_day_as_well(engine: QuotaEngine) -> None:
    acme = make_tenant("acme")
    day = yesterday()
    counter_in(engine, acme, day.id, limit=LIMIT, used=9_600)
    spend(engine, acme, 100, "today")  # today is fine
    alerts = check_thresholds([acme.pk])
    assert [(a.window, a.threshold, a.used, a.remaining) for a in alerts] == [
        (day.id, 10, 9_600, 400), (day.id, 5, 9_600, 400)]
    assert check_thresholds([acme.pk]) == []


def test_on_the_first_of_the_month_the_previous_month_is_checked(engine: QuotaEngine) -> None:
    """At 00:00:05 on December 1st the November budget's counter is still there; a settle in
    its last second that crossed a threshold alerts for m2026-11 (and its last day)."""
    from datetime import UTC, datetime

    from quotas.windows import RedisClock

    # A plan whose cycle is the calendar month (the free plan's is the day).
    acme = make_tenant("acme", plan="standard", monthly_token_budget=100_000)
    first = datetime(2026, 12, 1, 0, 0, 5, tzinfo=UTC).timestamp()
    at_midnight = QuotaEngine(engine.client, clock=RedisClock(lambda: first))
    counter_in(engine, acme, "m2026-11", limit=100_000, used=95_500)
    alerts = check_thresholds([acme.pk], engine=at_midnight)
    assert [(a.window, a.threshold) for a in alerts] == [("m2026-11", 10), ("m2026-11", 5)]


def count_refusals(redis_url: str, tenant: Tenant, reason: str, times: int) -> None:
    """What the gateway does for each refused call (gateway/refusals.py)."""
    import asyncio

    import redis.asyncio

    from gateway.refusals import count_refusal

    async def run() -> None:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            for _ in range(times):
                await count_refusal(client, tenant_tag(tenant.pk), reason)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_calls_refused_for_quota_fire_exhausted_before_zero_is_left(
        engine: QuotaEngine, redis_url: str, allow_private: Any) -> None:
    """The measured case: a 2,000-token tenant stopped at 13 tokens left, its calls refused."""
    acme = make_tenant("acme", tokens_per_day=2_000)
    with Receiver() as receiver:
        create_endpoint(acme, receiver.url, ["quota.exhausted"], actor="t")
    scopes = (ScopeLimit("tenant", DAY, 2_000),)
    spend(engine, acme, 1_987, "big", scopes=scopes)
    assert [a.threshold for a in check_thresholds([acme.pk])] == [10, 5]

    refused = engine.reserve(ReserveRequest(tenant_tag(acme.pk), "next", 100, scopes))
    assert not refused.admitted and refused.outcome == "quota"
    count_refusals(redis_url, acme, "quota_tenant", 3)
    [alert] = check_thresholds([acme.pk])
    assert (alert.event_type, alert.threshold, alert.window, alert.remaining) == (
        "quota.exhausted", 0, today(), 13)
    [delivery] = WebhookDelivery.objects.filter(pk__in=alert.delivery_ids)
    assert delivery.payload["type"] == "quota.exhausted" and delivery.payload["remaining"] == 13
    # Once per window: more refusals, or the last tokens used, fire nothing more.
    count_refusals(redis_url, acme, "quota_tenant", 2)
    spend(engine, acme, 13, "last", scopes=scopes)
    assert check_thresholds([acme.pk]) == []


def test_other_refusals_do_not_mean_exhausted(engine: QuotaEngine, redis_url: str) -> None:
    acme = make_tenant("acme", tokens_per_day=2_000)
    spend(engine, acme, 1_000, "half", scopes=(ScopeLimit("tenant", DAY, 2_000),))
    count_refusals(redis_url, acme, "rate_limit", 5)
    count_refusals(redis_url, acme, "quota_key", 5)
    assert check_thresholds([acme.pk]) == []


def test_project_refusals_fire_exhausted_for_the_project_that_is_out(
        engine: QuotaEngine, redis_url: str) -> None:
    acme = make_tenant("acme", tokens_per_day=100_000)
    web = create_project(acme, "web", actor="t", tokens_per_day=1_000)
    batch = create_project(acme, "batch", actor="t", tokens_per_day=1_000)
    tenant_day = ScopeLimit("tenant", DAY, 100_000)
    spend(engine, acme, 987, "w", scopes=(tenant_day, ScopeLimit(f"project:{web.pk}", DAY, 1_000)))
    spend(engine, acme, 500, "b",
          scopes=(tenant_day, ScopeLimit(f"project:{batch.pk}", DAY, 1_000)))
    assert [(a.scope, a.threshold) for a in check_thresholds([acme.pk])] == [
        (f"project:{web.pk}", 10), (f"project:{web.pk}", 5)]

    count_refusals(redis_url, acme, "quota_project", 1)
    [alert] = check_thresholds([acme.pk])
    assert (alert.scope, alert.label, alert.threshold, alert.remaining) == (
        f"project:{web.pk}", "project:web", 0, 13)


def test_the_only_limited_project_is_the_one_refusing(engine: QuotaEngine, redis_url: str) -> None:
    acme = make_tenant("acme", tokens_per_day=100_000)
    web = create_project(acme, "web", actor="t", tokens_per_day=1_000)
    spend(engine, acme, 600, "w", scopes=(ScopeLimit("tenant", DAY, 100_000),
                                          ScopeLimit(f"project:{web.pk}", DAY, 1_000)))
    count_refusals(redis_url, acme, "quota_project", 1)  # a 500-token call did not fit
    [alert] = check_thresholds([acme.pk])
    assert (alert.scope, alert.threshold, alert.remaining) == (f"project:{web.pk}", 0, 400)


def test_refusals_in_the_last_minute_of_a_day_alert_for_that_day(engine: QuotaEngine) -> None:
    acme = make_tenant("acme", tokens_per_day=2_000)
    day = yesterday()
    counter_in(engine, acme, day.id, limit=2_000, used=1_990)
    refused = keys.refused_key(tenant_tag(acme.pk), day.id)
    engine.client.hset(refused, "quota_tenant", 4)
    engine.client.expire(refused, 3 * 86400)
    alerts = check_thresholds([acme.pk])
    assert [(a.window, a.threshold, a.remaining) for a in alerts] == [
        (day.id, 10, 10), (day.id, 5, 10), (day.id, 0, 10)]


def check_thresholds_committed(django_db_blocker: Any, tenant_id: int) -> int:
    from tests.gateway.conftest import committed

    return len(committed(django_db_blocker, lambda: check_thresholds([tenant_id])))


@pytest.mark.e2e
def test_a_hundred_concurrent_settles_and_racing_detectors_fire_each_alert_once(
        engine: QuotaEngine, allow_private: Any, django_db_blocker: Any) -> None:
    """100 requests settle across the 10%, 5% and exhausted marks at the same moment while eight
    detectors run check_thresholds in threads: one AlertState per threshold, one delivery per
    endpoint per threshold, one mail per alert."""
    from django.db import connection

    from tests.gateway.conftest import committed

    slug = f"race-{os.getpid()}-{time.monotonic_ns()}"

    def setup() -> tuple[Tenant, list[int]]:
        tenant = make_tenant(slug)
        add_owner(tenant, f"owner-{slug}", "owner@race.test")
        endpoints = [create_endpoint(tenant, "http://127.0.0.1:9/hook",
                                     ["quota.threshold", "quota.exhausted"], actor="t")[0].pk
                     for _ in range(2)]
        return tenant, endpoints

    tenant, endpoint_ids = committed(django_db_blocker, setup)  # with its plan: its windows
    tenant_id = tenant.pk
    spend(engine, tenant, 8_000, "warmup")  # 20% left: nothing due yet
    # Tiny holds that settle bigger (the upstream's usage may exceed the hold): every mark is
    # crossed by the settles themselves, not by the reservations.
    holds = [engine.reserve(ReserveRequest(tenant_tag(tenant_id), f"c{i}", 1,
                                           (ScopeLimit("tenant", DAY, LIMIT),))).hold
             for i in range(100)]
    assert check_thresholds_committed(django_db_blocker, tenant_id) == 0
    assert all(holds)
    settling = threading.Event()
    start = threading.Barrier(100 + 8)

    def settle(i: int) -> None:
        start.wait()
        engine.settle(holds[i], 20)  # 100 x 20 = 2_000: exactly nothing left at the end

    def detect() -> int:
        try:
            start.wait()
            count = 0
            while settling.is_set():
                count += len(check_thresholds([tenant_id]))
            return count + len(check_thresholds([tenant_id]))
        finally:
            connection.close()

    settling.set()
    with django_db_blocker.unblock(), ThreadPoolExecutor(108) as pool:
        detectors = [pool.submit(detect) for _ in range(8)]
        settles = [pool.submit(settle, i) for i in range(100)]
        for f in settles:
            f.result()
        settling.clear()
        fired_counts = [f.result() for f in detectors]
        # And once more, all eight at the same instant after the dust settled.
        again = threading.Barrier(8)

        def final() -> int:
            try:
                again.wait()
                return len(check_thresholds([tenant_id]))
            finally:
                connection.close()

        assert sum(pool.map(lambda _: final(), range(8))) == 0

    counter = engine.counter(tenant_tag(tenant_id), "tenant")
    assert (counter.used, counter.pending) == (LIMIT, 0)
    assert sum(fired_counts) == 3

    def outcome() -> tuple[list[int], dict[tuple[int, str], int]]:
        states = sorted(AlertState.objects.filter(tenant_id=tenant_id)
                        .values_list("threshold", flat=True))
        per: dict[tuple[int, str], int] = {}
        for endpoint_id, payload in WebhookDelivery.objects.filter(
                endpoint_id__in=endpoint_ids).values_list("endpoint_id", "payload"):
            per[(endpoint_id, payload["threshold"])] = per.get(
                (endpoint_id, payload["threshold"]), 0) + 1
        return states, per

    states, per_endpoint = committed(django_db_blocker, outcome)
    assert states == [0, 5, 10]
    assert per_endpoint == {(e, t): 1 for e in endpoint_ids for t in (0, 5, 10)}
    assert len([m for m in mail.outbox if m.to == ["owner@race.test"]]) == 3


# -- health -------------------------------------------------------------------------------------


def test_pending_high_for_too_long_alerts_operators_once(
        engine: QuotaEngine, settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    settings.ADMINS = [("Ops", "ops@tollgate.test")]
    settings.TOLLGATE_PENDING_ALERT_SECONDS = 600
    acme = make_tenant("acme", tokens_per_day=1_000)
    calm = make_tenant("calm", tokens_per_day=1_000)
    spend(engine, calm, 150, "calm-1", scopes=(ScopeLimit("tenant", DAY, 1_000),), settle=False)
    hold = engine.reserve(ReserveRequest(tenant_tag(acme.pk), "leak", 250,
                                         (ScopeLimit("tenant", DAY, 1_000),))).hold
    t0 = time.time()
    key = keys.pending_high_key(tenant_tag(acme.pk))
    assert key == f"tg:{{t{acme.pk}}}:pending-high"

    assert check_pending_health(now=t0) == []
    assert engine.client.get(key) == str(int(t0)) and 0 < engine.client.ttl(key) <= 600 + 1800
    assert engine.client.get(keys.pending_high_key(tenant_tag(calm.pk))) is None  # 15% is below 20%
    assert check_pending_health(now=t0 + 599) == []
    # Another worker (its own Redis client and engine) sees the same first-seen time.
    other = QuotaEngine(make_redis())
    with caplog.at_level(logging.ERROR, logger="billing.alerts"):
        [alert] = check_pending_health(now=t0 + 600, engine=other)
    assert (alert.tenant_id, alert.pending, alert.limit, alert.high_since) == (
        acme.pk, 250, 1_000, int(t0))
    assert any("pending holds high" in r.getMessage() for r in caplog.records)
    [message] = mail.outbox
    assert message.to == ["ops@tollgate.test"] and "acme" in message.subject
    # Once per episode, whichever worker looks next.
    assert check_pending_health(now=t0 + 900) == []
    assert check_pending_health(now=t0 + 1200, engine=other) == []
    assert len(mail.outbox) == 1
    # The hold ends: the episode is over, and a new one starts from scratch.
    engine.release(hold)
    assert check_pending_health(now=t0 + 1500) == []
    assert engine.client.get(key) is None
    spend(engine, acme, 300, "leak-2", scopes=(ScopeLimit("tenant", DAY, 1_000),), settle=False)
    assert check_pending_health(now=t0 + 1800) == []
    assert [a.tenant_id for a in check_pending_health(now=t0 + 2400)] == [acme.pk]


# -- a real Celery worker -----------------------------------------------------------------------


_WORKER_SETTINGS = """
from config.settings import *  # noqa: F403

TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on loopback
TOLLGATE_WEBHOOK_BACKOFF_SECONDS = [1]
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
CELERY_BEAT_SCHEDULE = {
    **CELERY_BEAT_SCHEDULE,  # noqa: F405
    "check-quota-thresholds": {"task": "billing.tasks.check_quota_thresholds", "schedule": 60.0},
    "retry-due-webhooks": {"task": "billing.tasks.retry_due_webhooks", "schedule": 60.0},
    "check-pending-health": {"task": "billing.tasks.check_pending_health", "schedule": 300.0},
}
"""


@pytest.fixture
def alert_worker(django_db_setup: None, tmp_path: Path) -> Iterator[Path]:
    from tests.billing.conftest import celery_worker_process
    from tests.gateway.conftest import ROOT, gateway_env

    (tmp_path / "tg_alert_worker_settings.py").write_text(_WORKER_SETTINGS)
    env = gateway_env(TOLLGATE_DRAIN_INTERVAL_SECONDS="0.5",
                      DJANGO_SETTINGS_MODULE="tg_alert_worker_settings",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", LOG_LEVEL="INFO")
    with celery_worker_process(tmp_path, env) as log:
        yield log


@pytest.mark.e2e
def test_worker_detects_at_drain_time_and_delivers_the_signed_webhook_with_a_retry(
        alert_worker: Path, django_db_blocker: Any, engine: QuotaEngine,
        allow_private: Any) -> None:
    from tests.gateway.conftest import committed, wait_until

    slug = f"celery-alerts-{os.getpid()}"
    with Receiver([500, 200]) as receiver:
        def setup() -> tuple[Tenant, str]:
            tenant = make_tenant(slug)
            _, secret = create_endpoint(tenant, receiver.url, ["quota.threshold"], actor="t")
            return tenant, secret

        tenant, secret = committed(django_db_blocker, setup)  # with its plan: its windows
        tenant_id = tenant.pk
        spend(engine, tenant, 9_100, "w1")

        assert wait_until(lambda: len(receiver.requests) >= 2, timeout=30), (
            receiver.requests, alert_worker.read_text()[-3000:])
        first, second = receiver.requests[:2]

        def delivery() -> WebhookDelivery:
            return WebhookDelivery.objects.get(endpoint__tenant_id=tenant_id)

        assert wait_until(lambda: committed(django_db_blocker, delivery).status == "delivered",
                          timeout=10)
    row = committed(django_db_blocker, delivery)
    assert (row.attempts, row.last_status_code) == (2, 200)
    assert first["body"] == second["body"]
    for request in (first, second):
        assert verify_signature(secret, request["headers"]["Tollgate-Timestamp"],
                                request["body"], request["headers"]["Tollgate-Signature"])
    payload = json.loads(second["body"])
    assert (payload["type"], payload["tenant"], payload["threshold"], payload["used"]) == (
        "quota.threshold", slug, 10, 9_100)
    assert committed(django_db_blocker, lambda: list(
        AlertState.objects.filter(tenant_id=tenant_id).values_list("threshold", flat=True))) == [10]
