"""Redis that forgets is noticed: the epoch marker in each tenant's slot, checked inside the
reserve script, and the atomic rebuild of current-window counters that sets it again. Also the
fail-open call's usage event. On a real standalone Redis and a real 3-node cluster."""
from __future__ import annotations

import pytest
import redis

from quotas import keys
from quotas.engine import (
    QuotaEngine,
    QuotaEpochLost,
    RebuildCounter,
    ReserveRequest,
    ScopeLimit,
    Unit,
)
from quotas.windows import WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
LIMITS = (ScopeLimit("tenant", DAY, 1000), ScopeLimit("key:k1", DAY, 500))


def request(tenant: str, rid: str, amount: int, *, check_epoch: bool = True) -> ReserveRequest:
    return ReserveRequest(tenant, rid, amount, LIMITS, check_epoch=check_epoch)


def test_a_missing_epoch_refuses_and_writes_nothing(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    with pytest.raises(QuotaEpochLost) as lost:
        engine.reserve(request(tenant, "a", 10))
    assert lost.value.tenant == tenant
    assert engine.counter(tenant, "tenant").limit is None  # no counter was created
    assert client.exists(keys.hold_key(tenant, "a")) == 0
    engine.set_epoch(tenant)
    assert engine.has_epoch(tenant)
    assert engine.reserve(request(tenant, "a", 10)).admitted


def test_a_flush_is_caught_by_the_next_reserve(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    engine.set_epoch(tenant)
    engine.settle(engine.reserve(request(tenant, "a", 400)).hold, 400)
    # Every key of the tenant vanishes (a restart without persistence, a failover to a replica
    # that had not received them, a flush): the counter would read 0.
    client.delete(*[k for k in client.scan_iter(match=f"tg:{{t{tenant}}}:*")])
    with pytest.raises(QuotaEpochLost):
        engine.reserve(request(tenant, "b", 400))
    # Unchecked, the same request would have been admitted on the empty counter: 800 tokens on
    # a key limited to 500 a day.
    assert engine.reserve(request(tenant, "b", 400, check_epoch=False)).admitted


def test_rebuild_restores_used_never_lowers_it_and_sets_the_epoch(
    engine: QuotaEngine, tenant: str
) -> None:
    day = engine.current_window(DAY)
    month = engine.current_window(MONTH)
    engine.settle(engine.reserve(request(tenant, "a", 100, check_epoch=False)).hold, 70)
    raised = engine.rebuild(tenant, [
        RebuildCounter("tenant", day, 900, 1000),  # the ledger knows more: raised to 900
        RebuildCounter("key:k1", day, 20, 500),  # the counter already has 70: kept
        RebuildCounter("tenant", month, 5_000),
        RebuildCounter("tenant", month, 123_456, 10**6, Unit.MICROS),
    ], epoch="test")
    assert raised == 3
    assert engine.has_epoch(tenant)
    assert engine.counter(tenant, "tenant").used == 900
    assert engine.counter(tenant, "key:k1").used == 70
    month_counter = engine.counter(tenant, "tenant", MONTH)
    assert (month_counter.used, month_counter.pending) == (5_000, 0)
    assert 0 < month_counter.ttl_s <= (month.end_ms - day.start_ms) // 1000 + 3 * 86400
    assert engine.counter(tenant, "tenant", MONTH, unit=Unit.MICROS).used == 123_456
    # No call is admitted beyond the limit on the rebuilt counter.
    assert not engine.reserve(request(tenant, "b", 101)).admitted
    assert engine.reserve(request(tenant, "c", 100)).admitted


def test_an_unmetered_call_appends_its_usage_event(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    engine.append_unmetered(tenant, "req_open", actual=42, created_ms=1_000, ended_ms=2_000,
                            meta='{"p":1}', event='{"in":12,"out":30}')
    [(_id, fields)] = client.xrange(keys.usage_stream_key(tenant))
    assert fields == {"request_id": "req_open", "outcome": "unmetered", "held": "0",
                      "actual": "42", "money": "0", "created": "1000", "ended": "2000",
                      "meta": '{"p":1}', "event": '{"in":12,"out":30}'}
