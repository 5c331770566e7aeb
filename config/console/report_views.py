"""The console's reports page: pick a month, download the tenant's cost report (CSV or XLSX,
served by the management API). Owners and admins only get the links (billing.access)."""

from __future__ import annotations

from datetime import UTC, datetime

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_safe

from billing.access import can_read_costs
from billing.reports import Month
from config.console.frame import render_page, tenant_page
from tenants.access import principal_for
from tenants.models import Tenant

REPORT_MONTHS = 12


def recent_months(now: datetime, count: int = REPORT_MONTHS) -> list[Month]:
    """This month and the `count - 1` before it, newest first."""
    year, month = now.year, now.month
    months = []
    for _ in range(count):
        months.append(Month(year, month))
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
    return months


@require_safe
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

