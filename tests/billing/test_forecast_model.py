"""The forecast model (billing/forecast.py) on synthetic usage histories whose end is known: a
constant rate gives the exact straight line; a history with a daily shape lets the shape method
predict the day's (and the cycle's) end within a stated tolerance, also across a daylight-saving
change; too little history falls back to the trailing rate. Pure functions: no database."""
from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from billing.forecast import (
    DAILY_SHAPE,
    HOUR_MS,
    TRAILING_RATE,
    ForecastSettings,
    History,
    forecast,
    iso,
    local_hour,
)
from quotas.windows import Calendar, Cycle, CycleKind, CycleSchedule, WindowKind

SETTINGS = ForecastSettings(trailing_hours=3, history_days=28, shape_min_days=7)
# The shape method's promise on these histories (every hour's usage off its usual by up to
# +-5 %, at random): the forecast of the window's end is within 5 % of the end the synthetic
# history really reaches (over 300 seeds the worst was 3.7 %: a morning of few busy hours
# compared; a whole day or more compared does better). Without noise it is exact but for the
# rounding of hours and the duplicated hour of a daylight-saving day (EXACT).
EXACT = 0.005
NOISE = 0.05
TOLERANCE = 0.05


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def calendar(zone: str = "UTC") -> Calendar:
    return Calendar(CycleSchedule(Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone=zone)))


def hours_of(start_ms: int, now_ms: int, per_hour: Callable[[int], float]) -> dict[int, int]:
    """Hourly buckets from start_ms (an hour start) to now: per_hour(bucket) tokens in each full
    hour, the share of it already elapsed in the hour containing now."""
    out = {}
    bucket = start_ms
    while bucket < now_ms:
        share = min(1.0, (now_ms - bucket) / HOUR_MS)
        out[bucket] = round(per_hour(bucket) * share)
        bucket += HOUR_MS
    return out


def run(*, zone: str, now_ms: int, kind: WindowKind, used: int, limit: int, hours: dict[int, int],
        since_ms: int, credit: int = 0, pending: int = 0):
    cal = calendar(zone)
    return forecast(window=cal.window(kind, now_ms), today=cal.window(WindowKind.DAY, now_ms),
                    now_ms=now_ms, used=used, pending=pending, limit=limit, credit=credit,
                    history=History(hours, since_ms, now_ms), zone=zone, settings=SETTINGS)


def test_a_constant_rate_gives_the_exact_straight_line() -> None:
    now = ms(datetime(2026, 12, 1, 10, 20, tzinfo=UTC))
    since = ms(datetime(2026, 11, 29, tzinfo=UTC))  # two days: too little for the shape
    hours = hours_of(since, now, lambda _: 1_200)
    used = 10 * 1_200 + 400  # the day so far at 1,200 an hour
    fc = run(zone="UTC", now_ms=now, kind=WindowKind.DAY, used=used, limit=20_000, hours=hours,
             since_ms=since)
    assert fc.method == TRAILING_RATE
    assert fc.inputs["trailing_tokens"] == 3_600 and fc.inputs["rate_per_hour"] == 1_200
    assert fc.inputs["why"] == "fewer than 7 days of history"
    assert fc.tokens == 24 * 1_200  # the whole day at the rate
    assert fc.percent == 144.0
    # 7,600 tokens left at 1,200 an hour: 6 h 20 min after 10:20.
    assert fc.reach_ms == ms(datetime(2026, 12, 1, 16, 40, tzinfo=UTC))
    assert iso(fc.reach_ms) == "2026-12-01T16:40:00+00:00"
    assert fc.path == ((now, used), (fc.window.end_ms, 28_800))

    month = run(zone="UTC", now_ms=now, kind=WindowKind.MONTH, used=used, limit=1_000_000,
                hours=hours, since_ms=since)
    assert month.window.id == "m2026-12"
    assert month.tokens == used + 1_200 * (31 * 24 - 10) - 400  # the rest of December
    assert month.reach_ms is None and month.percent == 89.3


def test_held_tokens_and_credit_count() -> None:
    now = ms(datetime(2026, 12, 1, 12, tzinfo=UTC))
    since = ms(datetime(2026, 11, 30, tzinfo=UTC))
    hours = hours_of(since, now, lambda _: 100)
    fc = run(zone="UTC", now_ms=now, kind=WindowKind.DAY, used=1_000, pending=200, limit=2_000,
             credit=1_000, hours=hours, since_ms=since)
    assert fc.so_far == 1_200 and fc.capacity == 3_000
    assert fc.tokens == 1_200 + 12 * 100 and fc.percent == 80.0 and fc.reach_ms is None


