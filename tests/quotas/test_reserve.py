"""The reserve script's contract, on a real Redis server and a real Redis Cluster."""
from __future__ import annotations

import pytest
import redis

from quotas import keys
from quotas.engine import (
    UNLIMITED,
    DuplicateRequestId,
    QuotaEngine,
    ReserveRequest,
    ScopeLimit,
)
from quotas.windows import WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH


def limits(tenant_limit: int = 100, project: int = UNLIMITED, key: int = UNLIMITED,
           model: int = UNLIMITED, monthly: int = UNLIMITED) -> tuple[ScopeLimit, ...]:
    return (
        ScopeLimit("tenant", DAY, tenant_limit),
        ScopeLimit("project:p1", DAY, project),
        ScopeLimit("key:k1", DAY, key),
        ScopeLimit("model:gpt-4o", DAY, model),
        ScopeLimit("tenant", MONTH, monthly),
    )


def reserve(engine: QuotaEngine, tenant: str, rid: str, amount: int, lims=None, **kw):
    return engine.reserve(ReserveRequest(tenant, rid, amount, lims or limits(), **kw))


def test_exact_boundary_admitted_and_one_more_token_refused(engine: QuotaEngine, tenant: str) -> None:
    first = reserve(engine, tenant, "a", 60)
    engine.settle(first.hold, 60)  # used 60
    held = reserve(engine, tenant, "b", 30)  # pending 30
    assert held.admitted

    exact = reserve(engine, tenant, "c", 10)  # used + pending + amount == limit
    assert exact.admitted and exact.granted == 10
    assert exact.remaining == 0

    over = reserve(engine, tenant, "d", 1)
    assert not over.admitted
    assert over.refused is not None and over.refused.scope == "tenant"
    assert over.refused.window.kind is DAY
    assert over.hold is None
    c = engine.counter(tenant, "tenant")
    assert (c.limit, c.used, c.pending) == (100, 60, 40)


def test_limit_zero_refuses_everything(engine: QuotaEngine, tenant: str) -> None:
    result = reserve(engine, tenant, "a", 1, limits(tenant_limit=0))
    assert not result.admitted
    assert result.refused.scope == "tenant"
    # Nothing was written: no counter, no hold.
    assert engine.counter(tenant, "tenant").limit is None
    assert engine.open_hold_ids(tenant) == []


def test_unlimited_tracks_usage_but_never_refuses(engine: QuotaEngine, tenant: str) -> None:
    lims = (ScopeLimit("tenant", DAY, UNLIMITED),)
    result = reserve(engine, tenant, "a", 10**12, lims)
    assert result.admitted and result.remaining == UNLIMITED
    engine.settle(result.hold, 10**12)
    c = engine.counter(tenant, "tenant")
    assert (c.limit, c.used, c.pending) == (UNLIMITED, 10**12, 0)


@pytest.mark.parametrize(
    ("tight", "scope", "window"),
    [
        ({"project": 5}, "project:p1", DAY),
        ({"key": 5}, "key:k1", DAY),
        ({"model": 5}, "model:gpt-4o", DAY),
        ({"monthly": 5}, "tenant", MONTH),
        ({"tenant_limit": 5}, "tenant", DAY),
    ],
)
def test_each_scope_refuses_on_its_own_and_nothing_is_held_anywhere(
    engine: QuotaEngine, tenant: str, tight: dict, scope: str, window: WindowKind
) -> None:
    lims = limits(**{"tenant_limit": 1000, **tight})
    result = reserve(engine, tenant, "a", 6, lims)
    assert not result.admitted
    assert (result.refused.scope, result.refused.window.kind) == (scope, window)
    assert result.refused.remaining == 5
    for limit in lims:  # all or nothing: no counter got a pending amount
        assert engine.counter(tenant, limit.scope, limit.window).pending == 0
    assert reserve(engine, tenant, "b", 5, lims).admitted


def test_first_refusing_scope_is_reported_with_every_remaining_figure(
    engine: QuotaEngine, tenant: str
) -> None:
    lims = limits(tenant_limit=50, project=20, key=10)
    result = reserve(engine, tenant, "a", 30, lims)
    assert result.refused.scope == "project:p1"
    assert [c.remaining for c in result.counters] == [50, 20, 10, UNLIMITED, UNLIMITED]


def test_remaining_is_reported_after_the_hold(engine: QuotaEngine, tenant: str) -> None:
    result = reserve(engine, tenant, "a", 30, limits(tenant_limit=100, key=40))
    assert [c.remaining for c in result.counters] == [70, UNLIMITED, 10, UNLIMITED, UNLIMITED]
    assert result.remaining == 10


def test_dry_run_checks_and_holds_nothing(engine: QuotaEngine, tenant: str) -> None:
    dry = reserve(engine, tenant, "a", 100, dry_run=True)
    assert dry.admitted and dry.hold is None and dry.remaining == 0
    assert engine.counter(tenant, "tenant").limit is None
    assert engine.open_hold_ids(tenant) == []
    assert not reserve(engine, tenant, "b", 101, dry_run=True).admitted
    # The same request id can then be reserved for real.
    assert reserve(engine, tenant, "a", 100).admitted


def test_hold_shrinks_to_the_headroom_when_allowed(engine: QuotaEngine, tenant: str) -> None:
    reserve(engine, tenant, "a", 70)
    shrunk = reserve(engine, tenant, "b", 50, min_amount=10)
    assert shrunk.admitted and shrunk.granted == 30 and shrunk.hold.amount == 30
    assert engine.counter(tenant, "tenant").pending == 100
    refused = reserve(engine, tenant, "c", 50, min_amount=1)
    assert not refused.admitted


