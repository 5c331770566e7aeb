"""A reserve call's KEYS and ARGV are built once per request shape and reused (quotas/engine.py
_Shape): the gateway passes the same tuples of counters, buckets and gauge for every call of a key
and model. What is reused must never outlive what it was built from: a window that moves on, a
tenant, the epoch check, the queue."""
from __future__ import annotations

import dataclasses
import json

import pytest
import redis

from quotas import keys
from quotas.engine import (
    ConcurrencyLimit,
    CounterState,
    EngineSettings,
    Hold,
    QueueTicket,
    QuotaEngine,
    QuotaEpochLost,
    RateLimit,
    ReserveRequest,
    ScopeLimit,
    Unit,
    _Calls,
    _fallback,
)
from quotas.windows import RedisClock, WindowKind
from tests.quotas.conftest import new_tenant
from tests.quotas.test_windows_and_clock import boundary_schedule, wait_for_redis_ms

DAY, MONTH, MINUTE = WindowKind.DAY, WindowKind.MONTH, WindowKind.MINUTE

# One of each kind of counter, as a key's context memoises them: shared by every call below.
LIMITS = (ScopeLimit("tenant", DAY, 1000), ScopeLimit("tenant", MONTH, 10_000),
          ScopeLimit("key:k", DAY, 800), ScopeLimit("tenant", MINUTE, 5000),
          ScopeLimit("tenant", MONTH, 10**9, Unit.MICROS),
          ScopeLimit("key:k", WindowKind.PACE_10M, 10**6, queueable=False))
RATES = (RateLimit("tenant", 1000, 1000), RateLimit("key:k", 10**6, 60_000))
GAUGE = ConcurrencyLimit("key:k", 100)


def shaped(tenant: str, rid: str, amount: int = 10, **options: object) -> ReserveRequest:
    return ReserveRequest(tenant, rid, amount, LIMITS, rates=RATES, concurrency=GAUGE,
                          **options)  # type: ignore[arg-type]


def test_a_reused_shape_builds_the_same_call() -> None:
    clock = RedisClock()
    warm = _Calls(EngineSettings(), clock)
    tenant = new_tenant()
    ticket = QueueTicket(3, clock.now_ms() + 60_000, 5000, 100)
    warm.reserve(shaped(tenant, "first", queue=ticket, check_epoch=True))
    reused = warm.reserve(shaped(tenant, "second", queue=ticket, check_epoch=True))
    cold = _Calls(EngineSettings(), clock).reserve(
        ReserveRequest(tenant, "second", 10, tuple(LIMITS), rates=tuple(RATES),
                       concurrency=ConcurrencyLimit("key:k", 100), queue=ticket,
                       check_epoch=True))
    assert reused.keys == cold.keys and reused.args == cold.args
    assert reused.counters == cold.counters
    assert reused.keys[0] == keys.hold_key(tenant, "second")
    assert keys.epoch_key(tenant) in reused.keys
    assert keys.gauge_key(tenant, "key:k") in reused.keys


def test_shapes_are_per_tenant_epoch_check_and_queue() -> None:
    calls = _Calls(EngineSettings(), RedisClock())
    a, b = new_tenant(), new_tenant()
    plain = calls.reserve(shaped(a, "r"))
    other_tenant = calls.reserve(shaped(b, "r"))
    checked = calls.reserve(shaped(a, "r", check_epoch=True))
    queued = calls.reserve(shaped(a, "r", queue=QueueTicket(0, 10**13, 5000, 100)))
    assert all(f"{{t{b}}}" in key for key in other_tenant.keys)
    assert not any(f"{{t{b}}}" in key for key in plain.keys)
    assert checked.keys == [*plain.keys, keys.epoch_key(a)]
    assert keys.queue_waiters_key(a) in queued.keys and len(queued.args) > len(plain.args)
    assert calls.reserve(shaped(a, "r")).keys == plain.keys  # the plain shape is still right


def test_a_reused_shape_follows_its_windows_across_midnight(
    engine: QuotaEngine, client: redis.Redis
) -> None:
    tenant = new_tenant()
    schedule = boundary_schedule(client, 1.5)
    before = engine.reserve(shaped(tenant, "before", 700, schedule=schedule))
    day1 = before.counters[0].window
    assert before.admitted
    wait_for_redis_ms(client, day1.end_ms + 20)
    after = engine.reserve(shaped(tenant, "after", 700, schedule=schedule))
    day2 = after.counters[0].window
    assert after.admitted, "a new day starts with the full quota"
    assert day2.start_ms == day1.end_ms and day2.id != day1.id
    assert after.counters[0].key != before.counters[0].key
    assert after.hold.counter_keys[0] == after.counters[0].key
    engine.settle(before.hold, 600)
    engine.settle(after.hold, 100)
    old = engine.counter_at(before.counters[0].key)
    new = engine.counter_at(after.counters[0].key)
    assert (old.used, old.pending) == (600, 0)
    assert (new.used, new.pending) == (100, 0)


@pytest.mark.parametrize("check_epoch", [True, False])
def test_the_epoch_check_is_not_shared_between_shapes(
    engine: QuotaEngine, check_epoch: bool
) -> None:
    tenant = new_tenant()  # no epoch marker: a checked reserve refuses
    engine.reserve(shaped(tenant, "warm"))  # the unchecked shape first
    if check_epoch:
        with pytest.raises(QuotaEpochLost):
            engine.reserve(shaped(tenant, "checked", check_epoch=True))
    else:
        assert engine.reserve(shaped(tenant, "unchecked")).admitted


def test_the_replys_counter_states_are_the_constructors(engine: QuotaEngine) -> None:
    tenant = new_tenant()
    admitted = engine.reserve(shaped(tenant, "ok", 300))
    refused = engine.reserve(shaped(tenant, "over", 600))  # the key's day (800) refuses
    assert admitted.admitted and not refused.admitted
    for state in (*admitted.counters, *refused.counters):
        made = CounterState(scope=state.scope, window=state.window, key=state.key,
                            limit=state.limit, remaining=state.remaining, unit=state.unit)
        assert state == made and hash(state) == hash(made) and repr(state) == repr(made)
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.remaining = 0  # type: ignore[misc]
    assert [s.limit for s in admitted.counters] == [limit.limit for limit in LIMITS]
    assert admitted.counters[0].remaining == 700
    assert admitted.hold.counter_keys == tuple(s.key for s in admitted.counters)
    assert admitted.hold.units == (0, 0, 0, 0, 1, 0)  # the spend counter is in micro-dollars
    assert refused.refused.scope == "key:k" and refused.refused.label == LIMITS[2].label
    assert refused.refused.remaining == refused.counters[2].remaining


@pytest.mark.parametrize("meta", ['{"p":1,"k":2,"m":"gpt-4o","served":"gpt-4o","ep":"chat"}',
                                  "", 'a\\0b "quoted" \\ é 漢', "\\0", "nul \0 inside",
                                  "escaped \\u0000 text"])
def test_the_settle_fallback_is_the_json_it_always_was(meta: str) -> None:
    hold = Hold("t1", "r1", 1234, ("a", "b", "c"), "", 0, (0, 1, 0), meta, 1764600000123)
    expected = json.dumps({"units": [0, 1, 0], "amount": "1234", "created": "1764600000123",
                           "meta": meta}, separators=(",", ":"))
    assert _fallback(hold) == expected
    assert _fallback(dataclasses.replace(hold, amount=7, created_ms=9)) == expected.replace(
        '"1234"', '"7"').replace('"1764600000123"', '"9"')
