"""Management API: tenants. Projects, keys, limits and the rest live in sibling modules."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from config.api.service_errors import service_error
from config.api.tenant_scope import ManagementAPIView, TenantScopedAPIView
from config.api.tenancy_serializers import (
    TenantCreateSerializer,
    TenantSerializer,
    TenantUpdateSerializer,
)
from tenants import services
from tenants.exceptions import SlugTaken
from tenants.models import Tenant


class TenantListView(ManagementAPIView, ListAPIView):
    """GET /api/tenants/: the tenants the caller sees (all of them for an operator).
    POST: an operator creates a tenant."""

    serializer_class = TenantSerializer

    def get_queryset(self) -> Any:
        return self.principal.visible_tenants().order_by("slug")

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "principal": self.principal}

    def get_serializer(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("many") and args:  # a page of tenants: the caller's roles in one query
            page = list(args[0])
            kwargs["context"] = {**self.get_serializer_context(),
                                 "roles": self.principal.roles_in(page)}
            args = (page, *args[1:])
        return super().get_serializer(*args, **kwargs)

    @extend_schema(request=TenantCreateSerializer, responses={201: TenantSerializer})
    def post(self, request: Request) -> Response:
        if not self.principal.is_operator:
            raise PermissionDenied("Only operators may create tenants.")
        body = TenantCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        try:
            tenant = services.create_tenant(
                data["slug"], plan_name=data["plan"].name, actor=self.actor, name=data["name"]
            )
        except SlugTaken:
            raise ValidationError({"slug": ["A tenant with this slug already exists."]}) from None
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(TenantSerializer(tenant, context=self.get_serializer_context()).data,
                        status=status.HTTP_201_CREATED)


class TenantDetailView(TenantScopedAPIView):
    """GET /api/tenants/<tenant_id>/. PATCH: the name (tenant admins); plan and status
    (operators)."""

    @extend_schema(responses=TenantSerializer)
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant()
        return Response(TenantSerializer(tenant, context={"principal": self.principal}).data)

    @extend_schema(request=TenantUpdateSerializer, responses=TenantSerializer)
    def patch(self, request: Request, tenant_id: str) -> Response:
        tenant: Tenant = self.tenant(manage=True)
        body = TenantUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        if ("plan" in data or "status" in data) and not self.principal.is_operator:
            raise PermissionDenied("Only operators may change a tenant's plan or status.")
        try:
            if "name" in data:
                services.rename_tenant(tenant, data["name"], actor=self.actor)
            if "plan" in data:
                services.change_plan(tenant, data["plan"].name, actor=self.actor)
            if "status" in data:
                services.set_tenant_status(tenant, data["status"], actor=self.actor)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(TenantSerializer(tenant, context={"principal": self.principal}).data)
