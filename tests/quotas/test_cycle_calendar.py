"""Cycle windows: billing-day months (the 31st in February), weekly and every-N-days cycles, time
zones over a daylight-saving change, and a change of cycle mid-window (quotas/windows.py)."""
from __future__ import annotations

from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest

from quotas.windows import Calendar, Cycle, CycleKind, CycleSchedule, WindowKind

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH


def utc(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


def local(zone: str, *args: int) -> int:
    return int(datetime(*args, tzinfo=ZoneInfo(zone)).timestamp() * 1000)


def cal(cycle: Cycle) -> Calendar:
    return Calendar(CycleSchedule(cycle))


def bounds(calendar: Calendar, kind: WindowKind, at: int) -> tuple[str, int, int]:
    window = calendar.window(kind, at)
    return window.id, window.start_ms, window.end_ms


# -- monthly from a billing day -------------------------------------------------------------------


def test_anchor_15_runs_from_the_15th_to_the_14th() -> None:
    billing = cal(Cycle(CycleKind.MONTHLY, date(2026, 1, 15)))
    assert bounds(billing, MONTH, utc(2026, 12, 20, 8)) == (
        "c2026-12-15", utc(2026, 12, 15), utc(2027, 1, 15))
    # The 14th is the cycle's last day; midnight of the 15th opens the next one.
    assert billing.window(MONTH, utc(2027, 1, 14, 23, 59, 59)).id == "c2026-12-15"
    assert billing.window(MONTH, utc(2027, 1, 15)).id == "c2027-01-15"
    # Before the 15th of a month: the cycle that started in the month before.
    assert bounds(billing, MONTH, utc(2026, 3, 2)) == (
        "c2026-02-15", utc(2026, 2, 15), utc(2026, 3, 15))


@pytest.mark.parametrize(("at", "window_id", "start", "end"), [
    # 2026: February has 28 days, so its cycle starts on the 28th and the next on March 31.
    (utc(2026, 2, 10), "c2026-01-31", utc(2026, 1, 31), utc(2026, 2, 28)),
    (utc(2026, 2, 28, 12), "c2026-02-28", utc(2026, 2, 28), utc(2026, 3, 31)),
    (utc(2026, 3, 30, 23), "c2026-02-28", utc(2026, 2, 28), utc(2026, 3, 31)),
    (utc(2026, 4, 30), "c2026-04-30", utc(2026, 4, 30), utc(2026, 5, 31)),
    # 2028 is a leap year: February's cycle starts on the 29th.
    (utc(2028, 2, 28, 23), "c2028-01-31", utc(2028, 1, 31), utc(2028, 2, 29)),
    (utc(2028, 2, 29, 1), "c2028-02-29", utc(2028, 2, 29), utc(2028, 3, 31)),
])
def test_anchor_31_ends_on_the_last_day_of_shorter_months(
        at: int, window_id: str, start: int, end: int) -> None:
    billing = cal(Cycle(CycleKind.MONTHLY, date(2025, 12, 31)))
    assert bounds(billing, MONTH, at) == (window_id, start, end)


def test_consecutive_billing_windows_tile_the_year_without_gap_or_overlap() -> None:
    billing = cal(Cycle(CycleKind.MONTHLY, date(2025, 1, 31), zone="Europe/Paris"))
    window = billing.window(MONTH, local("Europe/Paris", 2026, 1, 1))
    for _ in range(30):
        following = billing.window(MONTH, window.end_ms)
        assert following.start_ms == window.end_ms and following.id != window.id
        window = following


def test_the_calendar_month_keeps_its_historical_id() -> None:
    assert cal(Cycle(CycleKind.MONTHLY, date(2000, 1, 1))).window(MONTH, utc(2026, 12, 9)).id \
        == "m2026-12"


# -- weekly and every N days ----------------------------------------------------------------------


def test_weekly_from_the_anchor_weekday() -> None:
    weekly = cal(Cycle(CycleKind.DAYS, date(2026, 1, 7), 7))  # a Wednesday
    window_id, start, end = bounds(weekly, MONTH, utc(2026, 12, 6, 15))  # a Sunday
    assert (window_id, start, end) == ("c2026-12-02", utc(2026, 12, 2), utc(2026, 12, 9))
    assert datetime.fromtimestamp(start / 1000, UTC).weekday() == 2


def test_every_ten_days_before_and_after_the_anchor() -> None:
    tens = cal(Cycle(CycleKind.DAYS, date(2026, 12, 1), 10))
    assert bounds(tens, MONTH, utc(2026, 12, 25)) == ("c2026-12-21", utc(2026, 12, 21),
                                                      utc(2026, 12, 31))
    # Before the anchor the cycle runs backwards from it, on the same grid.
    assert bounds(tens, MONTH, utc(2026, 11, 25)) == ("c2026-11-21", utc(2026, 11, 21),
                                                      utc(2026, 12, 1))


def test_a_daily_cycle_never_shares_an_id_with_the_day() -> None:
    daily = cal(Cycle(CycleKind.DAYS, date(2000, 1, 1), 1))
    day, cycle = daily.window(DAY, utc(2026, 12, 9, 9)), daily.window(MONTH, utc(2026, 12, 9, 9))
    assert (day.start_ms, day.end_ms) == (cycle.start_ms, cycle.end_ms)
    assert (day.id, cycle.id) == ("d2026-12-09", "c2026-12-09")


def test_every_days_out_of_range_and_unknown_zones_are_refused() -> None:
    with pytest.raises(ValueError):
        Cycle(CycleKind.DAYS, date(2026, 1, 1), 0)
    with pytest.raises(ValueError):
        Cycle(CycleKind.DAYS, date(2026, 1, 1), 367)
    with pytest.raises(Exception):  # noqa: B017 - ZoneInfoNotFoundError, a KeyError
        Cycle(zone="Mars/Olympus_Mons")


# -- time zones and daylight saving ---------------------------------------------------------------


@pytest.mark.parametrize(("zone", "short_day", "long_day"), [
    # Europe/Paris: 2026-03-29 loses an hour, 2026-10-25 gains one.
    ("Europe/Paris", date(2026, 3, 29), date(2026, 10, 25)),
    # America/New_York: 2026-03-08 and 2026-11-01.
    ("America/New_York", date(2026, 3, 8), date(2026, 11, 1)),
])
def test_days_over_a_daylight_saving_change_last_23_and_25_hours(
        zone: str, short_day: date, long_day: date) -> None:
    calendar = cal(Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone=zone))
    for day, hours in ((short_day, 23), (long_day, 25)):
        noon = local(zone, day.year, day.month, day.day, 12)
        window = calendar.window(DAY, noon)
        assert window.id == f"d{day:%Y-%m-%d}"
        assert window.end_ms - window.start_ms == hours * 3600 * 1000
        assert window.start_ms == local(zone, day.year, day.month, day.day)
    # The cycle boundary is local midnight, whatever the offset on either side.
    march = calendar.window(MONTH, local(zone, 2026, 3, 20))
    assert (march.start_ms, march.end_ms) == (local(zone, 2026, 3, 1), local(zone, 2026, 4, 1))
    assert march.end_ms - march.start_ms == (31 * 24 - 1) * 3600 * 1000


