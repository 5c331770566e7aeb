"""Every hold ends exactly once: settle, release and sweep, on real Redis and a real cluster."""
from __future__ import annotations

import threading
import time

import redis

from quotas import keys
from quotas.engine import UNLIMITED, Hold, QuotaEngine, ReserveRequest, ScopeLimit
from quotas.windows import WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
LIMITS = (
    ScopeLimit("tenant", DAY, 1000),
    ScopeLimit("key:k1", DAY, 500),
    ScopeLimit("model:gpt-4o-mini", MONTH, UNLIMITED),
)


def reserve(engine: QuotaEngine, tenant: str, rid: str, amount: int) -> Hold:
    result = engine.reserve(ReserveRequest(tenant, rid, amount, LIMITS))
    assert result.admitted
    return result.hold


def state(engine: QuotaEngine, tenant: str) -> list[tuple[int, int]]:
    return [(c.used, c.pending) for c in
            (engine.counter(tenant, lim.scope, lim.window) for lim in LIMITS)]


def test_settle_moves_the_hold_to_used_in_every_scope(engine: QuotaEngine, tenant: str) -> None:
    hold = reserve(engine, tenant, "a", 100)
    assert state(engine, tenant) == [(0, 100)] * 3
    result = engine.settle(hold, 42)
    assert (result.outcome, result.held, result.charged, result.applied) == ("settled", 100, 42, True)
    assert state(engine, tenant) == [(42, 0)] * 3


def test_settle_is_idempotent(engine: QuotaEngine, tenant: str) -> None:
    hold = reserve(engine, tenant, "a", 100)
    engine.settle(hold, 42)
    again = engine.settle(hold, 99)
    assert (again.outcome, again.held, again.charged, again.applied) == ("settled", 0, 0, False)
    assert state(engine, tenant) == [(42, 0)] * 3


def test_release_frees_the_hold_and_is_idempotent(engine: QuotaEngine, tenant: str) -> None:
    hold = reserve(engine, tenant, "a", 100)
    first = engine.release(hold)
    assert (first.outcome, first.released, first.applied) == ("released", 100, True)
    second = engine.release(hold)
    assert (second.outcome, second.released, second.applied) == ("released", 0, False)
    assert state(engine, tenant) == [(0, 0)] * 3


def test_a_retried_release_cannot_free_another_requests_hold(engine: QuotaEngine, tenant: str) -> None:
    # Seed 000's bug: release trusted the caller's amount. Here it comes from the hold record.
    a = reserve(engine, tenant, "a", 100)
    reserve(engine, tenant, "b", 200)
    engine.release(a)
    engine.release(a)
    engine.release(Hold(tenant, "a", 10_000, a.counter_keys))  # a forged amount is ignored
    assert state(engine, tenant) == [(0, 200)] * 3


def test_settle_after_release_and_release_after_settle_are_noops(engine: QuotaEngine, tenant: str) -> None:
    a = reserve(engine, tenant, "a", 100)
    b = reserve(engine, tenant, "b", 100)
    engine.release(a)
    assert engine.settle(a, 80).outcome == "released"
    engine.settle(b, 30)
    assert engine.release(b).outcome == "settled"
    assert state(engine, tenant) == [(30, 0)] * 3


def test_settle_and_release_after_sweep_are_noops(engine: QuotaEngine, tenant: str) -> None:
    a = reserve(engine, tenant, "a", 100)
    b = reserve(engine, tenant, "b", 50)
    time.sleep(0.002)
    swept = engine.sweep(tenant, stale_s=0)
    assert {(h.request_id, h.amount) for h in swept.swept} == {("a", 100), ("b", 50)}
    assert engine.release(a).outcome == "swept"
    assert engine.settle(b, 10).outcome == "swept"
    assert state(engine, tenant) == [(0, 0)] * 3
    assert engine.open_hold_ids(tenant) == []


def test_settle_above_the_hold_is_charged_and_recorded_as_over(engine: QuotaEngine, tenant: str) -> None:
    hold = reserve(engine, tenant, "a", 100)
    result = engine.settle(hold, 130)
    assert (result.held, result.charged) == (100, 130)
    counter = engine.counter(tenant, "tenant")
    assert (counter.used, counter.pending, counter.over) == (130, 0, 30)


def test_settle_with_other_counters_than_the_hold_is_refused(engine: QuotaEngine, tenant: str) -> None:
    hold = reserve(engine, tenant, "a", 100)
    wrong = Hold(tenant, "a", 100, hold.counter_keys[:1])
    assert engine.settle(wrong, 10).outcome == "keys_mismatch"
    assert engine.release(wrong).outcome == "keys_mismatch"
    assert state(engine, tenant) == [(0, 100)] * 3
    assert engine.settle(hold, 10).outcome == "settled"


