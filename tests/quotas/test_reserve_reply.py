"""An admitted reservation is made without the frozen dataclass's __init__, and its counters on
first read (quotas/engine.py _admitted, Reservation.__getattr__): what the gateway gets must be
the Reservation the engine made before, field for field, on the real scripts."""
from __future__ import annotations

import dataclasses

import pytest

from quotas.engine import (
    CounterState,
    Hold,
    QuotaEngine,
    Reservation,
    ReserveRequest,
    ScopeLimit,
    Unit,
    EngineSettings,
    _Calls,
)
from quotas.windows import RedisClock, WindowKind
from tests.quotas.conftest import new_tenant
from tests.quotas.test_reserve_shapes import GAUGE, LIMITS, RATES


def _eager(reservation: Reservation) -> Reservation:
    """The same reservation made through Reservation's own __init__."""
    values = {f.name: getattr(reservation, f.name) for f in dataclasses.fields(Reservation)}
    return Reservation(**values)


def test_an_admitted_reservation_is_the_one_init_makes(engine: QuotaEngine) -> None:
    tenant = new_tenant()
    request = ReserveRequest(tenant, "r1", 40, LIMITS, rates=RATES, concurrency=GAUGE,
                             money_amount=900, meta='{"p":1}')
    reservation = engine.reserve(request)
    assert reservation.admitted and reservation.outcome == "admitted"
    assert "counters" not in vars(reservation)  # not made until read
    counters = reservation.counters
    assert vars(reservation)["counters"] is counters and reservation.counters is counters
    assert all(type(c) is CounterState for c in counters)
    by_scope = {(c.scope, c.window.kind, c.unit): c.remaining for c in counters}
    assert by_scope[("tenant", WindowKind.DAY, Unit.TOKENS)] == 960
    assert by_scope[("key:k", WindowKind.DAY, Unit.TOKENS)] == 760
    assert by_scope[("tenant", WindowKind.MONTH, Unit.MICROS)] == 10**9 - 900
    assert reservation.remaining == 760
    # Field for field what __init__ makes: equal, same repr and hash-free, replace() works.
    eager = _eager(reservation)
    assert eager == reservation and repr(eager) == repr(reservation)
    assert dataclasses.replace(reservation, queue_wait_ms=5).counters == counters
    assert reservation.rate_remaining == eager.rate_remaining and len(RATES) == 2
    hold = reservation.hold
    assert type(hold) is Hold and hold == Hold(
        tenant, "r1", 40, hold.counter_keys, hold.gauge_key, 900, hold.units, '{"p":1}',
        reservation.server_time_ms)
    assert hold.gauge_key and len(hold.counter_keys) == len(LIMITS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reservation.granted = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        reservation.no_such_field  # type: ignore[attr-defined]  # noqa: B018
    assert engine.settle(hold, 10).outcome == "settled"


def test_a_dry_run_holds_nothing_and_a_refusal_is_made_at_once(engine: QuotaEngine) -> None:
    tenant = new_tenant()
    dry = engine.reserve(ReserveRequest(tenant, "d", 40, LIMITS, dry_run=True))
    assert dry.admitted and dry.hold is None and engine.open_hold_ids(tenant) == []
    # What would be left after such a hold; nothing was held (the same figure again).
    assert dry.counters[0].remaining == 960
    again = engine.reserve(ReserveRequest(tenant, "d", 40, LIMITS, dry_run=True))
    assert again.counters == dry.counters
    small = (ScopeLimit("tenant", WindowKind.DAY, 10),)
    refused = engine.reserve(ReserveRequest(tenant, "r", 40, small))
    assert not refused.admitted and "counters" in vars(refused)
    assert refused.refused is not None and refused.refused.remaining == 10


def test_a_reply_short_of_counters_is_refused_at_once() -> None:
    # Made lazily, the counters would fail only when read, far from the reply that was wrong.
    calls = _Calls(EngineSettings(), RedisClock())
    call = calls.reserve(ReserveRequest(new_tenant(), "r", 40, LIMITS))
    with pytest.raises(ValueError, match="reply"):
        calls.reserve_reply(call, [1, 40, calls.clock.now_ms(), 900])
