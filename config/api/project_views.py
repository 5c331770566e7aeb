"""Management API: a tenant's projects and API keys.

Sub-limits are checked by the services against the tenant's effective limits (and a key's
against its project's too); the plaintext of a key is in the issue and rotate responses only.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from billing.usage import usage_today_and_month
from config.api.scopes import FULL, KEYS, READS_AND_FULL_WRITES, require_scope_for
from config.api.service_errors import service_error
from config.api.tenancy_serializers import (
    ApiKeySerializer,
    IssuedApiKeySerializer,
    KeyIssueSerializer,
    KeyRotateSerializer,
    KeyUpdateSerializer,
    ProjectCreateSerializer,
    ProjectSerializer,
    ProjectUpdateSerializer,
)
from config.api.tenant_scope import (
    TENANT_ID,
    TenantScopedAPIView,
    get_in_tenant,
    secret_response,
)
from tenants import selectors, services
from tenants.allotments import ALLOTMENT_FIELDS
from tenants.exceptions import KeyExpired, KeyRevoked, SlugTaken
from tenants.models import ApiKey, ManagementToken, Project, Tenant

PROJECT_ID = OpenApiParameter("project_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                              description="The project's id (prj_...).")
KEY_ID = OpenApiParameter("key_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                          description="The key's id (key_...).")


# Projects and keys are what a `keys` token may change (issue, rotate, revoke, sub-limits),
# except their allotments (_allotments_in_scope).
KEYS_WRITES = {**READS_AND_FULL_WRITES, "POST": KEYS, "PATCH": KEYS}


def _allotments_in_scope(
    request: Request, data: dict[str, Any], current: Project | ApiKey | None
) -> dict[str, Any]:
    """`data` (a create or update body) if the caller may change what it asks of the allotment
    fields. An allotment carves the tenant's shared pool, which every project and key draws on:
    more than managing keys, so only full-scope tokens (and console owners and admins) change
    one; a `keys` token gets a 403 when the body would set or change one (`current`: the row as
    stored, None for a new one). An allotment it sends back unchanged (a PATCH of a document it
    read) is dropped from the body, so the service never writes an allotment for it, even one
    another admin changed in the meantime."""
    token = request.auth
    if not isinstance(token, ManagementToken) or token.allows(FULL):
        return data
    changed = [name for name in ALLOTMENT_FIELDS if name in data
               and data[name] != (getattr(current, name) if current is not None else None)]
    if changed:
        require_scope_for(
            request, FULL, f"changing {' and '.join(changed)}",
            "an allotment carves the tenant's shared pool for every project and key.")
    return {name: value for name, value in data.items() if name not in ALLOTMENT_FIELDS}


def _project_context(tenant: Tenant, only: list[Project] | None = None) -> dict[str, Any]:
    # `only`: a page's projects, whose usage alone is summed.
    return {"usage": usage_today_and_month(tenant, "project", only=only)}


def _key_context(tenant: Tenant, only: list[ApiKey] | None = None) -> dict[str, Any]:
    # `only`: a page's keys (or the one key), whose usage alone is summed.
    return {"usage": usage_today_and_month(tenant, "key", only=only), "now": timezone.now()}


@extend_schema(parameters=[TENANT_ID])
class ProjectListView(TenantScopedAPIView, GenericAPIView):
    """GET: the tenant's projects with today's and this month's usage. POST: create one."""

    token_scopes = KEYS_WRITES
    serializer_class = ProjectSerializer

    def get_queryset(self) -> Any:
        return selectors.tenant_projects(self.tenant())

    @extend_schema(responses=ProjectSerializer(many=True))
    def get(self, request: Request, tenant_id: str) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        data = ProjectSerializer(page, many=True,
                                 context=_project_context(self.tenant(), only=page)).data
        return self.get_paginated_response(data)

    @extend_schema(request=ProjectCreateSerializer, responses={201: ProjectSerializer})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = ProjectCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = _allotments_in_scope(request, dict(body.validated_data), None)
        try:
            project = services.create_project(
                tenant, data["slug"], actor=self.actor, name=data["name"],
                tokens_per_day=data.get("tokens_per_day"),
                tokens_per_month=data.get("tokens_per_month"),
                pace_share_percent=data.get("pace_share_percent"),
                pace_spend_micros=data.get("pace_spend_micros"),
                allotment_tokens_per_day=data.get("allotment_tokens_per_day"),
                allotment_tokens_per_month=data.get("allotment_tokens_per_month"),
                within_limits=True,
            )
        except SlugTaken:
            raise ValidationError(
                {"slug": ["A project with this slug already exists in this tenant."]}
            ) from None
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(ProjectSerializer(project).data, status=status.HTTP_201_CREATED)