def test_settle_and_release_by_request_id(engine: QuotaEngine, tenant: str) -> None:
    reserve(engine, tenant, "a", 100)
    reserve(engine, tenant, "b", 100)
    assert engine.settle_by_id(tenant, "a", 7).charged == 7
    assert engine.release_by_id(tenant, "b").released == 100
    assert engine.settle_by_id(tenant, "a", 7).outcome == "settled"
    assert engine.release_by_id(tenant, "never").outcome == "unknown"
    assert state(engine, tenant) == [(7, 0)] * 3


def test_unknown_hold_is_a_noop(engine: QuotaEngine, tenant: str) -> None:
    ghost = Hold(tenant, "ghost", 100, (keys.counter_key(tenant, "tenant", "d2026-01-01"),))
    assert engine.settle(ghost, 5).outcome == "unknown"
    assert engine.release(ghost).outcome == "unknown"
    assert engine.counter_at(ghost.counter_keys[0]).limit is None  # not created


def test_settle_after_the_counter_expired_does_not_recreate_it(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    hold = reserve(engine, tenant, "a", 100)
    client.delete(hold.counter_keys[0])  # the day's counter has expired
    assert engine.settle(hold, 50).outcome == "settled"
    assert client.exists(hold.counter_keys[0]) == 0
    assert engine.counter_at(hold.counter_keys[1]).used == 50


def test_sweep_takes_only_stale_holds(engine: QuotaEngine, tenant: str) -> None:
    old = reserve(engine, tenant, "old", 100)
    time.sleep(1.2)
    reserve(engine, tenant, "new", 50)
    result = engine.sweep(tenant, stale_s=1)
    assert [h.request_id for h in result.swept] == ["old"]
    assert engine.open_hold_ids(tenant) == ["new"]
    assert state(engine, tenant) == [(0, 50)] * 3
    assert engine.settle(old, 10).outcome == "swept"


def test_sweep_works_in_bounded_batches(engine: QuotaEngine, tenant: str) -> None:
    batch = engine.settings.sweep_batch
    for i in range(batch * 2 + 7):
        assert engine.reserve(ReserveRequest(tenant, f"r{i}", 1, LIMITS)).admitted
    time.sleep(0.002)
    one_batch = engine.sweep(tenant, stale_s=0, max_batches=1)
    assert len(one_batch.swept) == batch
    rest = engine.sweep(tenant, stale_s=0)
    assert len(rest.swept) == batch + 7
    assert state(engine, tenant) == [(0, 0)] * 3


def test_sweep_drops_index_entries_of_ended_or_vanished_holds(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    reserve(engine, tenant, "a", 10)
    client.delete(keys.hold_key(tenant, "a"))  # e.g. expired long after its counters
    time.sleep(0.002)
    result = engine.sweep(tenant, stale_s=0)
    assert (len(result.swept), result.dropped) == (0, 1)
    assert engine.open_hold_ids(tenant) == []


def test_concurrent_sweepers_end_each_hold_exactly_once(engine: QuotaEngine, tenant: str) -> None:
    for i in range(300):
        assert engine.reserve(ReserveRequest(tenant, f"r{i}", 1, LIMITS)).admitted
    time.sleep(0.002)
    results = []

    def sweeper() -> None:
        results.append(QuotaEngine(engine.client, engine.settings).sweep(tenant, stale_s=0))

    threads = [threading.Thread(target=sweeper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Racing sweepers pick the same oldest ids and some batches end up with nothing to do, so
    # a final sweep mops up; what matters is that no hold is ever swept twice.
    results.append(engine.sweep(tenant, stale_s=0, max_batches=100))
    swept = [h.request_id for r in results for h in r.swept]
    assert len(swept) == len(set(swept))
    assert sorted(swept) == sorted(f"r{i}" for i in range(300))
    assert state(engine, tenant) == [(0, 0)] * 3


def test_recharge_adds_credit_for_the_current_window(engine: QuotaEngine, tenant: str) -> None:
    tenant_day = LIMITS[0]
    assert engine.reserve(ReserveRequest(tenant, "a", 1000, LIMITS[:1])).admitted
    assert not engine.reserve(ReserveRequest(tenant, "b", 100, LIMITS[:1])).admitted
    topped = engine.recharge(tenant, tenant_day, 100)
    assert (topped.credit, topped.remaining) == (100, 0 + 100)
    assert engine.reserve(ReserveRequest(tenant, "b", 100, LIMITS[:1])).admitted
    assert not engine.reserve(ReserveRequest(tenant, "c", 1, LIMITS[:1])).admitted
    counter = engine.counter(tenant, "tenant")
    assert (counter.credit, counter.pending, counter.ttl_s > 0) == (100, 1100, True)


def test_recharge_creates_the_counter_with_a_ttl(engine: QuotaEngine, tenant: str) -> None:
    result = engine.recharge(tenant, ScopeLimit("project:p9", MONTH, 50), 25)
    assert result.remaining == 75
    counter = engine.counter(tenant, "project:p9", MONTH)
    assert counter.ttl_s > 0 and (counter.used, counter.pending, counter.credit) == (0, 0, 25)
