"""The console's reports page: pick one of the tenant's cycle windows (or type a month), download
its cost report (CSV or XLSX, served by the management API). Owners and admins only get the
links (billing.access)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_safe

from billing.access import can_read_costs
from config.console.frame import render_page, tenant_page
from quotas.cycles import Span, Timeline, recent_cycle_windows, report_span
from tenants.access import principal_for
from tenants.models import Tenant

REPORT_WINDOWS = 12


@require_safe
@tenant_page()
def reports(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    timeline = Timeline(tenant)
    windows = recent_cycle_windows(tenant, REPORT_WINDOWS, timeline=timeline)
    chosen: Span = windows[0]
    error = ""
    wanted = request.GET.get("period", request.GET.get("month", "")).strip()
    if wanted:
        try:
            chosen = report_span(tenant, wanted, timeline)
        except ValueError as exc:
            error = str(exc)
    allowed = can_read_costs(principal_for(request), tenant)
    links = {}
    if allowed:
        for fmt in ("csv", "xlsx"):
            links[fmt] = reverse("api-tenant-cost-report",
                                 kwargs={"tenant_id": tenant.public_id, "month": chosen.id,
                                         "fmt": fmt})
    return render_page(request, tenant, "console/reports.html", {
        "windows": windows, "chosen": chosen, "links": links, "allowed": allowed,
        "listed": any(w.id == chosen.id for w in windows), "error": error,
    }, nav="console-reports", status=400 if error else 200)
