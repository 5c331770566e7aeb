"""Quota windows (day, month, minute) and the gateway's estimate of the Redis server's clock.

Windows are computed in Python from an estimate of Redis time and passed to the scripts as
[start, end) in milliseconds; the scripts read `TIME` and refuse a window that does not contain
it. The estimate is corrected from the server time that every refusal carries, so it costs no
extra round trip, and a host whose own clock is minutes off still charges the right window.
"""
from __future__ import annotations

import calendar
import time as _time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo


class WindowKind(StrEnum):
    DAY = "day"
    # The tenant's cycle (CycleSchedule): a calendar month unless its plan resets daily or it
    # has a cycle of its own; named "month" since the budgets it carries are "monthly" ones.
    MONTH = "month"
    MINUTE = "minute"
    # Pace periods of the burn-rate breaker (quotas/pace.py): fixed windows of that many
    # seconds, aligned to the epoch (each divides an hour, so they start on the clock's
    # marks). One kind per period a plan may choose (tenants.models.PACE_PERIODS).
    PACE_1S = "p1s"
    PACE_2S = "p2s"
    PACE_5S = "p5s"
    PACE_10S = "p10s"
    PACE_30S = "p30s"
    PACE_1M = "p60s"
    PACE_5M = "p300s"
    PACE_10M = "p600s"
    PACE_15M = "p900s"
    PACE_20M = "p1200s"
    PACE_30M = "p1800s"
    PACE_1H = "p3600s"

    @property
    def pace_seconds(self) -> int | None:
        """The period of a pace kind in seconds; None for the quota windows."""
        return _PACE_SECONDS.get(self)


_PACE_SECONDS: dict[WindowKind, int] = {
    kind: int(kind.value[1:-1]) for kind in WindowKind if kind.value.startswith("p")
}
_PACE_KINDS: dict[int, WindowKind] = {seconds: kind for kind, seconds in _PACE_SECONDS.items()}


def pace_kind(seconds: int) -> WindowKind:
    """The window kind of a pace period (ValueError for a period no kind has)."""
    try:
        return _PACE_KINDS[seconds]
    except KeyError:
        raise ValueError(f"no pace period of {seconds} s; the periods are "
                         f"{sorted(_PACE_KINDS)}") from None


def pace_windows(kind: WindowKind, start_ms: int, until_ms: int) -> list[Window]:
    """The consecutive windows of a pace kind from the one containing `start_ms` up to the one
    containing `until_ms - 1` (the periods a breaker closes, quotas/pace.py)."""
    seconds = kind.pace_seconds
    if seconds is None:
        raise ValueError(f"{kind} is not a pace period")
    out = [_pace_window(kind, seconds * 1000, start_ms)]
    while out[-1].end_ms < until_ms:
        out.append(_pace_window(kind, seconds * 1000, out[-1].end_ms))
    return out


