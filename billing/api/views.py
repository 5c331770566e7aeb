"""Management API of the billing app: usage, live quota status and cost reports. Webhook
endpoints are in billing/api/webhooks.py."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response

from billing.access import can_read_costs
from billing.api.serializers import (
    ErrorSerializer,
    QuotaResponseSerializer,
    UsageQuerySerializer,
    UsageResponseSerializer,
)
from billing.reports import Month, Report, platform_month, tenant_month, to_csv, to_xlsx
from billing.usage import usage_totals
from quotas.engine import QuotaStoreUnavailable
from quotas.status import quota_status, refused_today, utc_day_id
from tenants.api.base import ManagementAPIView, TenantScopedAPIView, get_in_tenant
from tenants.models import ApiKey, Project, Tenant

LIVE_UNAVAILABLE = ("Live quota counters are unavailable: the quota store (Redis) cannot be "
                    "reached. Retry shortly; usage from the ledger is still at /usage.")
LEDGER_NOTE = ("From the usage ledger, which trails the live counters by a few seconds "
               "(drained every 5 s). Live remaining quota: /quota.")


class UsageView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/usage: the ledger's requests, tokens (and, for owners and
    admins, cost) per day / project / key / model over a date range (default: last 30 days)."""

    @extend_schema(
        parameters=[
            OpenApiParameter("from", OpenApiTypes.DATE, description="First UTC day (default: "
                             "29 days before `to`)."),
            OpenApiParameter("to", OpenApiTypes.DATE, description="Last UTC day, inclusive "
                             "(default: today). At most 366 days in all."),
            OpenApiParameter("group_by", OpenApiTypes.STR, description="Comma-separated: day, "
                             "project, key, model (default: day)."),
            OpenApiParameter("project", OpenApiTypes.STR, description="Only this project."),
            OpenApiParameter("key", OpenApiTypes.STR, description="Only this API key."),
        ],
        responses={200: UsageResponseSerializer, 400: OpenApiResponse(
            description="Field messages, e.g. {\"from\": [\"...\"]}")},
    )
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        project = key = None
        if params.get("project"):
            project = get_in_tenant(Project.objects.filter(tenant=tenant), "project",
                                    public_id=params["project"]).public_id
        if params.get("key"):
            key = get_in_tenant(ApiKey.objects.filter(project__tenant=tenant), "API key",
                                public_id=params["key"]).public_id
        rows = usage_totals(tenant, params["from"], params["to"], tuple(params["group_by"]),
                            project=project, key=key)
        if not can_read_costs(self.principal, tenant):
            for row in rows:
                row.pop("cost_micros", None)
        return Response({"from": params["from"].isoformat(), "to": params["to"].isoformat(),
                         "group_by": params["group_by"], "results": rows, "note": LEDGER_NOTE})


class QuotaView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/quota: live counters (today's and this month's used, held and
    remaining per scope), open holds, and today's refused requests by reason. 503 when Redis is
    unreachable."""

    @extend_schema(responses={200: QuotaResponseSerializer, 503: ErrorSerializer})
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        try:
            status = quota_status(tenant)
            refused = refused_today(tenant)
        except QuotaStoreUnavailable:
            return Response({"detail": LIVE_UNAVAILABLE}, status=503)
        return Response({
            "scopes": [s.as_dict() for s in status.scopes],
            "open_holds": status.open_holds,
            "refused_today": {
                "day": utc_day_id(), "total": sum(r.count for r in refused),
                "by_reason": [{"reason": r.reason, "label": r.label, "count": r.count}
                              for r in refused],
            },
        })


# -- cost reports -------------------------------------------------------------------------------

_CONTENT_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}
_FILE_RESPONSES: dict[Any, Any] = {
    (200, "text/csv"): OpenApiTypes.BINARY,
    (200, _CONTENT_TYPES["xlsx"]): OpenApiTypes.BINARY,
    400: OpenApiResponse(description="Not a month (YYYY-MM)."),
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
    """GET /api/tenants/<tenant_id>/reports/<YYYY-MM>.<csv|xlsx>: the tenant's month, one row per
    day, project, key and model. Owners, admins, tenant tokens and operators; a member gets 403
    (finance data, billing/access.py), anyone outside the tenant 404."""

    content_negotiation_class = FileDownloadNegotiation

    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, tenant_id: str, month: str, fmt: str) -> HttpResponse:
        tenant: Tenant = self.tenant()
        if not can_read_costs(self.principal, tenant):
            raise PermissionDenied("Cost reports are for the tenant's owners and admins.")
        return report_response(tenant_month(tenant, _month(month)),
                               f"{tenant.slug}-{month}", fmt)


class PlatformCostReportView(ManagementAPIView):
    """GET /api/reports/<YYYY-MM>.<csv|xlsx>: every tenant's month, for operators (staff users
    and operator tokens)."""

    content_negotiation_class = FileDownloadNegotiation

    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, month: str, fmt: str) -> HttpResponse:
        if not self.principal.is_operator:
            raise PermissionDenied("The platform report is for operators.")
        return report_response(platform_month(_month(month)), f"all-tenants-{month}", fmt)
