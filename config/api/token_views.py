"""Management API: a tenant's management tokens (masked), issuing one (plaintext once) and
revoking one."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from config.api.service_errors import service_error
from config.api.tenancy_serializers import (
    IssuedManagementTokenSerializer,
    ManagementTokenIssueSerializer,
    ManagementTokenSerializer,
)
from config.api.tenant_scope import (
    TENANT_ID,
    TenantScopedAPIView,
    get_in_tenant,
    secret_response,
)
from tenants import selectors, services
from tenants.services.management_tokens import DEFAULT_EXPIRY

TOKEN_ID = OpenApiParameter("token_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                            description="The token's id (tok_...).")


@extend_schema(parameters=[TENANT_ID])
class ManagementTokenListView(TenantScopedAPIView, GenericAPIView):
    """GET: the tenant's management tokens, masked. POST: issue one (plaintext once); it acts as
    an admin of this tenant within its scope, until it expires."""

    serializer_class = ManagementTokenSerializer

    def get_queryset(self) -> Any:
        return selectors.management_tokens(self.tenant())

    @extend_schema(responses=ManagementTokenSerializer(many=True))
    def get(self, request: Request, tenant_id: str) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(ManagementTokenSerializer(page, many=True).data)

    @extend_schema(request=ManagementTokenIssueSerializer,
                   responses={201: IssuedManagementTokenSerializer})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = ManagementTokenIssueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        data.setdefault("expires_at", DEFAULT_EXPIRY)
        # A token issued by a token carries the same user's rights, no wider scope and no later
        # expiry; one issued in a console session carries that user's.
        principal = self.principal
        origin = ({"parent": principal.token} if principal.token is not None
                  else {"issued_by": principal.user})
        try:
            issued = services.issue_management_token(tenant, actor=self.actor, **origin, **data)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        data = IssuedManagementTokenSerializer(
            issued.token, context={"plaintext": issued.plaintext}).data
        return secret_response(data, status=status.HTTP_201_CREATED)


@extend_schema(parameters=[TENANT_ID, TOKEN_ID])
class ManagementTokenRevokeView(TenantScopedAPIView):
    """POST: revoke a management token of this tenant (idempotent)."""

    @extend_schema(request=None, responses=ManagementTokenSerializer)
    def post(self, request: Request, tenant_id: str, token_id: str) -> Response:
        tokens = selectors.management_tokens(self.tenant(manage=True))
        token = get_in_tenant(tokens, "token", public_id=token_id)
        services.revoke_management_token(token, actor=self.actor)
        return Response(ManagementTokenSerializer(token).data)
