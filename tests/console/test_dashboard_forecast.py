"""The forecast on the console dashboard: a dashed mark on each limited gauge (where the window
will end) with its words, and a chart per limited tenant window: the usage so far (solid), the
forecast to the window's end (dashed), the limit; the chart's geometry on a known forecast."""
from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from django.test import Client
from django.urls import reverse

from billing.forecast import (
    ForecastSettings,
    History,
    ScopeForecast,
    forecast,
    scope_forecasts,
)
from billing.models import ForecastAlert, UsageRecord
from config.console.charts import forecast_chart
from quotas.engine import ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from quotas.windows import Calendar, WindowKind
from tenants.selectors import effective_limits
from tenants.services import set_tenant_limits
from tests.world import World
from tests.billing.rollup_events import create_usage


def _burn(world: World, per_hour: int) -> None:
    """The last five hours at `per_hour` tokens an hour, in the ledger (ten rows an hour: the
    hour the trailing three start in is as busy as the others, since the model spreads an
    hour's tokens evenly over it)."""
    now = datetime.now(UTC)
    for i in range(50):
        when = now - timedelta(minutes=6 * i + 3)
        create_usage(
            request_id=f"burn-{i}", tenant=world.acme, project=world.web,
            api_key=world.issued.api_key, model="gpt-4o", served_model="gpt-4o",
            input_tokens=per_hour // 10, output_tokens=0, cost_micros=0,
            status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)


def _spend(world: World, tokens: int) -> None:
    limits = request_limits(world.acme, effective_limits(world.acme), world.web,
                            world.issued.api_key, "gpt-4o")
    reservation = get_engine().reserve(ReserveRequest(
        tenant=tenant_tag(world.acme.pk), request_id="fc-dash", amount=tokens, limits=limits))
    get_engine().settle(reservation.hold, tokens)


def test_the_dashboard_draws_the_forecast_dashed_on_the_gauge_and_the_chart(
        world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=100_000)
    world.acme.refresh_from_db()
    _spend(world, 3_000)
    _burn(world, 1_000)
    client = Client()
    client.force_login(world.member)
    html = client.get(reverse("console-dashboard", args=[world.acme.public_id])).content.decode()
    [expected] = [f.forecast for f in scope_forecasts(world.acme)
                  if f.kind == "tenant" and f.window_kind is WindowKind.DAY]
    # 1,000 an hour, within a row (100 tokens) of the three hours' sum.
    assert expected.so_far == 3_000 and abs(expected.inputs["rate_per_hour"] - 1_000) <= 34

    tenant_card = html[html.index('data-scope="tenant"'):html.index('data-scope="project"')]
    day = tenant_card[tenant_card.index('data-window="day"'):tenant_card.index(
        'data-window="month"')]
    mark = re.search(r'class="forecast-mark" data-testid="forecast-mark" style="left: '
                     r'([0-9.]+)%"', day)
    assert mark and abs(float(mark.group(1)) - expected.percent) <= 0.2
    text = re.search(r'data-testid="forecast-text" data-method="trailing_rate">.*?Forecast '
                     r'([0-9,]+) tokens', day, re.S)
    assert text and abs(int(text.group(1).replace(",", "")) - expected.tokens) <= 5
    # The month has no limit (no monthly budget): no forecast there.
    assert "forecast-mark" not in tenant_card[tenant_card.index('data-window="month"'):]

    chart = html[html.index('data-testid="forecast-chart" data-window="day"'):]
    chart = chart[:chart.index("</figure>")]
    assert 'stroke-dasharray="7 5" stroke-linejoin="round" data-testid="forecast-line"' in chart
    assert 'data-testid="forecast-used"' in chart and 'data-testid="forecast-limit"' in chart
    assert "limit 100,000" in chart
    assert f"{expected.inputs['rate_per_hour']:,} tokens per hour" in chart  # the explanation
    assert 'data-window="month"' not in html[html.index('id="forecast-title"'):]


def test_a_forecast_warning_is_listed_with_the_alerts(world: World) -> None:
    ForecastAlert.objects.create(tenant=world.acme, scope="tenant", window="d2026-11-30",
                                 threshold=80, limit=10_000, used=6_000, forecast=10_400,
                                 method="trailing_rate")
    client = Client()
    client.force_login(world.owner)
    html = client.get(reverse("console-dashboard", args=[world.acme.public_id])).content.decode()
    alerts = html[html.index('id="alerts-title"'):]
    assert "forecast 104% of the limit" in alerts and "day 2026-11-30" in alerts


def test_forecast_chart_geometry() -> None:
    """A day at 1,000 tokens an hour from midnight: at 06:00 the used line reaches 6,000 at a
    quarter of the width, the dashed line runs on to 24,000 at the right edge and crosses the
    20,000 limit at 20:00."""
    calendar = Calendar()
    now = int(datetime(2026, 12, 1, 6, tzinfo=UTC).timestamp() * 1000)
    start = now - 6 * 3_600_000
    hours = {start + h * 3_600_000: 1_000 for h in range(6)}
    day = calendar.window(WindowKind.DAY, now)
    fc = forecast(window=day, today=day, now_ms=now, used=6_000, pending=0, limit=20_000,
                  credit=0, history=History(hours, start - 3_600_000, now), zone="UTC",
                  settings=ForecastSettings())
    assert fc.tokens == 24_000
    chart = forecast_chart(ScopeForecast("tenant", "ten_x", "Acme", "tenant", WindowKind.DAY,
                                         fc, History(hours, start, now)), "Today")
    plot_w = chart.plot_right - chart.plot_left
    plot_h = chart.plot_bottom - chart.plot_top
    last_used = chart.used_points.split()[-1].split(",")
    assert float(last_used[0]) == chart.now_x == round(chart.plot_left + plot_w / 4, 2)
    top = 50_000  # the axis' nice ceiling above 24,000
    assert float(last_used[1]) == round(chart.plot_bottom - plot_h * 6_000 / top, 2)
    first, last = chart.forecast_points.split()
    assert first == ",".join(last_used)
    assert tuple(map(float, last.split(","))) == (
        chart.plot_right, round(chart.plot_bottom - plot_h * 24_000 / top, 2))
    assert chart.reach_x == round(chart.plot_left + plot_w * 20 / 24, 2)
    assert chart.limit_y == round(chart.plot_bottom - plot_h * 20_000 / top, 2)
    assert [t.label for t in chart.x_ticks][:3] == ["00:00", "03:00", "06:00"]
    assert "forecast 24,000 tokens (120%)" in chart.description
