"""Console pages of the billing app: the dashboard, webhooks and cost reports.

Every page resolves its tenant through tenants.console.base.tenant_page (outsiders get 404);
pages that change something use manage=True (members get 403). Logic lives in billing/dashboard.py,
billing/reports.py and billing/webhooks.py; these views only read forms and render.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse

from billing import dashboard as dashboard_data
from billing.access import can_read_costs
from billing.reports import Month
from tenants.access import principal_for
from tenants.console.base import render_page, tenant_page
from tenants.models import Tenant

REPORT_MONTHS = 12


@tenant_page()
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    board = dashboard_data.build(tenant)
    return render_page(request, tenant, "console/dashboard.html", {
        "board": board, "live": board.live, "chart": board.chart,
        "alert_rows": dashboard_data.alert_rows(board),
    }, nav="console-dashboard")


def recent_months(now: datetime, count: int = REPORT_MONTHS) -> list[Month]:
    """This month and the `count - 1` before it, newest first."""
    year, month = now.year, now.month
    months = []
    for _ in range(count):
        months.append(Month(year, month))
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
    return months


@tenant_page()
def reports(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    months = recent_months(datetime.now(UTC))
    chosen = months[0]
    error = ""
    wanted = request.GET.get("month", "").strip()
    if wanted:
        try:
            chosen = Month.parse(wanted)
        except ValueError as exc:
            error = str(exc)
    allowed = can_read_costs(principal_for(request), tenant)
    links = {}
    if allowed:
        for fmt in ("csv", "xlsx"):
            links[fmt] = reverse("api-tenant-cost-report",
                                 kwargs={"tenant_id": tenant.public_id, "month": str(chosen),
                                         "fmt": fmt})
    return render_page(request, tenant, "console/reports.html", {
        "months": [str(m) for m in months], "chosen": str(chosen), "links": links,
        "allowed": allowed, "error": error,
    }, nav="console-reports", status=400 if error else 200)


urlpatterns: list[URLPattern] = [
    path("t/<str:tenant_id>/", dashboard, name="console-dashboard"),
    path("t/<str:tenant_id>/reports/", reports, name="console-reports"),
]
