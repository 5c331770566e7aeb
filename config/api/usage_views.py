"""Management API: a tenant's usage from the ledger (requests, tokens and, for owners and
admins, cost, grouped by day, project, key or model) and its live quota counters. Days are the
tenant's local days (its time zone), the "month" its cycle window (quotas.cycles)."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from billing.access import can_read_costs
from billing.forecast import scope_forecasts
from billing.usage import usage_totals
from config.api.billing_serializers import (
    ErrorSerializer,
    QuotaResponseSerializer,
    UsageQuerySerializer,
    UsageResponseSerializer,
)
from config.api.key_scopes import KEY_SCOPE_PARAMETERS, key_scope_page
from config.api.tenant_scope import (
    TenantScopedAPIView,
    check_date_params,
    get_in_tenant,
)
from quotas.allotments import allotment_standing
from quotas.engine import QuotaStoreUnavailable
from quotas.cycles import current_windows
from quotas.status import quota_status, refused_today
from tenants import selectors
from tenants.models import Tenant

LIVE_UNAVAILABLE = ("Live quota counters are unavailable: the quota store (Redis) cannot be "
                    "reached. Retry shortly; usage from the ledger is still at /usage.")
LEDGER_NOTE = ("From the usage ledger, which trails the live counters by a few seconds "
               "(drained every 5 s). Live remaining quota: /quota.")


class UsageView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/usage: the ledger's requests, tokens (and, for owners and
    admins, cost) per day / project / key / model over a date range (default: last 30 days)."""

    @extend_schema(
        parameters=[
            OpenApiParameter("from", OpenApiTypes.DATE, description="First day, the tenant's "
                             "local day (default: 29 days before `to`)."),
            OpenApiParameter("to", OpenApiTypes.DATE, description="Last day, inclusive "
                             "(default: today in the tenant's time zone). At most 366 days in "
                             "all."),
            OpenApiParameter("group_by", OpenApiTypes.STR, description="Comma-separated: day, "
                             "project, key, model (default: day)."),
            OpenApiParameter("project", {"type": "string", "maxLength": 64},
                             description="Only this project."),
            OpenApiParameter("key", {"type": "string", "maxLength": 64},
                             description="Only this API key."),
        ],
        responses={200: UsageResponseSerializer, 400: OpenApiResponse(
            description="Field messages, e.g. {\"from\": [\"...\"]}")},
    )
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        check_date_params(request.query_params, "from", "to")
        day, _ = current_windows(tenant)
        query = UsageQuerySerializer(data=request.query_params,
                                     context={"today": day.start.date()})
        query.is_valid(raise_exception=True)
        params = query.validated_data
        project = key = None
        if params.get("project"):
            project = get_in_tenant(selectors.tenant_projects(tenant), "project",
                                    public_id=params["project"]).public_id
        if params.get("key"):
            key = get_in_tenant(selectors.tenant_keys(tenant), "API key",
                                public_id=params["key"]).public_id
        rows = usage_totals(tenant, params["from"], params["to"], tuple(params["group_by"]),
                            project=project, key=key)
        if not can_read_costs(self.principal, tenant):
            for row in rows:
                row.pop("cost_micros", None)
        return Response({"from": params["from"].isoformat(), "to": params["to"].isoformat(),
                         "group_by": params["group_by"], "results": rows, "note": LEDGER_NOTE})


class QuotaView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/quota: live counters (today's and this cycle's used, held and
    remaining per scope, and each limited tenant, project and key window's forecast), open
    holds, today's refused requests by reason, and the allotments: per window the shared pool
    and each allotment's used, borrowed and left. 503 when Redis is unreachable."""

    @extend_schema(parameters=KEY_SCOPE_PARAMETERS,
                   responses={200: QuotaResponseSerializer, 503: ErrorSerializer})
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        keys, key_page = key_scope_page(request, tenant)
        try:
            status = quota_status(tenant, keys=keys)
            refused = refused_today(tenant)
            allotments = allotment_standing(tenant)
            day, _ = current_windows(tenant)
            forecasts = {(f.kind, f.ref, f.window_kind.value): f.forecast.as_dict()
                         for f in scope_forecasts(tenant, keys=keys)}
        except QuotaStoreUnavailable:
            return Response({"detail": LIVE_UNAVAILABLE}, status=503)
        return Response({
            "scopes": [{**s.as_dict(), "forecast": forecasts.get((s.kind, s.ref, s.window))}
                       for s in status.scopes],
            "keys": key_page,
            "open_holds": status.open_holds,
            # Per window: the shared pool, and each allotment with what was used of it and
            # borrowed beyond it (what the console's limits page shows).
            "allotments": allotments.as_dict(),
            "refused_today": {
                "day": day.id, "total": sum(r.count for r in refused),
                "by_reason": [{"reason": r.reason, "label": r.label, "count": r.count}
                              for r in refused],
            },
        })
