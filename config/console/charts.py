"""A server-rendered SVG chart: tokens per day, stacked by model (the dashboard's 30-day picture).

Only geometry is computed here; templates/console/dashboard_chart.html draws it. No JavaScript:
every bar segment carries a <title>, which browsers show as a tooltip and screen readers read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

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
