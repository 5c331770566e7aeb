"""HTTP views of the billing app: the Prometheus /metrics endpoint and cost report downloads."""
from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import IsAdminUser, IsAuthenticated
from rest_framework.request import Request
from rest_framework.views import APIView

from billing import metrics
from billing.reports import Month, Report, platform_month, tenant_month, to_csv, to_xlsx
from tenants.models import Membership, Tenant


def _authorized(request: HttpRequest) -> bool:
    token = getattr(settings, "TOLLGATE_METRICS_TOKEN", "") or ""
    if not token:
        return False  # unset: /metrics is closed
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format; needs `Authorization: Bearer <TOLLGATE_METRICS_TOKEN>`."""
    if not _authorized(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(metrics.render(), content_type=metrics.CONTENT_TYPE)


# -- cost reports (management API) ---------------------------------------------------------------

_CONTENT_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}


class TenantCostReportView(APIView):
    """GET /api/tenants/<slug>/reports/<YYYY-MM>.<csv|xlsx>: a tenant's month, for platform
    staff and the tenant's owners and admins. Another tenant's report is a 404, never a 403."""

    permission_classes = [IsAuthenticated]

    def get(self, request: Request, slug: str, month: str, fmt: str) -> HttpResponse:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None or not can_read_reports(request.user, tenant):
            raise NotFound("No such tenant.")
        return _report_response(tenant_month(tenant, _month(month)), f"{slug}-{month}", fmt)


class PlatformCostReportView(APIView):
    """GET /api/reports/<YYYY-MM>.<csv|xlsx>: every tenant's month, for platform staff."""

    permission_classes = [IsAdminUser]

    def get(self, request: Request, month: str, fmt: str) -> HttpResponse:
        return _report_response(platform_month(_month(month)), f"all-tenants-{month}", fmt)


def can_read_reports(user: Any, tenant: Tenant) -> bool:
    if user.is_staff:
        return True
    return Membership.objects.filter(
        user=user, tenant=tenant,
        role__in=[Membership.Role.OWNER, Membership.Role.ADMIN]).exists()


def _month(text: str) -> Month:
    try:
        return Month.parse(text)
    except ValueError as exc:
        raise ValidationError({"month": [str(exc)]}) from exc


def _report_response(report: Report, name: str, fmt: str) -> HttpResponse:
    data = to_xlsx(report) if fmt == "xlsx" else to_csv(report)
    response = HttpResponse(data, content_type=_CONTENT_TYPES[fmt])
    response["Content-Disposition"] = f'attachment; filename="{name}.{fmt}"'
    return response
