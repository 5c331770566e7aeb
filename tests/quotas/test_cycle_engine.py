"""The quota engine reserving in a tenant's cycle (a billing-day month in Europe/Paris, and a
change of cycle that took effect), on a standalone Redis and on the 3-node cluster."""
from __future__ import annotations

import time
from datetime import date

import redis

from quotas import keys
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.windows import Calendar, Cycle, CycleKind, CycleSchedule, WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
BILLING = Cycle(CycleKind.MONTHLY, date(2026, 1, 15), zone="Europe/Paris")


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def limits(day: int, cycle: int) -> tuple[ScopeLimit, ...]:
    return (ScopeLimit("tenant", DAY, day), ScopeLimit("tenant", MONTH, cycle),
            ScopeLimit("tenant", MONTH, 1_000_000, Unit.MICROS))


def test_counters_live_in_the_billing_cycle_window(engine: QuotaEngine, client: redis.Redis,
                                                   tenant: str) -> None:
    schedule = CycleSchedule(BILLING)
    now = redis_ms(client)
    expected = Calendar(schedule)
    result = engine.reserve(ReserveRequest(tenant, "a", 300, limits(1_000, 500), schedule=schedule,
                                           money_amount=10))
    assert result.admitted
    by_kind = {(c.window.kind, c.key.split(":q:")[1].split(":")[1] == "usd"): c
               for c in result.counters}
    cycle = by_kind[(MONTH, False)]
    assert cycle.window == expected.window(MONTH, now)
    assert cycle.key == keys.counter_key(tenant, "tenant", cycle.window.id)
    assert cycle.window.id.startswith("c") and cycle.window.id[-2:] == "15"  # c<yyyy-mm>-15
    assert by_kind[(MONTH, True)].key == keys.spend_counter_key(tenant, "tenant",
                                                                cycle.window.id)
    assert by_kind[(DAY, False)].window == expected.window(DAY, now)  # the Paris day
    # The cycle's limit binds: 300 held of 500, so 250 more is refused.
    refused = engine.reserve(ReserveRequest(tenant, "b", 250, limits(1_000, 500),
                                            schedule=schedule))
    assert not refused.admitted and refused.refused.window.kind is MONTH
    engine.settle(result.hold, 200, "", 7)
    snapshot = engine.counter(tenant, "tenant", MONTH, schedule=schedule)
    assert (snapshot.used, snapshot.pending, snapshot.limit) == (200, 0, 500)
    # The same tenant read in the calendar month (UTC) sees another counter: nothing.
    assert engine.counter(tenant, "tenant", MONTH).limit is None


def test_a_change_that_took_effect_starts_fresh_counters_and_the_old_hold_settles_home(
        engine: QuotaEngine, client: redis.Redis, tenant: str) -> None:
    old = CycleSchedule(BILLING)
    held = engine.reserve(ReserveRequest(tenant, "before", 400, limits(1_000, 500),
                                         schedule=old))
    assert held.admitted
    # The tenant changed to weekly; the change took effect a whole second from now.
    switch = (redis_ms(client) // 1000 + 1) * 1000
    changed = CycleSchedule(BILLING, Cycle(CycleKind.DAYS, date(2026, 1, 5), 7,
                                           "Europe/Paris"), switch)
    while redis_ms(client) <= switch:
        time.sleep(0.02)
    after = engine.reserve(ReserveRequest(tenant, "after", 450, limits(1_000, 500),
                                          schedule=changed))
    assert after.admitted, "the first window after the change has the full limit"
    cycle = next(c for c in after.counters if c.window.kind is MONTH and c.unit is Unit.TOKENS)
    assert cycle.window.id.endswith(f"@{switch // 1000}") and cycle.window.start_ms == switch
    day = next(c for c in after.counters if c.window.kind is DAY)
    assert day.window.id.endswith(f"@{switch // 1000}")
    # The hold made before the change settles into the window it was made in.
    engine.settle(held.hold, 300)
    old_cycle = next(c for c in held.counters if c.window.kind is MONTH and
                     c.unit is Unit.TOKENS)
    assert engine.counter_at(old_cycle.key).used == 300
    assert engine.counter_at(cycle.key).pending == 450 and engine.counter_at(cycle.key).used == 0