@extend_schema(parameters=[TENANT_ID, PROJECT_ID])
class ProjectDetailView(TenantScopedAPIView):
    """GET / PATCH one project (name and sub-limits; null removes a sub-limit)."""

    token_scopes = KEYS_WRITES

    def _project(self, manage: bool = False) -> Project:
        projects = selectors.tenant_projects(self.tenant(manage=manage))
        return get_in_tenant(projects, "project", public_id=self.kwargs["project_id"])

    @extend_schema(responses=ProjectSerializer)
    def get(self, request: Request, tenant_id: str, project_id: str) -> Response:
        project = self._project()
        return Response(ProjectSerializer(
            project, context=_project_context(project.tenant, only=[project])).data)

    @extend_schema(request=ProjectUpdateSerializer, responses=ProjectSerializer)
    def patch(self, request: Request, tenant_id: str, project_id: str) -> Response:
        project = self._project(manage=True)
        body = ProjectUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changes = _allotments_in_scope(request, dict(body.validated_data), project)
        try:
            services.update_project(project, actor=self.actor, **changes)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(ProjectSerializer(
            project, context=_project_context(project.tenant, only=[project])).data)


@extend_schema(parameters=[TENANT_ID])
class KeyListView(TenantScopedAPIView, GenericAPIView):
    """GET: the tenant's keys, masked, newest first. POST: issue a key (plaintext in the
    response, once)."""

    token_scopes = KEYS_WRITES
    serializer_class = ApiKeySerializer

    def get_queryset(self) -> Any:
        tenant = self.tenant()
        params = self.request.query_params
        project = None
        if project_id := params.get("project"):
            project = selectors.tenant_projects(tenant).filter(public_id=project_id).first()
            if project is None:
                raise ValidationError({"project": ["No such project in this tenant."]})
        choices = {"status": selectors.KEY_FILTERS, "used": selectors.LAST_USE,
                   "order": tuple(selectors.KEY_ORDERS)}
        for name, allowed in choices.items():
            value = params.get(name)
            if value is not None and value not in allowed:
                raise ValidationError({name: [f"Must be one of: {', '.join(allowed)}."]})
        text = params.get("q", "")
        if len(text) > selectors.KEY_SEARCH_MAX_LENGTH:
            raise ValidationError(
                {"q": [f"At most {selectors.KEY_SEARCH_MAX_LENGTH} characters."]})
        return selectors.search_keys(
            tenant, text=text, project=project, status=params.get("status"),
            used=params.get("used"), order=params.get("order", "newest"),
        )

    @extend_schema(parameters=[
        OpenApiParameter("project", OpenApiTypes.STR, description="Only this project's (prj_...)."),
        OpenApiParameter("status", OpenApiTypes.STR, enum=list(selectors.KEY_FILTERS),
                         description="Only keys in this state; rotating: active, with the "
                         "previous secret of a rotation still in its grace period."),
        OpenApiParameter("q", {"type": "string", "maxLength": selectors.KEY_SEARCH_MAX_LENGTH},
                         description="Part of the key's name (any case), or its exact id."),
        OpenApiParameter("used", OpenApiTypes.STR, enum=list(selectors.LAST_USE),
                         description="Last used within a day, a week, 30 days; idle: not in "
                         "30 days (or never); never."),
        OpenApiParameter("order", OpenApiTypes.STR, enum=list(selectors.KEY_ORDERS),
                         description="newest (default), oldest, name or last_used (never-used "
                         "keys last); ties are broken the same way on every page."),
    ], responses=ApiKeySerializer(many=True))
    def get(self, request: Request, tenant_id: str) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        data = ApiKeySerializer(page, many=True,
                                context=_key_context(self.tenant(), only=page)).data
        return self.get_paginated_response(data)

    @extend_schema(request=KeyIssueSerializer, responses={201: IssuedApiKeySerializer})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = KeyIssueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = _allotments_in_scope(request, dict(body.validated_data), None)
        project_id = data.pop("project")
        # Looked up through the caller's tenant: a project of another tenant is "no such project".
        project = selectors.tenant_projects(tenant).filter(public_id=project_id).first()
        if project is None:
            raise NotFound("No such project.")
        try:
            issued = services.issue_key(project, actor=self.actor, within_limits=True, **data)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        context = {"plaintext": issued.plaintext, "now": timezone.now(), "usage": {}}
        return secret_response(IssuedApiKeySerializer(issued.api_key, context=context).data,
                               status=status.HTTP_201_CREATED)


