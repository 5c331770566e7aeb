"""The console dashboard: the tenant's live gauges (with their forecasts), open holds and refused
calls, its windows' usage and forecast charts, the 30-day chart of tokens per model, recent alerts
and webhook deliveries. The figures come from
billing.dashboard; this page draws the chart (config/console/charts.py) and renders."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

from billing import dashboard as dashboard_data
from config.console.charts import forecast_charts, stacked_by_model
from config.console.frame import render_page, tenant_page
from tenants.models import Tenant


@require_safe
@tenant_page()
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    board = dashboard_data.build(tenant)
    chart = stacked_by_model(board.daily_usage, board.chart_first_day, board.today)
    forecasts = forecast_charts(board.live.forecasts) if board.live is not None else []
    return render_page(request, tenant, "console/dashboard.html", {
        "board": board, "live": board.live, "chart": chart, "forecast_charts": forecasts,
        "forecast_trailing_hours": settings.TOLLGATE_FORECAST_TRAILING_HOURS,
        "forecast_shape_days": settings.TOLLGATE_FORECAST_SHAPE_MIN_DAYS,
        "alert_rows": dashboard_data.alert_rows(board),
    }, nav="console-dashboard")
