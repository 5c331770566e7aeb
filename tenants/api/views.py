"""Management API: tenants. Projects, keys, limits and the rest live in sibling modules."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from tenants.api.base import ManagementAPIView, TenantScopedAPIView
from tenants.api.serializers import TenantSerializer
from tenants.models import Tenant


class TenantListView(ManagementAPIView, ListAPIView):
    """GET /api/tenants/: the tenants the caller sees (all of them for an operator)."""

    serializer_class = TenantSerializer

    def get_queryset(self) -> Any:
        return self.principal.visible_tenants().order_by("slug")

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "principal": self.principal}


class TenantDetailView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/."""

    @extend_schema(responses=TenantSerializer)
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        return Response(TenantSerializer(tenant, context={"principal": self.principal}).data)
