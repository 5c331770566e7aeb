"""Money budgets (micro-dollars) held and settled in the same reserve call as token quotas."""
from __future__ import annotations

import time

import pytest

from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.windows import WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
LIMITS = (ScopeLimit("tenant", DAY, 10_000), ScopeLimit("tenant", MONTH, 1_000, Unit.MICROS))


def reserve(engine: QuotaEngine, tenant: str, rid: str, tokens: int, money: int, **kw):
    return engine.reserve(ReserveRequest(tenant, rid, tokens, LIMITS, money_amount=money, **kw))


def test_worst_case_cost_is_held_and_actual_cost_settled(engine: QuotaEngine, tenant: str) -> None:
    first = reserve(engine, tenant, "a", 100, 600)
    assert first.admitted and [c.remaining for c in first.counters] == [9_900, 400]
    refused = reserve(engine, tenant, "b", 100, 500)  # the tokens fit, the money does not
    assert not refused.admitted and refused.refused.scope == "tenant"
    assert refused.refused.window.kind is MONTH
    engine.settle(first.hold, 80, actual_money=250)
    money = engine.counter(tenant, "tenant", MONTH, unit=Unit.MICROS)
    tokens = engine.counter(tenant, "tenant", DAY)
    assert (money.used, money.pending) == (250, 0)
    assert (tokens.used, tokens.pending) == (80, 0)
    assert reserve(engine, tenant, "c", 100, 750).admitted  # 250 + 750 == 1,000


def test_release_and_sweep_free_the_money_held(engine: QuotaEngine, tenant: str) -> None:
    a = reserve(engine, tenant, "a", 10, 300)
    reserve(engine, tenant, "b", 10, 200)
    engine.release(a.hold)
    time.sleep(0.002)
    engine.sweep(tenant, stale_s=0)
    money = engine.counter(tenant, "tenant", MONTH, unit=Unit.MICROS)
    assert (money.used, money.pending) == (0, 0)


def test_shrinking_the_token_hold_never_shrinks_the_money_hold(engine: QuotaEngine, tenant: str) -> None:
    reserve(engine, tenant, "big", 9_950, 10)
    shrunk = reserve(engine, tenant, "small", 100, 500, min_amount=10)
    assert shrunk.admitted and shrunk.granted == 50
    assert engine.counter(tenant, "tenant", MONTH, unit=Unit.MICROS).pending == 510


def test_a_zero_budget_refuses_any_call_that_costs_something(engine: QuotaEngine, tenant: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10_000), ScopeLimit("tenant", MONTH, 0, Unit.MICROS))
    assert not engine.reserve(ReserveRequest(tenant, "x", 1, limits, money_amount=1)).admitted


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_bad_money_amounts_are_refused(tenant: str, bad: object) -> None:
    with pytest.raises(ValueError):
        ReserveRequest(tenant, "x", 1, LIMITS, money_amount=bad)


def test_a_free_call_under_a_budget_ends_cleanly(engine: QuotaEngine, tenant: str) -> None:
    # Found by the state machine: holding 0 micro-dollars once made release and sweep send
    # HINCRBY "-0", which Redis refuses, leaving the hold open.
    a = reserve(engine, tenant, "a", 10, 0)
    b = reserve(engine, tenant, "b", 10, 0)
    c = reserve(engine, tenant, "c", 10, 0)
    assert engine.release(a.hold).outcome == "released"
    assert engine.settle(b.hold, 5, actual_money=0).outcome == "settled"
    time.sleep(0.002)
    assert [h.request_id for h in engine.sweep(tenant, stale_s=0).swept] == [c.request_id]
    money = engine.counter(tenant, "tenant", MONTH, unit=Unit.MICROS)
    assert (money.used, money.pending) == (0, 0)