def test_a_weekly_cycle_over_the_change_is_an_hour_short() -> None:
    zone = "Europe/Paris"
    weekly = cal(Cycle(CycleKind.DAYS, date(2026, 3, 23), 7, zone))  # a Monday
    window = weekly.window(MONTH, local(zone, 2026, 3, 28, 22))
    assert (window.start_ms, window.end_ms) == (local(zone, 2026, 3, 23), local(zone, 2026, 3, 30))
    assert window.end_ms - window.start_ms == (7 * 24 - 1) * 3600 * 1000


def test_the_day_is_the_local_day() -> None:
    tokyo = cal(Cycle(zone="Asia/Tokyo"))
    # 2026-11-30 17:00 UTC is 2026-12-01 02:00 in Tokyo.
    assert bounds(tokyo, DAY, utc(2026, 11, 30, 17)) == ("d2026-12-01", utc(2026, 11, 30, 15),
                                                         utc(2026, 12, 1, 15))
    assert tokyo.window(MONTH, utc(2026, 11, 30, 17)).id == "m2026-12"


# -- a change of cycle mid-window -----------------------------------------------------------------


def test_a_change_mid_window_finishes_the_old_window_then_starts_short() -> None:
    old = Cycle(CycleKind.MONTHLY, date(2000, 1, 1))  # calendar months, UTC
    new = Cycle(CycleKind.MONTHLY, date(2026, 1, 15), zone="Europe/Paris")
    switch = utc(2027, 1, 1)  # the end of the December window current when it was asked for
    calendar = Calendar(CycleSchedule(old, new, switch))
    before = calendar.window(MONTH, utc(2026, 12, 20))
    assert (before.id, before.start_ms, before.end_ms) == ("m2026-12", utc(2026, 12, 1), switch)
    first = calendar.window(MONTH, utc(2027, 1, 3))
    # The new cycle's window of the 3rd began on Dec 15 (Paris): it starts at the switch, with
    # an id of its own, and ends at the new cycle's next boundary (a short window).
    assert first.id == f"c2026-12-15@{switch // 1000}"
    assert (first.start_ms, first.end_ms) == (switch, local("Europe/Paris", 2027, 1, 15))
    after = calendar.window(MONTH, local("Europe/Paris", 2027, 1, 20))
    assert after.id == "c2027-01-15" and after.start_ms == first.end_ms
    assert len({before.id, first.id, after.id}) == 3  # no counter is shared
    # Days move to the new zone at the switch: the first one is cut at the switch too.
    day = calendar.window(DAY, switch + 1000)
    assert day.id == f"d2027-01-01@{switch // 1000}"
    assert (day.start_ms, day.end_ms) == (switch, local("Europe/Paris", 2027, 1, 2))
    assert calendar.window(DAY, switch - 1).end_ms == switch


def test_the_same_windows_once_the_change_is_folded_into_the_current_cycle() -> None:
    old, new = Cycle(CycleKind.DAYS, date(2000, 1, 1), 1), Cycle(CycleKind.DAYS,
                                                                  date(2026, 1, 5), 7)
    switch = utc(2026, 12, 10)
    pending = Calendar(CycleSchedule(old, new, switch))
    folded = Calendar(CycleSchedule(new, since_ms=switch))
    for at in (switch, switch + 3_600_000, utc(2026, 12, 14, 1), utc(2026, 12, 25)):
        for kind in (DAY, MONTH):
            assert pending.window(kind, at) == folded.window(kind, at)


def test_a_past_span_ends_where_its_cycle_did() -> None:
    weekly = Cycle(CycleKind.DAYS, date(2026, 1, 5), 7)
    span = Calendar(CycleSchedule(weekly, switch_ms=utc(2026, 12, 10), since_ms=utc(2026, 11, 3)))
    assert bounds(span, MONTH, utc(2026, 12, 8)) == ("c2026-12-07", utc(2026, 12, 7),
                                                     utc(2026, 12, 10))
    assert bounds(span, MONTH, utc(2026, 11, 4)) == (f"c2026-11-02@{utc(2026, 11, 3) // 1000}",
                                                     utc(2026, 11, 3), utc(2026, 11, 9))
