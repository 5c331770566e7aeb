"""Management API: a tenant's audit trail, newest first, filtered by day range, action and
actor, a page at a time by cursor (config/api/pagination.py AuditCursorPagination)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from config.api.pagination import AuditCursorPagination
from config.api.tenancy_serializers import AuditEventSerializer, AuditFilterSerializer
from config.api.tenant_scope import TENANT_ID, TenantScopedAPIView, check_date_params
from tenants import selectors


@extend_schema(parameters=[TENANT_ID])
class AuditEventListView(TenantScopedAPIView, GenericAPIView):
    """GET: who did what to the tenant, newest first, filtered by day range, action and actor."""

    serializer_class = AuditEventSerializer
    pagination_class = AuditCursorPagination

    def get_queryset(self) -> Any:
        check_date_params(self.request.query_params, "from", "to")
        filters = AuditFilterSerializer(data=self.request.query_params)
        filters.is_valid(raise_exception=True)
        data = filters.validated_data
        return selectors.audit_events(
            self.tenant(), start=data.get("from"), end=data.get("to"),
            action=data.get("action", ""), actor=data.get("actor", ""),
        )

    @extend_schema(parameters=[
        OpenApiParameter("from", OpenApiTypes.DATE, description="First day (UTC), inclusive."),
        OpenApiParameter("to", OpenApiTypes.DATE, description="Last day (UTC), inclusive."),
        OpenApiParameter("action", {"type": "string", "maxLength": 64},
                         description="key.issued, or a family such as key."),
        OpenApiParameter("actor", {"type": "string", "maxLength": 200},
                         description="Substring, e.g. user:alice."),
    ], responses=AuditEventSerializer(many=True))
    def get(self, request: Request, tenant_id: str) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(AuditEventSerializer(page, many=True).data)
