"""Management API: cost reports as CSV or XLSX downloads, a tenant's (owners, admins, tenant tokens
and operators; billing/access.py) of one of its cycle windows or a calendar month in its time
zone, and the whole platform's of a UTC calendar month (operators)."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request

from billing.access import can_read_costs
from billing.reports import Month, Report, platform_month, tenant_period, to_csv, to_xlsx
from config.api.tenant_scope import ManagementAPIView, TenantScopedAPIView
from tenants.models import Tenant

_CONTENT_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}
_FILE_RESPONSES: dict[Any, Any] = {
    (200, "text/csv"): OpenApiTypes.BINARY,
    (200, _CONTENT_TYPES["xlsx"]): OpenApiTypes.BINARY,
    400: OpenApiResponse(description="Not a month (YYYY-MM), or (a tenant's report) not one of "
                         "the tenant's cycle windows."),
    403: OpenApiResponse(description="Cost reports are for owners, admins and operators."),
    404: OpenApiResponse(description="No such tenant (or not yours)."),
}


class FileDownloadNegotiation(BaseContentNegotiation):
    """Downloads answer with their own content type whatever the Accept header says (and errors
    as JSON), instead of DRF's 406 for `Accept: text/csv`."""

    def select_parser(self, request: Request, parsers: list[Any]) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Request, renderers: list[Any],
                        format_suffix: str | None = None) -> tuple[Any, str]:
        return renderers[0], renderers[0].media_type


def _month(text: str) -> Month:
    try:
        return Month.parse(text)
    except ValueError as exc:
        raise ValidationError({"month": [str(exc)]}) from exc


def report_response(report: Report, name: str, fmt: str) -> HttpResponse:
    data = to_xlsx(report) if fmt == "xlsx" else to_csv(report)
    response = HttpResponse(data, content_type=_CONTENT_TYPES[fmt])
    response["Content-Disposition"] = f'attachment; filename="{name}.{fmt}"'
    return response


class TenantCostReportView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/reports/<period>.<csv|xlsx>: one row per day, project, key
    and model of the period: one of the tenant's cycle windows by id (m2026-12, c2026-12-15,
    c2026-12-15@1765843200: GET /api/tenants/<tenant_id>/cycle lists the recent ones), or a
    calendar month YYYY-MM in the tenant's time zone. Every row states the window's start, end
    and time zone. Owners, admins, tenant tokens and operators; a member gets 403 (finance data,
    billing/access.py), anyone outside the tenant 404."""

    content_negotiation_class = FileDownloadNegotiation

    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, tenant_id: str, month: str, fmt: str) -> HttpResponse:
        tenant: Tenant = self.tenant()
        if not can_read_costs(self.principal, tenant):
            raise PermissionDenied("Cost reports are for the tenant's owners and admins.")
        try:
            report = tenant_period(tenant, month)
        except ValueError as exc:
            raise ValidationError({"month": [str(exc)]}) from exc
        return report_response(report, f"{tenant.slug}-{month}", fmt)


class PlatformCostReportView(ManagementAPIView):
    """GET /api/reports/<YYYY-MM>.<csv|xlsx>: every tenant's month, for operators (staff users
    and operator tokens)."""

    content_negotiation_class = FileDownloadNegotiation

    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, month: str, fmt: str) -> HttpResponse:
        if not self.principal.is_operator:
            raise PermissionDenied("The platform report is for operators.")
        return report_response(platform_month(_month(month)), f"all-tenants-{month}", fmt)
