"""Server-rendered SVG charts: tokens per day, stacked by model (the dashboard's 30-day picture),
and a window's usage so far with its forecast (a dashed line to the window's end).

Only geometry is computed here; templates/console/dashboard_chart.html draws it. No JavaScript:
every bar segment carries a <title>, which browsers show as a tooltip and screen readers read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from billing.forecast import Forecast, ScopeForecast

# Colour-blind-safe categorical palette (Okabe-Ito, black dropped for the "other" grey).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")
OTHER_COLOUR = "#8a8f98"
OTHER = "other models"

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 44


@dataclass(frozen=True)
class Segment:
    x: float
    y: float
    width: float
    height: float
    colour: str
    title: str


@dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True)
class LegendItem:
    name: str
    colour: str
    tokens: int


@dataclass(frozen=True)
class StackedChart:
    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_top: int
    plot_bottom: int
    segments: list[Segment]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    legend: list[LegendItem]
    total: int
    first_day: date
    last_day: date

    @property
    def center_x(self) -> float:
        return (self.plot_left + self.plot_right) / 2

    @property
    def center_y(self) -> float:
        return (self.plot_top + self.plot_bottom) / 2

    @property
    def empty(self) -> bool:
        return self.total == 0

    @property
    def description(self) -> str:
        """The chart in words, for aria-label."""
        if self.empty:
            return (f"Tokens per day by model from {self.first_day} to {self.last_day}: "
                    "no usage recorded.")
        parts = ", ".join(f"{item.name} {item.tokens:,}" for item in self.legend)
        return (f"Tokens per day by model from {self.first_day} to {self.last_day}: "
                f"{self.total:,} tokens in all ({parts}).")


def nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is >= value (axis maximum)."""
    if value <= 0:
        return 1
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def short(n: int) -> str:
    """1234567 -> 1.2M: axis labels that fit."""
    for size, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if n >= size:
            text = f"{n / size:.1f}".rstrip("0").rstrip(".")
            return f"{text}{suffix}"
    return str(n)


def stacked_by_model(rows: list[dict[str, Any]], first_day: date, last_day: date,
                     *, max_models: int = len(PALETTE)) -> StackedChart:
    """Chart rows of billing.usage.usage_totals(..., ("day", "model")) for days
    first_day..last_day. The biggest models get a colour each; the rest stack as "other"."""
    days = [first_day + timedelta(days=i) for i in range((last_day - first_day).days + 1)]
    by_model: dict[str, int] = {}
    for row in rows:
        by_model[row["model"]] = by_model.get(row["model"], 0) + row["total_tokens"]
    ranked = sorted(by_model, key=lambda m: (-by_model[m], m))
    shown = ranked if len(ranked) <= max_models else ranked[:max_models - 1]
    colours = {model: PALETTE[i] for i, model in enumerate(shown)}
    series = [*shown, OTHER] if len(shown) < len(ranked) else list(shown)
    colours.setdefault(OTHER, OTHER_COLOUR)

    cells: dict[tuple[str, str], int] = {}
    for row in rows:
        name = row["model"] if row["model"] in colours else OTHER
        cell = (row["day"], name)
        cells[cell] = cells.get(cell, 0) + row["total_tokens"]
    day_totals = {d.isoformat(): sum(cells.get((d.isoformat(), s), 0) for s in series)
                  for d in days}
    top = nice_ceiling(max(day_totals.values(), default=0))

    plot_right, plot_bottom = WIDTH - RIGHT, HEIGHT - BOTTOM
    plot_w, plot_h = plot_right - LEFT, plot_bottom - TOP
    slot = plot_w / max(len(days), 1)
    bar_w = slot * 0.72
    segments: list[Segment] = []
    for i, day in enumerate(days):
        key = day.isoformat()
        x = LEFT + i * slot + (slot - bar_w) / 2
        base = float(plot_bottom)
        for name in series:
            tokens = cells.get((key, name), 0)
            if not tokens:
                continue
            h = plot_h * tokens / top
            base -= h
            segments.append(Segment(round(x, 2), round(base, 2), round(bar_w, 2),
                                    round(max(h, 0.5), 2), colours[name],
                                    f"{key} · {name}: {tokens:,} tokens"
                                    f" (day total {day_totals[key]:,})"))
    y_ticks = [Tick(round(plot_bottom - plot_h * f, 2), short(int(top * f)))
               for f in (0, 0.25, 0.5, 0.75, 1)] if top > 1 else [Tick(plot_bottom, "0")]
    step = 5 if len(days) > 10 else 1
    x_ticks = [Tick(round(LEFT + i * slot + slot / 2, 2), day.strftime("%b %d"))
               for i, day in enumerate(days) if (len(days) - 1 - i) % step == 0]
    legend = [LegendItem(name, colours[name],
                         sum(v for (_, n), v in cells.items() if n == name)) for name in series]
    return StackedChart(WIDTH, HEIGHT, LEFT, plot_right, TOP, plot_bottom, segments, y_ticks,
                        x_ticks, legend, sum(day_totals.values()), first_day, last_day)


# -- a window's usage and its forecast (the dashboard's forecast charts) -------------------------

FORECAST_WIDTH, FORECAST_HEIGHT = 720, 240
# The right margin leaves room for the limit's label.
F_LEFT, F_RIGHT, F_TOP, F_BOTTOM = 64, 16, 16, 40
_MAX_USED_POINTS = 240