class _KeyView(TenantScopedAPIView):
    token_scopes = KEYS_WRITES

    def _key(self, manage: bool = False) -> ApiKey:
        keys = selectors.tenant_keys(self.tenant(manage=manage))
        return get_in_tenant(keys, "API key", public_id=self.kwargs["key_id"])


@extend_schema(parameters=[TENANT_ID, KEY_ID])
class KeyDetailView(_KeyView):
    """GET / PATCH one key: name, sub-limits (within the project's and the tenant's), models."""

    @extend_schema(responses=ApiKeySerializer)
    def get(self, request: Request, tenant_id: str, key_id: str) -> Response:
        api_key = self._key()
        return Response(ApiKeySerializer(
            api_key, context=_key_context(self.tenant(), only=[api_key])).data)

    @extend_schema(request=KeyUpdateSerializer, responses=ApiKeySerializer)
    def patch(self, request: Request, tenant_id: str, key_id: str) -> Response:
        api_key = self._key(manage=True)
        body = KeyUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changes = _allotments_in_scope(request, dict(body.validated_data), api_key)
        try:
            services.update_key(api_key, actor=self.actor, **changes)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(ApiKeySerializer(
            api_key, context=_key_context(self.tenant(), only=[api_key])).data)


@extend_schema(parameters=[TENANT_ID, KEY_ID])
class KeyRotateView(_KeyView):
    """POST: a new secret (plaintext in the response, once); the old ones stop working now or
    after `grace_seconds`."""

    @extend_schema(request=KeyRotateSerializer, responses={200: IssuedApiKeySerializer})
    def post(self, request: Request, tenant_id: str, key_id: str) -> Response:
        api_key = self._key(manage=True)
        body = KeyRotateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            issued = services.rotate_key(api_key, actor=self.actor,
                                         grace_seconds=body.validated_data["grace_seconds"])
        except (KeyRevoked, KeyExpired) as exc:
            raise ValidationError({"non_field_errors": [str(exc)]}) from None
        fresh = selectors.tenant_keys(self.tenant()).get(pk=issued.api_key.pk)
        context = {**_key_context(self.tenant(), only=[fresh]), "plaintext": issued.plaintext}
        return secret_response(IssuedApiKeySerializer(fresh, context=context).data)


@extend_schema(parameters=[TENANT_ID, KEY_ID])
class KeyRevokeView(_KeyView):
    """POST: revoke the key and all its secrets at once (idempotent)."""

    @extend_schema(request=None, responses=ApiKeySerializer)
    def post(self, request: Request, tenant_id: str, key_id: str) -> Response:
        api_key = self._key(manage=True)
        services.revoke_key(api_key, actor=self.actor)
        return Response(ApiKeySerializer(
            api_key, context=_key_context(self.tenant(), only=[api_key])).data)
