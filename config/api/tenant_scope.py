"""What every management API view shares: the caller as a Principal and tenant-scoped lookups.

Views below a tenant take `tenant_id` (the tenant's public id) from the URL and call
`self.tenant()` (read) or `self.tenant(manage=True)` (change) before anything else; every object
lookup then goes through that tenant, so another tenant's object is a 404.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django.db.models import Model, QuerySet
from django.http import Http404, QueryDict
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.api.openapi import ManagementAutoSchema
from config.api.scopes import READS_AND_FULL_WRITES
from tenants.access import NotAllowed, Principal, principal_for, visible_tenant
from tenants.models import Tenant

TENANT_ID = OpenApiParameter("tenant_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                             description="The tenant's id (ten_...).")


class UnknownFormatIgnored(DefaultContentNegotiation):
    """DRF answers `?format=<anything it has no renderer for>` with a 404 that no operation of the
    schema documents (nor should: the resource exists). An unknown format is ignored instead and
    the Accept header decides, as without one."""

    def filter_renderers(self, renderers: list[Any], format: str) -> list[Any]:
        return [renderer for renderer in renderers if renderer.format == format] or renderers


class ManagementAPIView(APIView):
    # The scope a management token needs, per HTTP method (config/api/scopes.py): reads `read`,
    # changes `full`, unless a view declares otherwise.
    token_scopes: Mapping[str, str] = READS_AND_FULL_WRITES

    # The schema documents JSON bodies only (config/api/openapi.py); form encodings stay
    # accepted, through the same serializers, for the clients that already send them.
    schema = ManagementAutoSchema()
    content_negotiation_class = UnknownFormatIgnored

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # authentication and permissions first
        check_path_and_query(kwargs, request.query_params)

    @property
    def principal(self) -> Principal:
        return principal_for(self.request)

    @property
    def actor(self) -> str:
        return self.principal.actor


def check_path_and_query(kwargs: Mapping[str, Any], query: QueryDict) -> None:
    """What no view accepts: PostgreSQL text cannot hold NUL, so an id carrying one names no
    object (404) and a filter value with one is a 400 (rather than a database error); and no
    query parameter of this API is a list, so one given twice is a 400 (rather than silently
    taking the last)."""
    if any("\x00" in str(value) for value in kwargs.values()):
        raise Http404("No such object.")
    for name in sorted(query):
        values = query.getlist(name)
        if "\x00" in name + "".join(map(str, values)):
            raise ValidationError({name: ["Must not contain NUL characters."]})
        if len(values) > 1:
            raise ValidationError({name: ["Give this parameter once."]})


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII)


def check_date_params(query: QueryDict, *names: str) -> None:
    """Date query parameters are YYYY-MM-DD exactly, as the schema's `format: date` says: an
    empty value would otherwise read as "not given" and "2026-1-5" would pass the parser."""
    for name in names:
        value = query.get(name)
        if value is not None and not _DATE.fullmatch(value):
            raise ValidationError({name: ["Give a date as YYYY-MM-DD."]})


def secret_response(data: Any, *, status: int = 200) -> Response:
    """A response that carries a secret shown once (a plaintext key or token, an invitation
    link): no cache, shared or private, may keep a copy."""
    response = Response(data, status=status)
    response["Cache-Control"] = "no-store"
    return response


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
