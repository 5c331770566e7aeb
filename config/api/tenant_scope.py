"""What every management API view shares: the caller as a Principal and tenant-scoped lookups.

Views below a tenant take `tenant_id` (the tenant's public id) from the URL and call
`self.tenant()` (read) or `self.tenant(manage=True)` (change) before anything else; every object
lookup then goes through that tenant, so another tenant's object is a 404.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import PermissionDenied
from rest_framework.views import APIView

from tenants.access import NotAllowed, Principal, principal_for, visible_tenant
from tenants.models import Tenant

TENANT_ID = OpenApiParameter("tenant_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                             description="The tenant's id (ten_...).")


class ManagementAPIView(APIView):
    @property
    def principal(self) -> Principal:
        return principal_for(self.request)

    @property
    def actor(self) -> str:
        return self.principal.actor


class TenantScopedAPIView(ManagementAPIView):
    """A view below /api/tenants/<tenant_id>/."""

    def tenant(self, *, manage: bool = False) -> Tenant:
        cached: dict[bool, Tenant] = self.__dict__.setdefault("_tenants", {})
        if manage not in cached:
            try:
                cached[manage] = visible_tenant(
                    self.principal, self.kwargs["tenant_id"], manage=manage
                )
            except NotAllowed as exc:
                raise PermissionDenied(str(exc)) from None
        return cached[manage]


def get_in_tenant(queryset: QuerySet[Any], what: str, **lookup: Any) -> Model:
    """One object of a queryset already filtered to the caller's tenant, or a 404 that says
    nothing about whether it exists elsewhere."""
    obj = queryset.filter(**lookup).first()
    if obj is None:
        raise Http404(f"No such {what}.")
    return obj
