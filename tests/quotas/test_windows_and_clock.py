"""One clock: windows follow the Redis server's clock, whatever the gateway host's clock says."""
from __future__ import annotations

import time
from datetime import UTC, date, datetime

import pytest
import redis

from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.windows import (
    UTC_MONTHLY,
    Calendar,
    Cycle,
    CycleKind,
    CycleSchedule,
    RedisClock,
    WindowKind,
)

DAY, MONTH, MINUTE = WindowKind.DAY, WindowKind.MONTH, WindowKind.MINUTE


def ms(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# -- the calendar -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "kind", "window_id", "start", "end"),
    [
        (ms(2026, 11, 30, 23, 59, 59), DAY, "d2026-11-30", ms(2026, 11, 30), ms(2026, 12, 1)),
        (ms(2026, 12, 1), DAY, "d2026-12-01", ms(2026, 12, 1), ms(2026, 12, 2)),
        (ms(2026, 12, 31, 12), MONTH, "m2026-12", ms(2026, 12, 1), ms(2027, 1, 1)),
        (ms(2028, 2, 29, 5), MONTH, "m2028-02", ms(2028, 2, 1), ms(2028, 3, 1)),
        (ms(2026, 11, 30, 10, 5, 59), MINUTE, "n2026-11-30T10:05", ms(2026, 11, 30, 10, 5),
         ms(2026, 11, 30, 10, 6)),
    ],
)
def test_utc_windows(now: int, kind: WindowKind, window_id: str, start: int, end: int) -> None:
    window = Calendar().window(kind, now)
    assert (window.id, window.start_ms, window.end_ms) == (window_id, start, end)


def test_a_time_zone_moves_the_boundaries_to_local_midnight() -> None:
    shanghai = Calendar(CycleSchedule(Cycle(zone="Asia/Shanghai")))
    # 2026-11-30 17:00 UTC is 2026-12-01 01:00 in UTC+8.
    window = shanghai.window(DAY, ms(2026, 11, 30, 17))
    assert window.id == "d2026-12-01"
    assert window.start_ms == ms(2026, 11, 30, 16)
    assert shanghai.window(MONTH, ms(2026, 11, 30, 17)).id == "m2026-12"


def test_redis_clock_learns_the_offset() -> None:
    clock = RedisClock(local_clock=lambda: 1000.0)
    assert clock.now_ms() == 1_000_000
    clock.observe(1_600_000)
    assert clock.now_ms() == 1_600_000


# -- against the real server --------------------------------------------------------------------


# A schedule whose windows end `in_seconds` after Redis now: a change of cycle switching then
# (the current day and cycle windows end at the switch, new ones start with it). It is how a test
# makes "tomorrow" arrive on a Redis clock it cannot set: the windows move exactly as they do at
# a real midnight. (Time zones move midnight by whole hours or so only.)
def boundary_schedule(client: redis.Redis, in_seconds: float) -> CycleSchedule:
    switch_ms = redis_ms(client) + int(in_seconds * 1000)
    return CycleSchedule(UTC_MONTHLY.current, Cycle(CycleKind.DAYS, date(2000, 1, 1), 1), switch_ms)


