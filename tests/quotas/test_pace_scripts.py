"""The burn-rate breaker's scripts (lua/pace_trip.lua, lua/pace_resume.lua) and its pace
counters in the reserve script, on the standalone Redis and the 3-node cluster."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from quotas import keys
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.pace import CLOSED_CREDIT, PaceBreaker, PaceLimit, paced_of
from quotas.windows import Calendar, WindowKind, pace_windows

HOUR, SECOND = WindowKind.PACE_1H, WindowKind.PACE_1S
DAY = ScopeLimit("tenant", WindowKind.DAY, 1_000_000)


def pace(limit: int, kind: WindowKind = HOUR, *, cooldown_s: int = 1800, scope: str = "project:7",
         unit: Unit = Unit.TOKENS) -> PaceLimit:
    return PaceLimit(scope, kind, limit, unit, label="web", reason="spend_rate_exceeded",
                     cooldown_s=cooldown_s, owner="project:prj_web", rule=f"{limit} per period")


def reserve(engine: QuotaEngine, tenant: str, rid: str, amount: int, *paced: PaceLimit,
            money: int = 0):
    return engine.reserve(ReserveRequest(tenant, rid, amount, (DAY, *paced), money_amount=money))


def redis_ms(client: redis.Redis | redis.RedisCluster) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def breaker(client: redis.Redis | redis.RedisCluster) -> PaceBreaker:
    return PaceBreaker(client)


def test_a_pace_counter_admits_its_share_then_refuses_with_its_reason(
        engine: QuotaEngine, tenant: str) -> None:
    limit = pace(1_000)
    assert reserve(engine, tenant, "a", 600, limit).admitted
    assert reserve(engine, tenant, "b", 400, limit).admitted
    refused = reserve(engine, tenant, "c", 1, limit)
    assert not refused.admitted
    assert refused.refused.reason == "spend_rate_exceeded"
    assert refused.refused.window.kind is HOUR and refused.refused.scope == "project:7"
    # The day counter holds what the pace counter does: granted <= limit.
    assert engine.counter(tenant, "tenant").pending == 1_000


def test_a_spend_pace_refuses_on_money(engine: QuotaEngine, tenant: str) -> None:
    limit = pace(500, unit=Unit.MICROS, scope="tenant")
    assert reserve(engine, tenant, "a", 10, limit, money=400).admitted
    refused = reserve(engine, tenant, "b", 10, limit, money=101)
    assert not refused.admitted and refused.refused.unit is Unit.MICROS
    assert refused.refused.reason == "spend_rate_exceeded"


def test_a_trip_closes_the_scope_for_the_cool_down_and_is_recorded_once(
        engine: QuotaEngine, breaker: PaceBreaker, tenant: str,
        client: redis.Redis | redis.RedisCluster) -> None:
    limit = pace(1_000, cooldown_s=7200)
    assert reserve(engine, tenant, "a", 1_000, limit).admitted
    refused = reserve(engine, tenant, "b", 5, limit)
    now = refused.server_time_ms
    first = breaker.trip(tenant, [limit], now)
    assert first.first and first.tripped_ms >= now
    # Cool-down of two hours from inside an hour period: three whole periods are closed.
    periods = pace_windows(HOUR, now, now + 7_200_000)
    assert len(periods) == 3 and first.until_ms == periods[-1].end_ms
    for window in periods:
        key = keys.counter_key(tenant, "project:7", window.id)
        assert int(client.hget(key, "credit")) == CLOSED_CREDIT
        assert client.ttl(key) > 0  # every counter the trip wrote expires
    again = breaker.trip(tenant, [limit], now)
    assert (again.first, again.tripped_ms, again.until_ms) == (False, first.tripped_ms,
                                                                first.until_ms)
    # Settling the first call frees nothing: the scope stays closed.
    engine.settle(reserve(engine, tenant, "a", 1_000, limit).hold, 10)
    assert not reserve(engine, tenant, "c", 1, limit).admitted
    [trip] = breaker.trips(tenant)
    assert (trip.scope, trip.owner, trip.label, trip.rules) == (
        "project:7", "project:prj_web", "web", ("1000 per period",))
    assert trip.active(redis_ms(client)) and trip.tripped_ms == first.tripped_ms
    assert len(trip.counter_keys) == 3
    assert client.ttl(keys.pace_trips_key(tenant)) > 7200


def test_a_trip_closes_both_pace_counters_of_the_scope(
        engine: QuotaEngine, breaker: PaceBreaker, tenant: str) -> None:
    tokens = pace(1_000, scope="tenant", cooldown_s=1)
    money = pace(10_000, scope="tenant", unit=Unit.MICROS, cooldown_s=1)
    result = breaker.trip(tenant, [tokens, money], redis_ms(engine.client))
    assert result.first
    refused = reserve(engine, tenant, "a", 1, tokens, money, money=1)
    assert not refused.admitted and refused.refused.reason == "spend_rate_exceeded"
    # One second of cool-down in an hour period: that period (or it and the next, at :59:59).
    assert len(breaker.trips(tenant)[0].counter_keys) in (2, 4)


def test_many_refusals_racing_trip_the_breaker_exactly_once(
        breaker: PaceBreaker, tenant: str, client: redis.Redis | redis.RedisCluster) -> None:
    limit = pace(1_000)
    now = redis_ms(client)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: breaker.trip(tenant, [limit], now), range(200)))
    assert sum(r.first for r in results) == 1
    assert len({(r.tripped_ms, r.until_ms) for r in results}) == 1


def test_after_the_cool_down_it_half_opens_with_one_periods_share(
        engine: QuotaEngine, breaker: PaceBreaker, tenant: str,
        client: redis.Redis | redis.RedisCluster) -> None:
    limit = pace(100, SECOND, cooldown_s=1)
    assert reserve(engine, tenant, "a", 100, limit).admitted
    refused = reserve(engine, tenant, "b", 1, limit)
    trip = breaker.trip(tenant, [limit], refused.server_time_ms)
    assert trip.first and trip.until_ms - refused.server_time_ms <= 2_000
    assert not reserve(engine, tenant, "c", 1, limit).admitted or redis_ms(client) >= trip.until_ms
    while redis_ms(client) < trip.until_ms:
        time.sleep(0.05)
    # Half-open: the next period admits its share, and the runaway trips it again.
    half = reserve(engine, tenant, "d", 100, limit)
    assert half.admitted
    over = reserve(engine, tenant, "e", 1, limit)
    if not over.admitted:  # still in the same one-second period
        retrip = breaker.trip(tenant, [limit], over.server_time_ms)
        assert retrip.first and retrip.tripped_ms > trip.tripped_ms


def test_resume_gives_the_current_period_a_fresh_share_and_opens_later_ones(
        engine: QuotaEngine, breaker: PaceBreaker, tenant: str,
        client: redis.Redis | redis.RedisCluster) -> None:
    limit = pace(1_000, cooldown_s=7200)
    assert reserve(engine, tenant, "a", 1_000, limit).admitted
    refused = reserve(engine, tenant, "b", 1, limit)
    breaker.trip(tenant, [limit], refused.server_time_ms)
    [trip] = breaker.trips(tenant)
    assert breaker.resume(tenant, trip, "user:alice")
    assert not breaker.resume(tenant, trip, "user:bob")  # once
    [lifted] = breaker.trips(tenant)
    assert lifted.resumed_by == "user:alice" and not lifted.active(redis_ms(client))
    assert reserve(engine, tenant, "c", 1_000, limit).admitted  # a whole share from now
    assert not reserve(engine, tenant, "d", 1, limit).admitted
    later = [k for k in trip.counter_keys[1:]]
    assert all(client.hget(k, "credit") is None for k in later)
    # A new trip after the resume is a new trip (its own record, its own alert); a refusal in the
    # resume's own millisecond counts as made before it, hence + 1.
    again = breaker.trip(tenant, [limit], redis_ms(client) + 1)
    assert again.first and again.tripped_ms > trip.tripped_ms


def test_resume_of_a_trip_that_is_not_the_active_one_does_nothing(
        breaker: PaceBreaker, tenant: str, client: redis.Redis | redis.RedisCluster) -> None:
    limit = pace(1_000)
    breaker.trip(tenant, [limit], redis_ms(client))
    [trip] = breaker.trips(tenant)
    stale = type(trip)(**{**trip.__dict__, "tripped_ms": trip.tripped_ms - 1})
    assert not breaker.resume(tenant, stale, "user:alice")
    assert breaker.trips(tenant)[0].active(redis_ms(client))


def test_paced_of_picks_the_scopes_pace_counters() -> None:
    limits = (DAY, pace(1, scope="tenant"), pace(2), pace(3, unit=Unit.MICROS))
    assert [p.limit for p in paced_of(limits, "project:7")] == [2, 3]
    assert all(not p.queueable for p in paced_of(limits, "project:7"))


def test_pace_periods_match_the_plans_choices() -> None:
    from tenants.models import PACE_PERIODS

    assert sorted(PACE_PERIODS) == sorted(k.pace_seconds for k in WindowKind if k.pace_seconds)


def test_a_pace_counter_expires_soon_after_its_period(
        engine: QuotaEngine, tenant: str, client: redis.Redis | redis.RedisCluster) -> None:
    # Pace counters are read only while their period runs; kept like day counters (two days), a
    # 10-minute rule would leave about 288 keys per active scope.
    limit = pace(1_000, WindowKind.PACE_10M)
    assert reserve(engine, tenant, "a", 10, limit).admitted
    window = Calendar().window(WindowKind.PACE_10M, redis_ms(client))
    key = keys.counter_key(tenant, "project:7", window.id)
    ttl = client.ttl(key)
    assert 0 < ttl <= 600 + engine.settings.minute_grace_s


def test_a_refusal_made_before_a_resume_does_not_trip_again(
        engine: QuotaEngine, breaker: PaceBreaker, tenant: str,
        client: redis.Redis | redis.RedisCluster) -> None:
    # A gateway's refusal computed just before an owner's resume reaches pace_trip just after it:
    # the resume stands (no second trip, no second webhook); a new refusal after it trips anew.
    limit = pace(1_000)
    assert reserve(engine, tenant, "a", 1_000, limit).admitted
    refused = reserve(engine, tenant, "b", 5, limit)
    assert breaker.trip(tenant, [limit], refused.server_time_ms).first
    stale = reserve(engine, tenant, "c", 5, limit)  # refused by the trip's closing credit
    assert not stale.admitted
    [trip] = breaker.trips(tenant)
    assert breaker.resume(tenant, trip, "user:alice")
    late = breaker.trip(tenant, [limit], stale.server_time_ms)
    assert not late.first and late.tripped_ms == trip.tripped_ms
    [after] = breaker.trips(tenant)
    assert after.resumed_by == "user:alice" and not after.active(redis_ms(client))
    assert breaker.trip(tenant, [limit], redis_ms(client) + 1).first
