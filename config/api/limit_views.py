"""Management API: plans (operators read and write every plan; anyone else reads the plans of
the tenants they see) and a tenant's limits.

A plan has no "public" flag: which plans a tenant could move to is the operators' business (they
change plans), so a tenant user or token sees only its own tenants' plans; any other plan is a
404, like an object of another tenant. A tenant user changing a plan gets 403 (not 404), before
any lookup. A tenant's
limits are its plan, its overrides (operators) and its alert thresholds (tenant admins), plus the
live counters from Redis; with Redis down the live part is missing and the answer is a 503 that
still carries the static part.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from config.api.key_scopes import KEY_SCOPE_PARAMETERS, key_scope_page
from config.api.service_errors import service_error
from config.api.tenancy_serializers import (
    PaceResumeSerializer,
    PaceTripSerializer,
    PlanSerializer,
    PlanUpdateSerializer,
    TenantLimitsSerializer,
    TenantLimitsUpdateSerializer,
)
from config.api.tenant_scope import (
    TENANT_ID,
    ManagementAPIView,
    TenantScopedAPIView,
    get_in_tenant,
)
from quotas.cycles import (
    Span,
    asked_spec,
    change_cycle,
    cycle_standing,
    describe_change,
    merged_spec,
    recent_cycle_windows,
)
from quotas.engine import UNLIMITED, QuotaStoreUnavailable
from quotas.pace import Trip, resume_trip, tenant_trips
from quotas.status import quota_status
from tenants import selectors, services
from tenants.allotments import tenant_allotments
from tenants.exceptions import SlugTaken
from tenants.models import Plan, Tenant

LIVE_UNAVAILABLE = (
    "Live quota counters are unavailable: the quota store (Redis) cannot be reached. The plan "
    "and limits in this response are current; used and remaining figures are not."
)
# What tenant admins may change themselves; every other override is for operators.
TENANT_ADMIN_FIELDS = ("alert_thresholds", "forecast_threshold_percent")
OPERATOR_OVERRIDES = tuple(
    name for name in services.TENANT_OVERRIDE_FIELDS if name not in TENANT_ADMIN_FIELDS
)
# The PATCH fields of the reset cycle (operators), and the names quotas.cycles.change_cycle's
# errors give them.
CYCLE_FIELDS = {"cycle": "cycle", "cycle_anchor": "anchor", "cycle_every_days": "every_days",
                "time_zone": "time_zone"}
PLAN_NAME = OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH,
                             description="The plan's name (e.g. standard).")


def _require_operator(principal: Any, what: str) -> None:
    if not principal.is_operator:
        raise PermissionDenied(f"Only operators may {what}.")


def visible_plans(principal: Any) -> QuerySet[Plan]:
    """Every plan for an operator; for anyone else the plans of the tenants they see."""
    plans = selectors.plans()
    if principal.is_operator:
        return plans
    return plans.filter(tenants__in=principal.visible_tenants()).distinct()


class PlanListView(ManagementAPIView, GenericAPIView):
    """GET: the plans the caller sees (operators: all; others: their tenants' plans).
    POST: create a plan (operators)."""

    serializer_class = PlanSerializer

    def get_queryset(self) -> Any:
        return visible_plans(self.principal)

    @extend_schema(responses=PlanSerializer(many=True))
    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(PlanSerializer(page, many=True).data)

    @extend_schema(request=PlanSerializer, responses={201: PlanSerializer})
    def post(self, request: Request) -> Response:
        _require_operator(self.principal, "create plans")
        body = PlanSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        fields = dict(body.validated_data)
        name = fields.pop("name")
        try:
            plan = services.create_plan(name, actor=self.actor, **fields)
        except SlugTaken:
            raise ValidationError({"name": ["A plan with this name already exists."]}) from None
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


@extend_schema(parameters=[PLAN_NAME])
class PlanDetailView(ManagementAPIView):
    """GET a plan; PATCH (operators) changes it for every tenant on it, from the next request."""

    def _plan(self) -> Plan:
        return get_in_tenant(visible_plans(self.principal), "plan", name=self.kwargs["name"])

    @extend_schema(responses=PlanSerializer)
    def get(self, request: Request, name: str) -> Response:
        return Response(PlanSerializer(self._plan()).data)

    @extend_schema(request=PlanUpdateSerializer, responses=PlanSerializer)
    def patch(self, request: Request, name: str) -> Response:
        _require_operator(self.principal, "change plans")
        plan = self._plan()
        body = PlanUpdateSerializer(plan, data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        try:
            services.update_plan(plan, actor=self.actor, **body.validated_data)
        except DjangoValidationError as exc:
            raise service_error(exc) from None
        return Response(PlanSerializer(plan).data)


def _or_none(value: int) -> int | None:
    return None if value == UNLIMITED else value


def _span(span: Span) -> dict[str, Any]:
    return {"id": span.id, "start": span.start.isoformat(), "end": span.end.isoformat(),
            "label": span.label}


def cycle_document(tenant: Tenant) -> dict[str, Any]:
    """The tenant's reset cycle: in force now, its windows, a pending change, what was asked."""
    standing = cycle_standing(tenant)
    return {
        "cycle": standing.description, "time_zone": standing.cycle.zone,
        "window": _span(standing.window), "day": _span(standing.day),
        "pending": None if standing.pending is None or standing.changes_at is None else {
            "cycle": standing.pending_description, "time_zone": standing.pending.zone,
            "changes_at": standing.changes_at.isoformat()},
        "asked": asked_spec(tenant).to_json(),
        "windows": [_span(span) for span in recent_cycle_windows(tenant)],
    }


def _change_cycle(tenant: Tenant, changes: dict[str, Any], actor: str) -> str:
    """Apply the cycle fields of a PATCH (quotas.cycles.change_cycle); the change in words."""
    asked = {CYCLE_FIELDS[name]: value for name, value in changes.items()}
    spec = merged_spec(tenant, cycle=asked.get("cycle"), anchor=asked.get("anchor"),
                       every_days=asked.get("every_days"), time_zone=asked.get("time_zone"),
                       given=frozenset(asked))
    try:
        done = change_cycle(tenant, cycle=spec.cycle, anchor=spec.anchor,
                            every_days=spec.every_days, time_zone=spec.time_zone, actor=actor)
    except DjangoValidationError as exc:
        by_service = {service: api for api, service in CYCLE_FIELDS.items()}
        raise ValidationError({by_service.get(field, field): messages
                               for field, messages in exc.message_dict.items()}) from None
    return describe_change(done)


def limits_representation(tenant: Tenant, request: Request) -> tuple[dict[str, Any], bool]:
    """The limits document of a tenant and whether its live part could be read; the live part
    lists the scopes of the page of keys `request` asks for (config/api/key_scopes.py)."""
    limits = selectors.effective_limits(tenant)
    keys, key_page = key_scope_page(request, tenant)
    try:
        live_status = quota_status(tenant, keys=keys)
    except QuotaStoreUnavailable:
        live = None
    else:
        live = {"open_holds": live_status.open_holds,
                "scopes": [scope.as_dict() for scope in live_status.scopes], "keys": key_page}
    document = {
        "plan": PlanSerializer(tenant.plan).data,
        "effective": {
            "tokens_per_day": _or_none(limits.tokens_per_day),
            "tokens_per_minute": _or_none(limits.tokens_per_minute),
            "requests_per_second": _or_none(limits.requests_per_second),
            "monthly_token_budget": _or_none(limits.monthly_token_budget),
            "monthly_spend_budget_micros": _or_none(limits.monthly_spend_budget_micros),
            "model_tokens_per_day": limits.model_tokens_per_day,
            "allowed_models": list(limits.allowed_models),
            "over_quota_policy": limits.over_quota_policy,
            "pace_share_percent": _or_none(limits.pace_share_percent),
            "pace_spend_micros": _or_none(limits.pace_spend_micros),
            "pace_period_seconds": limits.pace_period_seconds,
            "pace_cooldown_seconds": limits.pace_cooldown_seconds,
        },
        "overrides": {name: getattr(tenant, name) for name in OPERATOR_OVERRIDES},
        "alert_thresholds": tenant.alert_thresholds,
        "forecast_threshold_percent": tenant.forecast_threshold_percent,
        # Per window: the quota, the allotments and the shared pool (the live standing of each
        # allotment is at /quota).
        "allotments": [window.as_dict()
                       for window in tenant_allotments(tenant, limits=limits).values()],
        "cycle": cycle_document(tenant),
        "live": live,
    }
    return document, live is not None


@extend_schema(parameters=[TENANT_ID])
class TenantLimitsView(TenantScopedAPIView):
    """GET: plan, effective limits, overrides, alert and forecast thresholds, the reset cycle and
    live per-scope status. PATCH: overrides and the reset cycle (operators), alert and forecast
    thresholds (tenant admins)."""

    def _respond(self, tenant: Tenant, *, changed: bool = False, cycle_change: str = ""
                 ) -> Response:
        document, live = limits_representation(tenant, self.request)
        if cycle_change:
            document["cycle"]["change"] = cycle_change
        if live:
            return Response(document)
        # A change that was saved answers 200 even without the live part, so that a client
        # does not take the 503 for a failed write.
        code = status.HTTP_200_OK if changed else status.HTTP_503_SERVICE_UNAVAILABLE
        return Response({"detail": LIVE_UNAVAILABLE, **document}, status=code)

    @extend_schema(parameters=KEY_SCOPE_PARAMETERS,
                   responses={200: TenantLimitsSerializer,
                              503: OpenApiResponse(description=LIVE_UNAVAILABLE)})
    def get(self, request: Request, tenant_id: str) -> Response:
        return self._respond(self.tenant())

    @extend_schema(request=TenantLimitsUpdateSerializer, responses={200: TenantLimitsSerializer})
    def patch(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = TenantLimitsUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changes = dict(body.validated_data)
        cycle = {name: changes.pop(name) for name in CYCLE_FIELDS if name in changes}
        if set(changes) & set(OPERATOR_OVERRIDES):
            _require_operator(self.principal, "change a tenant's limits")
        if cycle:
            _require_operator(self.principal, "change a tenant's reset cycle")
        if not changes and not cycle:
            raise ValidationError({"non_field_errors": ["Nothing to change."]})
        with transaction.atomic():  # all of it or nothing (a refused cycle undoes the limits)
            if changes:
                try:
                    services.set_tenant_limits(tenant, actor=self.actor, **changes)
                except DjangoValidationError as exc:
                    raise service_error(exc) from None
            said = _change_cycle(tenant, cycle, self.actor) if cycle else ""
        return self._respond(tenant, changed=True, cycle_change=said)


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _trip_document(trip: Trip, now_ms: int) -> dict[str, Any]:
    moment = _moment
    return {"scope": trip.scope, "kind": trip.kind, "id": trip.owner.partition(":")[2],
            "label": trip.label, "rules": list(trip.rules),
            "tripped_at": moment(trip.tripped_ms), "until": moment(trip.until_ms),
            "active": trip.active(now_ms), "resumed_by": trip.resumed_by}


_PACE_UNAVAILABLE = "The quota store (Redis) cannot be reached: trips cannot be read or resumed."


@extend_schema(parameters=[TENANT_ID])
class PaceTripsView(TenantScopedAPIView):
    """GET: the tenant's burn-rate breaker trips (the latest of each scope, newest first)."""

    @extend_schema(responses={200: PaceTripSerializer(many=True),
                              503: OpenApiResponse(description=_PACE_UNAVAILABLE)})
    def get(self, request: Request, tenant_id: str) -> Response:
        try:
            trips, now_ms = tenant_trips(self.tenant())
        except QuotaStoreUnavailable:
            return Response({"detail": _PACE_UNAVAILABLE}, status=503)
        return Response(PaceTripSerializer(
            [_trip_document(t, now_ms) for t in trips], many=True).data)


@extend_schema(parameters=[TENANT_ID])
class PaceResumeView(TenantScopedAPIView):
    """POST {"scope": ...}: lift a tripped scope's breaker early (tenant admins; audited
    pace.resumed). 409 when the scope is not tripped (any more)."""

    @extend_schema(request=PaceResumeSerializer,
                   responses={200: PaceTripSerializer,
                              409: OpenApiResponse(description="Not tripped."),
                              503: OpenApiResponse(description=_PACE_UNAVAILABLE)})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = PaceResumeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            trip = resume_trip(tenant, body.validated_data["scope"], actor=self.actor)
            trips, now_ms = tenant_trips(tenant)
        except QuotaStoreUnavailable:
            return Response({"detail": _PACE_UNAVAILABLE}, status=503)
        if trip is None:
            return Response({"detail": "That scope's breaker is not tripped."}, status=409)
        lifted = next((t for t in trips if t.scope == trip.scope), trip)
        return Response(PaceTripSerializer(_trip_document(lifted, now_ms)).data)