def test_already_at_the_limit_is_reached_now_and_idle_never() -> None:
    now = ms(datetime(2026, 12, 1, 12, tzinfo=UTC))
    since = ms(datetime(2026, 11, 30, tzinfo=UTC))
    full = run(zone="UTC", now_ms=now, kind=WindowKind.DAY, used=5_000, limit=5_000, hours={},
               since_ms=since)
    assert full.reach_ms == now and full.tokens == 5_000
    idle = run(zone="UTC", now_ms=now, kind=WindowKind.DAY, used=0, limit=5_000, hours={},
               since_ms=since)
    assert (idle.tokens, idle.percent, idle.reach_ms, idle.method) == (0, 0.0, None, TRAILING_RATE)


# -- a daily shape -------------------------------------------------------------------------------

# Tokens per local hour of a usual day: quiet nights, a morning peak, busy office hours.
PROFILE = [50] * 7 + [300, 900, 1_500, 1_500, 1_200, 800, 1_200, 1_400, 1_400, 1_000, 600] + \
    [300] * 4 + [100] * 2
assert len(PROFILE) == 24


def shaped_history(zone: str, start: datetime, now: datetime, end: datetime,
                   today_factor: float, seed: int = 7, noise: float = NOISE,
                   ) -> tuple[dict[int, int], int, int, int]:
    """Hourly usage following PROFILE (local hours of `zone`) with +-`noise` noise, today's (from
    today's local midnight) at `today_factor` times; returns (hours up to now, tokens of today
    up to now, tokens from now to `end`, start in ms). The future part is what "really" happens:
    the forecast never sees it."""
    rng = random.Random(seed)
    tz = ZoneInfo(zone)
    today = datetime.combine(now.astimezone(tz).date(), datetime.min.time(), tzinfo=tz)
    start_ms, now_ms, end_ms, today_ms = ms(start), ms(now), ms(end), ms(today)
    every: dict[int, float] = {}
    bucket = start_ms
    while bucket < end_ms:
        factor = today_factor if bucket >= today_ms else 1.0
        wobble = rng.uniform(1 - noise, 1 + noise)
        every[bucket] = PROFILE[local_hour(bucket, zone)] * factor * wobble
        bucket += HOUR_MS
    past = {b: round(t) for b, t in every.items() if b + HOUR_MS <= now_ms}
    current = now_ms - now_ms % HOUR_MS
    elapsed = (now_ms - current) / HOUR_MS
    past[current] = round(every[current] * elapsed)
    today_so_far = sum(t for b, t in past.items() if b >= today_ms)
    future = round(every[current] * (1 - elapsed)) + sum(
        round(t) for b, t in every.items() if b > current)
    return past, today_so_far, future, start_ms


@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris", "Asia/Kolkata"])
def test_the_daily_shape_predicts_the_day_end_within_tolerance(zone: str) -> None:
    tz = ZoneInfo(zone)
    now = datetime(2026, 12, 10, 13, 20, tzinfo=tz)
    start = datetime(2026, 11, 22, tzinfo=UTC)  # 18 days of history
    day_end = datetime(2026, 12, 11, tzinfo=tz)
    hours, today_so_far, future, since = shaped_history(zone, start, now, day_end, 1.5)
    true_end = today_so_far + future
    fc = run(zone=zone, now_ms=ms(now), kind=WindowKind.DAY, used=today_so_far, limit=18_000,
             hours=hours, since_ms=since)
    assert fc.method == DAILY_SHAPE
    assert fc.inputs["history_days"] >= 17
    assert 1.4 < fc.inputs["ratio"] < 1.6  # today runs at 1.5 times the usual day
    assert abs(fc.tokens - true_end) <= TOLERANCE * true_end, (fc.tokens, true_end)
    # The trailing rate alone (office hours' pace through the night) would be far off.
    trailing = forecast(
        window=fc.window, today=calendar(zone).window(WindowKind.DAY, ms(now)), now_ms=ms(now),
        used=today_so_far, pending=0, limit=18_000, credit=0,
        history=History(hours, since, ms(now)), zone=zone,
        settings=ForecastSettings(trailing_hours=3, history_days=28, shape_min_days=28))
    assert trailing.method == TRAILING_RATE
    assert abs(trailing.tokens - true_end) > 3 * abs(fc.tokens - true_end)
    # The limit is reached on the path the forecast draws, when it crosses 18,000.
    assert fc.reach_ms is not None
    crossing = next(t for t, tokens in fc.path if tokens >= 18_000)
    assert fc.window.start_ms < fc.reach_ms <= crossing
    assert fc.path[0] == (ms(now), today_so_far) and fc.path[-1] == (fc.window.end_ms, fc.tokens)

    exact, so_far, future, since = shaped_history(zone, start, now, day_end, 1.5, noise=0)
    fc = run(zone=zone, now_ms=ms(now), kind=WindowKind.DAY, used=so_far, limit=18_000,
             hours=exact, since_ms=since)
    assert fc.inputs["ratio"] == pytest.approx(1.5, abs=0.002)  # hours rounded to tokens
    assert abs(fc.tokens - (so_far + future)) <= EXACT * (so_far + future)