def _pace_window(kind: WindowKind, period_ms: int, now_ms: int) -> Window:
    start = now_ms - now_ms % period_ms
    moment = datetime.fromtimestamp(start // 1000, UTC)
    return Window(kind=kind, id=f"{kind.value}{moment:%Y-%m-%dT%H:%M:%S}", start_ms=start,
                  end_ms=start + period_ms)


@dataclass(frozen=True)
class Window:
    kind: WindowKind
    id: str
    start_ms: int
    end_ms: int

    def contains(self, now_ms: int) -> bool:
        return self.start_ms <= now_ms < self.end_ms


class CycleKind(StrEnum):
    MONTHLY = "monthly"  # from the anchor's day of the month (1: the calendar month)
    DAYS = "days"  # every `every_days` days from the anchor date (7: weekly, 1: daily)


@dataclass(frozen=True)
class Cycle:
    """A tenant's cycle: the window of its 'month' counters, at local midnight in `zone`.

    MONTHLY runs from the anchor's day of the month to the same day of the next month; a day the
    month lacks (the 31st in February) is the month's last day, and the next window still starts
    on the anchor day where the month has it (Jan 31 - Feb 28, Feb 28 - Mar 31). DAYS runs every
    `every_days` calendar days from the anchor date (local midnights, so a window over a
    daylight-saving change is an hour shorter or longer).
    """

    kind: CycleKind = CycleKind.MONTHLY
    anchor: date = date(2000, 1, 1)
    every_days: int = 1
    zone: str = "UTC"

    def __post_init__(self) -> None:
        if self.kind is CycleKind.DAYS and not 1 <= self.every_days <= 366:
            raise ValueError(f"every_days must be 1..366, not {self.every_days}")
        ZoneInfo(self.zone)  # ZoneInfoNotFoundError for a name the tz database lacks

    @property
    def calendar_month(self) -> bool:
        return self.kind is CycleKind.MONTHLY and self.anchor.day == 1

    def bounds(self, local_day: date) -> tuple[date, date]:
        """The first day of the window containing `local_day` and the first day after it."""
        if self.kind is CycleKind.DAYS:
            k = (local_day - self.anchor).days // self.every_days
            first = self.anchor + timedelta(days=k * self.every_days)
            return first, first + timedelta(days=self.every_days)
        first = _anchor_day(local_day.year, local_day.month, self.anchor.day)
        if local_day < first:
            year, month = _month_step(local_day.year, local_day.month, -1)
            first = _anchor_day(year, month, self.anchor.day)
        year, month = _month_step(first.year, first.month, 1)
        return first, _anchor_day(year, month, self.anchor.day)

    def window_id(self, first: date) -> str:
        # The calendar month keeps its historical id (m2026-12); other cycles name their first
        # day. Distinct from day ids (d...), so a daily cycle and the day never share a counter.
        return f"m{first:%Y-%m}" if self.calendar_month else f"c{first:%Y-%m-%d}"


def _anchor_day(year: int, month: int, day: int) -> date:
    return date(year, month, min(day, calendar.monthrange(year, month)[1]))


def _month_step(year: int, month: int, step: int) -> tuple[int, int]:
    index = year * 12 + month - 1 + step
    return index // 12, index % 12 + 1


DAILY = Cycle(CycleKind.DAYS)
MONTHLY = Cycle(CycleKind.MONTHLY)


@dataclass(frozen=True)
class CycleSchedule:
    """A tenant's cycle, and the one it changes to at `switch_ms` (Redis clock), if any.

    The rule of a change: the window current when it was asked for finishes on the old cycle
    (`switch_ms` is its end, quotas/cycles.py); the first window on the new cycle starts at
    `switch_ms` and ends at the new cycle's next boundary (a short window when the two disagree,
    with the full limit: nothing is prorated). The same for the day windows when the time zone
    changes. Hashable: the engine keeps one Calendar per schedule.
    """

    current: Cycle = MONTHLY
    next: Cycle | None = None
    # When `next` takes over; without `next`, where `current` ends (a past cycle's span, as
    # quotas/cycles.py rebuilds it for a report).
    switch_ms: int | None = None
    # When `current` took over, if that was a change whose first windows may still run (a
    # change asked during the first window of the previous one): windows that began before it
    # start at it, with the same "@" ids as when it was the `next`.
    since_ms: int | None = None

    def cycle_at(self, now_ms: int) -> tuple[Cycle, int | None]:
        """The cycle in force at `now_ms`, and the instant it took over when windows that
        began earlier must be cut there (the switch, or `since_ms`)."""
        if self.next is not None and self.switch_ms is not None and now_ms >= self.switch_ms:
            return self.next, self.switch_ms
        return self.current, self.since_ms


UTC_MONTHLY = CycleSchedule()


class Calendar:
    """Maps an instant on the Redis clock to its windows under one tenant's schedule.

    The day is the local day in the cycle's time zone (23 or 25 hours over a daylight-saving
    change); the 'month' window is the cycle's (`Cycle`); minute and pace windows are the same
    instants everywhere. Window ids name local dates.
    """

    def __init__(self, schedule: CycleSchedule = UTC_MONTHLY) -> None:
        self.schedule = schedule
        self._cache: dict[WindowKind, Window] = {}

    def window(self, kind: WindowKind, now_ms: int) -> Window:
        cached = self._cache.get(kind)
        if cached is not None and cached.contains(now_ms):
            return cached
        window = self._compute(kind, now_ms)
        self._cache[kind] = window
        return window

    def _compute(self, kind: WindowKind, now_ms: int) -> Window:
        pace = kind.pace_seconds
        if pace is not None:
            return _pace_window(kind, pace * 1000, now_ms)
        if kind is WindowKind.MINUTE:
            start = now_ms - now_ms % 60_000
            moment = datetime.fromtimestamp(start // 1000, UTC)
            return Window(kind, f"n{moment:%Y-%m-%dT%H:%M}", start, start + 60_000)
        cycle, switched_at = self.schedule.cycle_at(now_ms)
        ends_at = self.schedule.switch_ms
        if ends_at is not None and now_ms >= ends_at:
            ends_at = None  # in force after the switch: the new cycle's windows run on
        zone = ZoneInfo(cycle.zone)
        today = datetime.fromtimestamp(now_ms / 1000, zone).date()
        if kind is WindowKind.DAY:
            first, after = today, today + timedelta(days=1)
            window_id = f"d{first:%Y-%m-%d}"
        else:
            first, after = cycle.bounds(today)
            window_id = cycle.window_id(first)
        start_ms, end_ms = _midnight_ms(first, zone), _midnight_ms(after, zone)
        if switched_at is not None and start_ms < switched_at:
            # The first window after a change starts at the change; its own id, so that it never
            # shares a counter with the old cycle's last window.
            start_ms = switched_at
            window_id = f"{window_id}@{switched_at // 1000}"
        if ends_at is not None:
            end_ms = min(end_ms, ends_at)
        return Window(kind=kind, id=window_id, start_ms=start_ms, end_ms=end_ms)


_CALENDARS: dict[CycleSchedule, Calendar] = {}
_CALENDARS_MAX = 4096  # schedules of tenants long gone: start afresh beyond this


def calendar_of(schedule: CycleSchedule) -> Calendar:
    """The Calendar of a schedule, one per schedule in the process (the engine and every reader
    share its window cache)."""
    found = _CALENDARS.get(schedule)
    if found is None:
        if len(_CALENDARS) > _CALENDARS_MAX:
            _CALENDARS.clear()
        found = _CALENDARS[schedule] = Calendar(schedule)
    return found


def _midnight_ms(day: date, zone: ZoneInfo) -> int:
    # fold=0: where a daylight-saving jump skips midnight, the instant the day really starts.
    return int(datetime.combine(day, time(0), tzinfo=zone).timestamp()) * 1000


class RedisClock:
    """This process's estimate of the Redis server clock: local clock plus a learned offset."""

    def __init__(self, local_clock: Callable[[], float] = _time.time) -> None:
        self._local = local_clock
        self.offset_ms = 0

    def now_ms(self) -> int:
        return int(self._local() * 1000) + self.offset_ms

    def observe(self, server_ms: int) -> None:
        """Learn from a server time seen in a script reply (round-trip error is a few ms)."""
        self.offset_ms = server_ms - int(self._local() * 1000)