def noon_schedule(client: redis.Redis) -> CycleSchedule:
    """No switch, in a time zone where Redis now is about local noon: the day boundary is hours
    away from every clock of the test."""
    hour = (redis_ms(client) // 3_600_000) % 24
    shift = (12 - hour + 12) % 24 - 12  # -12..11 hours east of UTC
    zone = "UTC" if shift == 0 else f"Etc/GMT{-shift:+d}"  # Etc/GMT-5 is UTC+5
    return CycleSchedule(Cycle(zone=zone))


def wait_for_redis_ms(client: redis.Redis, target_ms: int) -> None:
    while redis_ms(client) < target_ms:
        time.sleep(0.02)


LIMIT = 1000


def request(tenant: str, rid: str, amount: int, schedule: CycleSchedule) -> ReserveRequest:
    return ReserveRequest(tenant, rid, amount, (ScopeLimit("tenant", DAY, LIMIT),),
                          schedule=schedule)


def test_hold_reserved_before_midnight_is_settled_into_its_own_day(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    schedule = boundary_schedule(client, 1.5)
    before = engine.reserve(request(tenant, "before", 800, schedule))
    day1 = before.counters[0].window
    assert before.admitted
    wait_for_redis_ms(client, day1.end_ms + 20)

    after = engine.reserve(request(tenant, "after", 900, schedule))
    day2 = after.counters[0].window
    assert after.admitted, "a new day starts with the full quota"
    assert day2.start_ms == day1.end_ms and day2.id != day1.id

    engine.settle(before.hold, 600)
    engine.settle(after.hold, 100)
    old = engine.counter_at(before.counters[0].key)
    new = engine.counter_at(after.counters[0].key)
    assert (old.used, old.pending) == (600, 0)
    assert (new.used, new.pending) == (100, 0)


def test_hold_released_and_swept_after_midnight_leave_both_days_clean(
    engine: QuotaEngine, client: redis.Redis, tenant: str
) -> None:
    schedule = boundary_schedule(client, 1.2)
    a = engine.reserve(request(tenant, "a", 300, schedule))
    engine.reserve(request(tenant, "b", 300, schedule))  # left open: swept below
    wait_for_redis_ms(client, a.counters[0].window.end_ms + 20)
    c = engine.reserve(request(tenant, "c", 1000, schedule))
    assert c.admitted
    engine.release(a.hold)
    time.sleep(0.002)
    assert {h.request_id for h in engine.sweep(tenant, stale_s=0).swept} == {"b", "c"}
    old = engine.counter_at(a.counters[0].key)
    new = engine.counter_at(c.counters[0].key)
    assert old.pending == 0 and old.used == 0
    assert new.pending == 0


@pytest.mark.parametrize("host_skew_s", [600, -600])
def test_a_host_clock_off_by_minutes_still_charges_the_redis_day(
    client: redis.Redis, tenant: str, host_skew_s: int
) -> None:
    # A day boundary lies between the true (Redis) time and the skewed host's time, so the host
    # alone would pick the wrong day.
    schedule = boundary_schedule(client, host_skew_s / 2)
    skewed = QuotaEngine(client, clock=RedisClock(local_clock=lambda: time.time() + host_skew_s))
    host_window = Calendar(schedule).window(DAY, int((time.time() + host_skew_s) * 1000))
    result = skewed.reserve(request(tenant, "r", 10, schedule))
    true_window = Calendar(schedule).window(DAY, redis_ms(client))
    assert host_window.id != true_window.id  # the skew really crosses a day boundary
    assert result.admitted
    assert result.counters[0].window == true_window
    assert result.counters[0].window.contains(result.server_time_ms)
    # The engine learnt the offset: the next request needs no correction.
    assert abs(skewed.clock.now_ms() - redis_ms(client)) < 1000
    honest = QuotaEngine(client)
    assert honest.counter(tenant, "tenant", schedule=schedule).pending == 10


def test_two_hosts_with_opposite_skews_share_one_counter(client: redis.Redis, tenant: str) -> None:
    ahead = QuotaEngine(client, clock=RedisClock(local_clock=lambda: time.time() + 3600))
    behind = QuotaEngine(client, clock=RedisClock(local_clock=lambda: time.time() - 3600))
    schedule = noon_schedule(client)  # the day boundary is far from every clock
    day = (ScopeLimit("tenant", DAY, 100),)
    a = ahead.reserve(ReserveRequest(tenant, "a", 60, day, schedule=schedule))
    b = behind.reserve(ReserveRequest(tenant, "b", 60, day, schedule=schedule))
    assert a.counters[0].key == b.counters[0].key
    assert a.admitted and not b.admitted