@dataclass(frozen=True)
class ForecastChart:
    """A window from its start to its end: the tokens used so far (a solid line, from the
    ledger's hours, ending at the live counter), the forecast from now to the window's end (a
    dashed line: billing/forecast.py's path), and the limit (a horizontal line)."""

    title: str
    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_top: int
    plot_bottom: int
    used_points: str  # SVG polyline points
    forecast_points: str
    limit_y: float
    now_x: float
    reach_x: float | None
    reach_y: float | None
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    description: str
    forecast: Forecast
    window_kind: str  # day / month

    @property
    def limit_label_y(self) -> float:
        return round(self.limit_y - 5, 2)

    @property
    def summary(self) -> str:
        return self.forecast.summary()

    @property
    def reach_text(self) -> str:
        reach = self.forecast.reach_ms
        return "" if reach is None else f"The limit would be reached around " \
            f"{self.forecast.local(reach)}"


def _axis_ticks(start_ms: int, end_ms: int, zone: str) -> list[tuple[int, str]]:
    """Local instants to label: every 3 hours in a window of a day or less, else every few
    days (at most 8 labels)."""
    tz = ZoneInfo(zone)
    start = datetime.fromtimestamp(start_ms / 1000, tz)
    if end_ms - start_ms <= 26 * 3_600_000:
        first = start.replace(minute=0, second=0, microsecond=0)
        hours = [first + timedelta(hours=h) for h in range(0, 27)]
        return [(int(h.timestamp() * 1000), h.strftime("%H:%M")) for h in hours
                if h.hour % 3 == 0 and start_ms <= h.timestamp() * 1000 <= end_ms]
    days = (end_ms - start_ms) // 86_400_000 + 1
    step = max(1, math.ceil(days / 8))
    out = []
    day = start.date()
    while True:
        moment = datetime.combine(day, datetime.min.time(), tzinfo=tz)
        at = int(moment.timestamp() * 1000)
        if at > end_ms:
            break
        if at >= start_ms:
            out.append((at, moment.strftime("%b %d")))
        day += timedelta(days=step)
    return out


def forecast_chart(item: ScopeForecast, title: str) -> ForecastChart:
    """The geometry of one window's forecast chart (templates/console/dashboard_forecast.html
    draws it)."""
    fc = item.forecast
    window = fc.window
    start, end = window.start_ms, max(window.end_ms, fc.now_ms + 1)
    top = nice_ceiling(max(fc.capacity, fc.tokens, fc.so_far, 1))
    plot_right, plot_bottom = FORECAST_WIDTH - F_RIGHT, FORECAST_HEIGHT - F_BOTTOM
    plot_w, plot_h = plot_right - F_LEFT, plot_bottom - F_TOP

    def x(ms: int) -> float:
        return round(F_LEFT + plot_w * (min(max(ms, start), end) - start) / (end - start), 2)

    def y(tokens: float) -> float:
        return round(plot_bottom - plot_h * min(max(tokens, 0), top) / top, 2)

    # Used so far: the ledger's hours of the window, ending at the live counter (which also
    # counts what is held and what the ledger has not drained yet).
    used: list[tuple[int, float]] = [(start, 0.0)]
    cumulative = 0.0
    moment = start
    while moment < fc.now_ms:
        after = min(moment - moment % 3_600_000 + 3_600_000, fc.now_ms)
        cumulative += item.history.tokens(moment, after)
        used.append((after, cumulative))
        moment = after
    if len(used) > _MAX_USED_POINTS:
        stride = math.ceil(len(used) / _MAX_USED_POINTS)
        used = used[::stride] + [used[-1]]
    used.append((fc.now_ms, float(fc.so_far)))
    used_points = " ".join(f"{x(t)},{y(v)}" for t, v in used)
    forecast_points = " ".join(f"{x(t)},{y(v)}" for t, v in fc.path)
    reach = fc.reach_ms if fc.reach_ms is not None and fc.reach_ms < window.end_ms else None
    y_ticks = [Tick(y(top * f), short(int(top * f))) for f in (0, 0.25, 0.5, 0.75, 1)]
    x_ticks = [Tick(x(at), label) for at, label in _axis_ticks(start, window.end_ms, fc.zone)]
    reach_words = ("" if reach is None else
                   f" The limit would be reached around {fc.local(reach)}.")
    description = (f"{title}: {fc.so_far:,} tokens used so far of a {fc.capacity:,}-token "
                   f"limit; forecast {fc.tokens:,} tokens ({fc.percent:g}%) by "
                   f"{fc.local(window.end_ms)} (dashed line).{reach_words}")
    return ForecastChart(
        title=title, width=FORECAST_WIDTH, height=FORECAST_HEIGHT, plot_left=F_LEFT,
        plot_right=plot_right, plot_top=F_TOP, plot_bottom=plot_bottom,
        used_points=used_points, forecast_points=forecast_points, limit_y=y(fc.capacity),
        now_x=x(fc.now_ms), reach_x=None if reach is None else x(reach),
        reach_y=None if reach is None else y(fc.capacity), y_ticks=y_ticks, x_ticks=x_ticks,
        description=description, forecast=fc, window_kind=item.window_kind.value)


def forecast_charts(forecasts: list[ScopeForecast]) -> list[ForecastChart]:
    """The tenant's day and cycle charts, day first."""
    titles = {"day": "Today", "month": "This cycle"}
    ordered = sorted(forecasts, key=lambda f: f.window_kind.value)
    return [forecast_chart(f, titles[f.window_kind.value]) for f in ordered]
