"""Quota windows (day, month, minute) and the gateway's estimate of the Redis server's clock.

Windows are computed in Python from an estimate of Redis time and passed to the scripts as
[start, end) in milliseconds; the scripts read `TIME` and refuse a window that does not contain
it. The estimate is corrected from the server time that every refusal carries, so it costs no
extra round trip, and a host whose own clock is minutes off still charges the right window.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum


class WindowKind(StrEnum):
    DAY = "day"
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


class Calendar:
    """Maps an instant on the Redis clock to its windows.

    `utc_offset_s` moves the day and month boundaries to a tenant's local midnight (UTC+8 is
    28800); the default is UTC. Window ids name the local date.
    """

    def __init__(self, utc_offset_s: int = 0) -> None:
        self.utc_offset_s = utc_offset_s
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
            # Shorter than any time-zone offset's granularity: the same instants everywhere.
            return _pace_window(kind, pace * 1000, now_ms)
        offset = timedelta(seconds=self.utc_offset_s)
        local = datetime.fromtimestamp(now_ms // 1000, UTC) + offset
        if kind is WindowKind.DAY:
            start = local.replace(hour=0, minute=0, second=0, microsecond=0)
            end = start + timedelta(days=1)
            window_id = f"d{start:%Y-%m-%d}"
        elif kind is WindowKind.MONTH:
            start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            end = (start + timedelta(days=32)).replace(day=1)
            window_id = f"m{start:%Y-%m}"
        else:
            start = local.replace(second=0, microsecond=0)
            end = start + timedelta(minutes=1)
            window_id = f"n{start:%Y-%m-%dT%H:%M}"
        return Window(
            kind=kind,
            id=window_id,
            start_ms=_ms(start - offset),
            end_ms=_ms(end - offset),
        )


def _ms(moment: datetime) -> int:
    return int(moment.timestamp()) * 1000


class RedisClock:
    """This process's estimate of the Redis server clock: local clock plus a learned offset."""

    def __init__(self, local_clock: Callable[[], float] = time.time) -> None:
        self._local = local_clock
        self.offset_ms = 0

    def now_ms(self) -> int:
        return int(self._local() * 1000) + self.offset_ms

    def observe(self, server_ms: int) -> None:
        """Learn from a server time seen in a script reply (round-trip error is a few ms)."""
        self.offset_ms = server_ms - int(self._local() * 1000)
