"""Request-rate buckets, the concurrency gauge, minute (TPM) windows and usage events, all in the
same single reserve call, on real Redis and a real cluster."""
from __future__ import annotations

import json
import time

import redis

from quotas import keys
from quotas.engine import (
    UNLIMITED,
    ConcurrencyLimit,
    EngineSettings,
    Outcome,
    QuotaEngine,
    RateLimit,
    ReserveRequest,
    ScopeLimit,
)
from quotas.windows import WindowKind

DAY_100 = (ScopeLimit("tenant", WindowKind.DAY, 100),)


def req(tenant: str, rid: str, amount: int = 1, limits=DAY_100, **kw) -> ReserveRequest:
    return ReserveRequest(tenant, rid, amount, limits, **kw)


def test_rate_bucket_refuses_with_retry_after_and_refills(engine: QuotaEngine, tenant: str) -> None:
    rates = (RateLimit("tenant", 5, 1000),)
    results = [engine.reserve(req(tenant, f"r{i}", rates=rates)) for i in range(6)]
    assert [r.admitted for r in results] == [True] * 5 + [False]
    assert [r.rate_remaining[0] for r in results[:5]] == [4, 3, 2, 1, 0]
    refused = results[5]
    assert refused.outcome is Outcome.RATE and refused.refused_rate == rates[0]
    assert 0 < refused.retry_after_ms <= 200
    assert engine.counter(tenant, "tenant").pending == 5  # the refused one held nothing
    time.sleep(refused.retry_after_ms / 1000 + 0.01)
    assert engine.reserve(req(tenant, "later", rates=rates)).admitted


def test_quota_refusal_does_not_spend_a_rate_token(engine: QuotaEngine, tenant: str) -> None:
    rates = (RateLimit("key:k1", 2, 60_000),)
    assert not engine.reserve(req(tenant, "big", 101, rates=rates)).admitted
    first = engine.reserve(req(tenant, "a", rates=rates))
    assert first.admitted and first.rate_remaining == (1,)


def test_several_buckets_all_must_have_room(engine: QuotaEngine, tenant: str) -> None:
    rates = (RateLimit("tenant", 10, 1000), RateLimit("key:k1", 2, 60_000))
    outcomes = [engine.reserve(req(tenant, f"r{i}", rates=rates)) for i in range(3)]
    assert [o.admitted for o in outcomes] == [True, True, False]
    assert outcomes[2].refused_rate == rates[1]
    assert outcomes[1].rate_remaining == (8, 0)


def test_concurrency_cap_frees_a_slot_when_a_hold_ends(engine: QuotaEngine, tenant: str) -> None:
    cap = ConcurrencyLimit("key:k1", 2)
    a = engine.reserve(req(tenant, "a", concurrency=cap))
    b = engine.reserve(req(tenant, "b", concurrency=cap))
    c = engine.reserve(req(tenant, "c", concurrency=cap))
    assert (a.admitted, b.admitted, c.admitted) == (True, True, False)
    assert c.outcome is Outcome.CONCURRENCY and c.in_flight == 2
    engine.settle(a.hold, 1)
    d = engine.reserve(req(tenant, "d", concurrency=cap))
    assert d.admitted
    engine.release(b.hold)
    time.sleep(0.002)
    engine.sweep(tenant, stale_s=0)  # ends d
    assert engine.client.zcard(keys.gauge_key(tenant, "key:k1")) == 0


def test_concurrency_zero_refuses_and_a_crashed_request_frees_its_slot_by_itself(
    client: redis.Redis, tenant: str
) -> None:
    engine = QuotaEngine(client, EngineSettings(stale_hold_s=1))
    assert engine.reserve(req(tenant, "x", concurrency=ConcurrencyLimit("key:z", 0))).outcome \
        is Outcome.CONCURRENCY
    cap = ConcurrencyLimit("key:k1", 1)
    assert engine.reserve(req(tenant, "crashed", concurrency=cap)).admitted  # never ended
    assert not engine.reserve(req(tenant, "b", concurrency=cap)).admitted
    time.sleep(1.05)  # older than the stale threshold: a dead request's slot
    assert engine.reserve(req(tenant, "c", concurrency=cap)).admitted


def test_tokens_per_minute_is_a_minute_window_counter(engine: QuotaEngine, tenant: str) -> None:
    tpm = (ScopeLimit("tenant", WindowKind.DAY, UNLIMITED), ScopeLimit("tenant", WindowKind.MINUTE, 100))
    a = engine.reserve(req(tenant, "a", 70, tpm))
    assert a.admitted
    refused = engine.reserve(req(tenant, "b", 40, tpm))
    assert refused.outcome is Outcome.QUOTA and refused.refused.window.kind is WindowKind.MINUTE
    minute = engine.counter(tenant, "tenant", WindowKind.MINUTE)
    assert 0 < minute.ttl_s <= 60 + engine.settings.minute_grace_s
    engine.settle(a.hold, 30)  # what the call really used frees the minute's room
    settled = engine.counter_at(minute.key)
    assert (settled.used, settled.pending) == (30, 0)
    assert engine.reserve(req(tenant, "c", 70, tpm)).admitted  # 30 + 70 <= 100 (or a new minute)


def usage_events(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    return [fields for _id, fields in client.xrange(keys.usage_stream_key(tenant))]


def test_every_ended_hold_appends_exactly_one_usage_event(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    meta = json.dumps({"project": 3, "key": 7, "model": "gpt-4o"})
    a = engine.reserve(req(tenant, "a", 40, meta=meta))
    b = engine.reserve(req(tenant, "b", 30, meta=meta))
    c = engine.reserve(req(tenant, "c", 20, meta=meta))
    engine.settle(a.hold, 25, event=json.dumps({"input": 10, "output": 15}))
    engine.settle(a.hold, 25, event="again")  # no-op: no second event
    engine.release(b.hold, event=json.dumps({"reason": "upstream_500"}))
    engine.release(b.hold)
    time.sleep(0.002)
    engine.sweep(tenant, stale_s=0)
    # After the sweep (which charged nothing: c never reached the upstream), a settle corrects
    # it once with one "corrected" event; a second one is a no-op.
    assert engine.settle(c.hold, 5).corrected
    assert not engine.settle(c.hold, 5).corrected
    events = usage_events(client, tenant)
    assert [(e["request_id"], e["outcome"], e["held"], e["actual"]) for e in events] == [
        ("a", "settled", "40", "25"), ("b", "released", "30", "0"), ("c", "swept", "20", "0"),
        ("c", "corrected", "20", "5"),
    ]
    assert (events[3]["swept"], events[2]["basis"]) == ("0", "reserved")
    assert all(e["meta"] == meta for e in events)
    assert json.loads(events[0]["event"]) == {"input": 10, "output": 15}
    assert json.loads(events[1]["event"]) == {"reason": "upstream_500"}
    assert all(int(e["ended"]) >= int(e["created"]) for e in events)


def test_refused_and_dry_run_reservations_leave_no_trace(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    cap = ConcurrencyLimit("key:k1", 5)
    rates = (RateLimit("tenant", 5, 1000),)
    assert engine.reserve(req(tenant, "dry", 50, dry_run=True, rates=rates, concurrency=cap)).admitted
    assert not engine.reserve(req(tenant, "big", 500, rates=rates, concurrency=cap)).admitted
    assert client.exists(keys.gauge_key(tenant, "key:k1"), keys.rate_key(tenant, "tenant", 1000),
                         keys.usage_stream_key(tenant), keys.hold_index_key(tenant)) == 0