def test_shrinking_refuses_below_min_amount(engine: QuotaEngine, tenant: str) -> None:
    reserve(engine, tenant, "a", 95)
    result = reserve(engine, tenant, "b", 50, min_amount=6)
    assert not result.admitted and result.refused.remaining == 5


def test_reserve_is_idempotent_while_the_hold_is_open(engine: QuotaEngine, tenant: str) -> None:
    # A reserve whose reply was lost (socket timeout after Redis ran it) is sent again by the
    # client's retry: it must get the first call's hold, not a second one.
    first = reserve(engine, tenant, "same", 10)
    again = reserve(engine, tenant, "same", 10)
    assert again.admitted and again.hold == first.hold
    assert engine.counter(tenant, "tenant").pending == 10
    # The same id with other counters is a reused id, not a retry.
    with pytest.raises(DuplicateRequestId):
        reserve(engine, tenant, "same", 10, limits(tenant_limit=100, key=50)[:2])
    assert engine.counter(tenant, "tenant").pending == 10


def test_a_request_id_is_refused_once_its_hold_has_ended(engine: QuotaEngine, tenant: str) -> None:
    first = reserve(engine, tenant, "same", 10)
    engine.settle(first.hold, 5)
    with pytest.raises(DuplicateRequestId):
        reserve(engine, tenant, "same", 10)
    assert engine.counter(tenant, "tenant").pending == 0


def test_limit_passed_in_argv_takes_effect_on_the_next_request(engine: QuotaEngine, tenant: str) -> None:
    assert reserve(engine, tenant, "a", 80, limits(tenant_limit=100)).admitted
    assert not reserve(engine, tenant, "b", 30, limits(tenant_limit=100)).admitted
    # Plan upgraded: the next request carries the new limit and the counter records it.
    assert reserve(engine, tenant, "c", 30, limits(tenant_limit=200)).admitted
    assert engine.counter(tenant, "tenant").limit == 200


def test_ttls_counters_expire_after_their_window_and_holds_not_before_counters(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    result = reserve(engine, tenant, "a", 10)
    day = engine.counter(tenant, "tenant")
    month = engine.counter(tenant, "tenant", MONTH)
    day_window = result.counters[0].window
    grace = engine.settings.counter_grace_s
    expected_day_ttl = (day_window.end_ms - result.server_time_ms) // 1000 + grace
    assert abs(day.ttl_s - expected_day_ttl) <= 2
    assert month.ttl_s >= day.ttl_s
    hold_ttl = client.ttl(keys.hold_key(tenant, "a"))
    assert abs(hold_ttl - month.ttl_s) <= 2
    # The index has no TTL of its own (it is emptied as holds end) ...
    assert client.ttl(keys.hold_index_key(tenant)) == -1
    # ... and a reserve on a busy counter does not push its expiry out.
    before = client.pttl(day.key)
    reserve(engine, tenant, "b", 10)
    assert client.pttl(day.key) <= before
    # Once ended, the hold record is a short-lived tombstone and the index entry is gone.
    engine.settle(result.hold, 3)
    assert 0 < client.ttl(keys.hold_key(tenant, "a")) <= engine.settings.tombstone_s
    assert "a" not in engine.open_hold_ids(tenant)


@pytest.mark.parametrize(
    "bad",
    [
        {"amount": 0},
        {"amount": -5},
        {"amount": 1.5},
        {"amount": 10, "min_amount": 11},
        {"amount": 10, "min_amount": 0},
        {"request_id": "has space"},
        {"request_id": ""},
        {"request_id": "x" * 129},
        {"tenant": "a}b"},
        {"limits": ()},
    ],
)
def test_bad_input_is_refused_before_redis_and_changes_nothing(
    engine: QuotaEngine, tenant: str, bad: dict
) -> None:
    kwargs = {"tenant": tenant, "request_id": "r", "amount": 10, "limits": limits(), **bad}
    with pytest.raises(ValueError):
        engine.reserve(ReserveRequest(**kwargs))
    assert engine.open_hold_ids(tenant) == []


@pytest.mark.parametrize("bad", [{"limit": -2}, {"scope": "owner:1"}, {"scope": "model:has space"}])
def test_bad_scope_limits_are_refused(bad: dict) -> None:
    kwargs = {"scope": "tenant", "window": DAY, "limit": 10, **bad}
    with pytest.raises(ValueError):
        ScopeLimit(**kwargs)


def test_script_refuses_wrong_argument_counts(engine: QuotaEngine, tenant: str) -> None:
    # The scripts check their own arguments too, for callers other than this wrapper.
    with pytest.raises(redis.ResponseError, match="reserve: expected"):
        engine._scripts["reserve"](keys=[keys.hold_key(tenant, "x"), keys.hold_index_key(tenant)],
                                   args=["x", 1, 1, 0])
    with pytest.raises(redis.ResponseError, match="amount must be"):
        engine._scripts["reserve"](
            keys=[keys.hold_key(tenant, "x"), keys.hold_index_key(tenant),
                  keys.counter_key(tenant, "tenant", "d1")],
            args=["x", 0, 0, 0, 1, 0, -1, 600_000, "", 0, 0, 0, 0, 0, 10, 0, 2**50, 2**40, 0])