def test_the_daily_shape_predicts_the_cycle_end() -> None:
    zone = "Europe/Paris"
    tz = ZoneInfo(zone)
    now = datetime(2026, 12, 10, 9, 45, tzinfo=tz)
    start = datetime(2026, 11, 12, tzinfo=UTC)
    month_end = datetime(2027, 1, 1, tzinfo=tz)
    hours, today_so_far, future, since = shaped_history(zone, start, now, month_end, 1.0, seed=3)
    month_start_ms = ms(datetime(2026, 12, 1, tzinfo=tz))
    used = sum(t for b, t in hours.items() if b >= month_start_ms)
    fc = run(zone=zone, now_ms=ms(now), kind=WindowKind.MONTH, used=used, limit=400_000,
             hours=hours, since_ms=since)
    assert fc.method == DAILY_SHAPE and fc.window.id == "m2026-12"
    true_end = used + future
    assert abs(fc.tokens - true_end) <= TOLERANCE * true_end, (fc.tokens, true_end)


def test_the_shape_follows_local_hours_over_a_daylight_saving_change() -> None:
    zone = "America/New_York"  # clocks go back on 2026-11-01
    tz = ZoneInfo(zone)
    now = datetime(2026, 11, 5, 11, 0, tzinfo=tz)
    start = datetime(2026, 10, 20, tzinfo=UTC)
    day_end = datetime(2026, 11, 6, tzinfo=tz)
    hours, today_so_far, future, since = shaped_history(zone, start, now, day_end, 0.7, seed=11)
    fc = run(zone=zone, now_ms=ms(now), kind=WindowKind.DAY, used=today_so_far, limit=50_000,
             hours=hours, since_ms=since)
    assert fc.method == DAILY_SHAPE
    true_end = today_so_far + future
    assert abs(fc.tokens - true_end) <= TOLERANCE * true_end, (fc.tokens, true_end)


def test_too_little_history_falls_back_to_the_trailing_rate() -> None:
    zone = "UTC"
    now = datetime(2026, 12, 10, 13, 20, tzinfo=UTC)
    start = datetime(2026, 12, 4, tzinfo=UTC)  # six days
    hours, today_so_far, _, since = shaped_history(zone, start, now,
                                                   datetime(2026, 12, 11, tzinfo=UTC), 1.0)
    fc = run(zone=zone, now_ms=ms(now), kind=WindowKind.DAY, used=today_so_far, limit=50_000,
             hours=hours, since_ms=since)
    assert fc.method == TRAILING_RATE and fc.inputs["why"] == "fewer than 7 days of history"
    expected_rate = sum(hours.get(ms(now) - ms(now) % HOUR_MS - k * HOUR_MS, 0) * f
                        for k, f in ((0, 1), (1, 1), (2, 1), (3, 2 / 3))) / 3
    assert fc.inputs["rate_per_hour"] == round(expected_rate)
    # One day more and the shape takes over.
    longer, so_far, _, since = shaped_history(zone, start - timedelta(days=1), now,
                                              datetime(2026, 12, 11, tzinfo=UTC), 1.0)
    assert run(zone=zone, now_ms=ms(now), kind=WindowKind.DAY, used=so_far, limit=50_000,
               hours=longer, since_ms=since).method == DAILY_SHAPE


def test_hours_that_are_usually_idle_say_nothing_about_today() -> None:
    """History only in office hours; at 03:00 the hours compared (today so far and the trailing
    three) usually carry nothing, so a burst at night is forecast at its own rate."""
    now = ms(datetime(2026, 12, 10, 3, 0, tzinfo=UTC))
    since = ms(datetime(2026, 11, 20, tzinfo=UTC))

    def office(bucket: int) -> float:
        return 1_000 if 9 <= local_hour(bucket, "UTC") < 17 else 0

    hours = hours_of(since, now - 3 * HOUR_MS, office)
    hours.update({now - 2 * HOUR_MS: 600, now - HOUR_MS: 600})
    fc = run(zone="UTC", now_ms=now, kind=WindowKind.DAY, used=1_200, limit=100_000, hours=hours,
             since_ms=since)
    assert fc.method == TRAILING_RATE
    assert fc.inputs["why"] == "the hours compared usually carry almost no usage"
    assert fc.tokens == 1_200 + 400 * 21


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ForecastSettings(trailing_hours=0)
    with pytest.raises(ValueError):
        ForecastSettings(history_days=5, shape_min_days=7)
