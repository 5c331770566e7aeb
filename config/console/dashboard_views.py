"""The console dashboard: the tenant's live gauges, open holds and refused calls, the 30-day chart
of tokens per model, recent alerts and webhook deliveries. The figures come from
billing.dashboard; this page draws the chart (config/console/charts.py) and renders."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

from billing import dashboard as dashboard_data
from config.console.charts import stacked_by_model
from config.console.frame import render_page, tenant_page
from tenants.models import Tenant


@require_safe
@tenant_page()
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    board = dashboard_data.build(tenant)
    chart = stacked_by_model(board.daily_usage, board.chart_first_day, board.today)
    return render_page(request, tenant, "console/dashboard.html", {
        "board": board, "live": board.live, "chart": chart,
        "alert_rows": dashboard_data.alert_rows(board),
    }, nav="console-dashboard")
