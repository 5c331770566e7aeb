"""Read-only queries over tenants, plans, projects and keys. Nothing here writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import (
    Count,
    F,
    IntegerField,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
)
from django.db.models.functions import Coalesce
from django.utils import timezone

from tenants.exceptions import (
    ApiKeyNotFound,
    ProjectNotFound,
    TenantNotFound,
    UnknownPlan,
)
from tenants.key_usability import in_rotation, key_usability
from tenants.models import (
    UNLIMITED,
    ApiKey,
    ApiKeySecret,
    AuditEvent,
    ManagementToken,
    Plan,
    Project,
    Tenant,
)


@dataclass(frozen=True)
class EffectiveLimits:
    """A tenant's limits after applying its overrides to its plan.

    Every limit is an int and UNLIMITED (-1) means no limit, including the monthly budgets
    (which are NULL in the database when unset), so consumers test one sentinel, never None.
    """

    plan_name: str
    tokens_per_day: int
    tokens_per_minute: int
    requests_per_second: int
    monthly_token_budget: int
    monthly_spend_budget_micros: int
    over_quota_policy: str
    queue_timeout_seconds: int
    queue_priority: int
    soft_limit_percent: int
    fallback_model: str
    safety_factor: Decimal
    shrink_hold_to_headroom: bool
    allowed_models: tuple[str, ...]  # empty: every model
    model_tokens_per_day: dict[str, int] = field(default_factory=dict)  # unlisted: unlimited
    # The burn-rate breaker (quotas/pace.py): UNLIMITED share or spend means no such rule.
    pace_share_percent: int = UNLIMITED  # of each scope's daily token limit, per period
    pace_spend_micros: int = UNLIMITED  # the tenant's micro-dollars per period
    pace_period_seconds: int = 600
    pace_cooldown_seconds: int = 1800
    # Responses API: tokens held for an earlier context the gateway has not seen; None: refused.
    responses_context_allowance_tokens: int | None = None

    @property
    def paced(self) -> bool:
        return self.pace_share_percent != UNLIMITED or self.pace_spend_micros != UNLIMITED


def _override(value: int | None, plan_value: int) -> int:
    return plan_value if value is None else value


def _plan_rule(value: int | None) -> int:
    # A plan's pace rule: NULL is no rule.
    return UNLIMITED if value is None else value


def effective_limits(tenant: Tenant) -> EffectiveLimits:
    plan = tenant.plan
    return EffectiveLimits(
        plan_name=plan.name,
        tokens_per_day=_override(tenant.tokens_per_day, plan.tokens_per_day),
        tokens_per_minute=_override(tenant.tokens_per_minute, plan.tokens_per_minute),
        requests_per_second=_override(tenant.requests_per_second, plan.requests_per_second),
        monthly_token_budget=_override(tenant.monthly_token_budget, UNLIMITED),
        monthly_spend_budget_micros=_override(tenant.monthly_spend_budget_micros, UNLIMITED),
        over_quota_policy=plan.over_quota_policy,
        queue_timeout_seconds=plan.queue_timeout_seconds,
        queue_priority=plan.queue_priority,
        soft_limit_percent=plan.soft_limit_percent,
        fallback_model=plan.fallback_model,
        safety_factor=plan.safety_factor,
        shrink_hold_to_headroom=plan.shrink_hold_to_headroom,
        allowed_models=tuple(plan.allowed_models),
        model_tokens_per_day=dict(tenant.model_tokens_per_day),
        pace_share_percent=_override(tenant.pace_share_percent,
                                     _plan_rule(plan.pace_share_percent)),
        pace_spend_micros=_override(tenant.pace_spend_micros, _plan_rule(plan.pace_spend_micros)),
        pace_period_seconds=_override(tenant.pace_period_seconds, plan.pace_period_seconds),
        pace_cooldown_seconds=_override(tenant.pace_cooldown_seconds, plan.pace_cooldown_seconds),
        responses_context_allowance_tokens=plan.responses_context_allowance_tokens,
    )


def allowed_models_for_key(api_key: ApiKey) -> list[str] | None:
    """The models a key may call: None means every model, an empty list means none.

    An empty list only comes out when the plan and the key both restrict and share no model;
    that must deny everything rather than fall back to "all".
    """
    plan_models: list[str] = api_key.project.tenant.plan.allowed_models
    key_models: list[str] = api_key.allowed_models
    if not plan_models and not key_models:
        return None
    if not plan_models:
        return list(key_models)
    if not key_models:
        return list(plan_models)
    plan_set = set(plan_models)
    return [model for model in key_models if model in plan_set]


def valid_secrets(api_key: ApiKey, *, now: datetime | None = None) -> list[ApiKeySecret]:
    """The secrets of a key that would authenticate at `now` (ignoring the key's own state)."""
    now = now or timezone.now()
    return list(
        api_key.secrets.filter(revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-created_at", "-id")
    )


def masked_key(api_key: ApiKey, *, now: datetime | None = None) -> str:
    """The masked form of the newest valid secret, e.g. `tgk_AbC123xYz987_…9fQ2`.

    A revoked or fully expired key falls back to its newest secret so it stays recognisable in
    listings; a key without any secret (never issued through the services) gives "".
    """
    current = valid_secrets(api_key, now=now)
    if current:
        return current[0].masked
    newest = api_key.secrets.order_by("-created_at", "-id").first()
    return newest.masked if newest else ""


def plan_by_name(name: str) -> Plan:
    try:
        return Plan.objects.get(name=name)
    except Plan.DoesNotExist:
        raise UnknownPlan(name) from None


def tenant_by_slug(slug: str) -> Tenant:
    try:
        return Tenant.objects.select_related("plan").get(slug=slug)
    except Tenant.DoesNotExist:
        raise TenantNotFound(slug) from None


def project_by_slug(tenant: Tenant, slug: str) -> Project:
    try:
        return Project.objects.select_related("tenant").get(tenant=tenant, slug=slug)
    except Project.DoesNotExist:
        raise ProjectNotFound(tenant.slug, slug) from None


def api_key_by_public_id(public_id: str) -> ApiKey:
    try:
        return ApiKey.objects.select_related("project__tenant__plan").get(public_id=public_id)
    except ApiKey.DoesNotExist:
        raise ApiKeyNotFound(public_id) from None


def secret_by_prefix(prefix: str) -> ApiKeySecret | None:
    """The secret with this lookup prefix, with its key, project, tenant and plan, and the
    allotment sums its calls are reserved with (`allotments_of`), in one query."""
    return (
        ApiKeySecret.objects.select_related("api_key__project__tenant__plan")
        .annotate(**_allotment_sum_columns("api_key__project__tenant", "api_key__project"))
        .filter(prefix=prefix)
        .first()
    )


# -- allotments -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllotmentSums:
    """What the allotments of a tenant add up to, per window ('month' = the tenant's cycle).

    `tenant_*`: the top-level allotments (every project's, and those of keys whose project has
    none): the tenant's quota minus these is its shared pool. `project_keys_*`: the allotments
    of one project's keys, carved out of that project's allotment.
    """

    tenant_day: int = 0
    tenant_month: int = 0
    project_keys_day: int = 0
    project_keys_month: int = 0


NO_ALLOTMENTS = AllotmentSums()
_ALLOTMENT_FIELDS = {"day": "allotment_tokens_per_day", "month": "allotment_tokens_per_month"}


def _sum(queryset: QuerySet, field_name: str) -> Coalesce:
    total = queryset.order_by().values("_g").annotate(total=Sum(field_name)).values("total")
    return Coalesce(Subquery(total, output_field=IntegerField()), Value(0))


def _allotment_sum_columns(tenant_path: str, project_path: str) -> dict[str, Coalesce]:
    """Correlated subqueries for AllotmentSums, to annotate a query that reaches a tenant and a
    project at these paths (so reading them costs no query of its own)."""
    columns = {}
    for window, name in _ALLOTMENT_FIELDS.items():
        projects = Project.objects.filter(tenant=OuterRef(tenant_path)).annotate(_g=Value(1))
        # A revoked key's allotment is freed (tenants/allotments.py: the same totals).
        top_keys = ApiKey.objects.filter(
            project__tenant=OuterRef(tenant_path), revoked_at__isnull=True,
            **{f"project__{name}__isnull": True},
        ).annotate(_g=Value(1))
        own_keys = ApiKey.objects.filter(
            project=OuterRef(project_path), revoked_at__isnull=True).annotate(_g=Value(1))
        columns[f"_al_tenant_projects_{window}"] = _sum(projects, name)
        columns[f"_al_tenant_keys_{window}"] = _sum(top_keys, name)
        columns[f"_al_project_keys_{window}"] = _sum(own_keys, name)
    return columns


def allotments_of(row: object) -> AllotmentSums:
    """The sums annotated on a row by secret_by_prefix (or allotment_sums)."""
    get = row.__dict__.get
    return AllotmentSums(
        tenant_day=get("_al_tenant_projects_day", 0) + get("_al_tenant_keys_day", 0),
        tenant_month=get("_al_tenant_projects_month", 0) + get("_al_tenant_keys_month", 0),
        project_keys_day=get("_al_project_keys_day", 0),
        project_keys_month=get("_al_project_keys_month", 0),
    )


def allotment_sums(project: Project) -> AllotmentSums:
    """The allotment sums for calls of this project's keys (one query)."""
    row = (Project.objects.filter(pk=project.pk)
           .annotate(**_allotment_sum_columns("tenant", "pk")).only("pk").first())
    return allotments_of(row) if row is not None else NO_ALLOTMENTS


# -- listings for the console and the management API ---------------------------------------------

KEY_STATUSES: tuple[str, ...] = ("active", "expired", "revoked")
# What a listing may filter on: a key's status, or "rotating" (active, and the previous secret
# of a rotation still in its grace period: tenants.key_usability.in_rotation).
KEY_FILTERS: tuple[str, ...] = ("active", "rotating", "expired", "revoked")
# Last use: within a day / week / month, idle (not within a month, or never), never.
LAST_USE: tuple[str, ...] = ("day", "week", "month", "idle", "never")
_LAST_USE_SPANS = {"day": timedelta(days=1), "week": timedelta(days=7), "month": timedelta(days=30)}
# Listing orders; each ends with the primary key so that a page boundary never splits ties
# differently from one request to the next.
KEY_ORDERS: dict[str, tuple[Any, ...]] = {
    "newest": ("-created_at", "-id"),
    "oldest": ("created_at", "id"),
    "name": ("name", "id"),
    "last_used": (F("last_used_at").desc(nulls_last=True), "-id"),
}
KEY_SEARCH_MAX_LENGTH = 200  # as long as a key's name


def key_status(api_key: ApiKey, *, now: datetime | None = None) -> str:
    """active / expired / revoked, as listings show it (tenants.key_usability)."""
    return key_usability(api_key).status(now or timezone.now())


def key_in_rotation(api_key: ApiKey, *, now: datetime | None = None) -> bool:
    """in_rotation() over the prefetched secrets of tenant_keys(), without a query."""
    return in_rotation(api_key, api_key.secrets.all(), now or timezone.now())


def _keys_with_usable_secrets(tenant: Tenant, now: datetime) -> QuerySet[ApiKeySecret]:
    """The ids of the tenant's keys with more than one secret usable at `now`: the SQL twin of
    key_usability for a secret of an active key (not revoked, not expired). One grouped pass
    over the tenant's secrets, not a count per key (a correlated subquery per row of 20,000)."""
    return (ApiKeySecret.objects.filter(api_key__project__tenant=tenant, revoked_at__isnull=True)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
            .order_by().values("api_key").annotate(n=Count("pk")).filter(n__gt=1)
            .values("api_key"))


def tenant_keys(
    tenant: Tenant, *, project: Project | None = None, status: str | None = None
) -> QuerySet[ApiKey]:
    """The tenant's keys, newest first, with project and secrets loaded (see listed_masked_key).
    status: one of KEY_FILTERS, or None for all."""
    keys = ApiKey.objects.filter(project__tenant=tenant).select_related("project__tenant__plan")
    if project is not None:
        keys = keys.filter(project=project)
    now = timezone.now()
    if status == "revoked":
        keys = keys.filter(revoked_at__isnull=False)
    elif status == "expired":
        keys = keys.filter(revoked_at__isnull=True, expires_at__lte=now)
    elif status in ("active", "rotating"):
        keys = keys.filter(revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )
        if status == "rotating":
            keys = keys.filter(pk__in=_keys_with_usable_secrets(tenant, now))
    elif status is not None:
        raise ValueError(f"Unknown key status {status!r}; expected one of {', '.join(KEY_FILTERS)}")
    secrets = Prefetch("secrets", queryset=ApiKeySecret.objects.order_by("-created_at", "-id"))
    return keys.prefetch_related(secrets).order_by("-created_at", "-id")


def search_keys(
    tenant: Tenant,
    *,
    text: str = "",
    project: Project | None = None,
    status: str | None = None,
    used: str | None = None,
    order: str = "newest",
) -> QuerySet[ApiKey]:
    """tenant_keys() narrowed for a listing one page at a time: `text` a substring of the key's
    name (case-insensitive) or its exact public id, `used` one of LAST_USE, `order` one of
    KEY_ORDERS (always a total order). Unknown values raise ValueError (the views check first)."""
    keys = tenant_keys(tenant, project=project, status=status)
    text = text.strip()
    if text:
        keys = keys.filter(Q(name__icontains=text) | Q(public_id=text))
    if used is not None:
        now = timezone.now()
        if used in _LAST_USE_SPANS:
            keys = keys.filter(last_used_at__gt=now - _LAST_USE_SPANS[used])
        elif used == "idle":
            keys = keys.filter(Q(last_used_at__isnull=True)
                               | Q(last_used_at__lte=now - _LAST_USE_SPANS["month"]))
        elif used == "never":
            keys = keys.filter(last_used_at__isnull=True)
        else:
            raise ValueError(f"Unknown last use {used!r}; expected one of {', '.join(LAST_USE)}")
    if order not in KEY_ORDERS:
        raise ValueError(f"Unknown order {order!r}; expected one of {', '.join(KEY_ORDERS)}")
    return keys.order_by(*KEY_ORDERS[order])


def project_key_counts(tenant: Tenant, projects: list[Project]) -> dict[int, dict[str, int]]:
    """Per project pk: how many keys it has in all and how many are unrevoked (one query)."""
    rows = (ApiKey.objects.filter(project__tenant=tenant, project__in=projects).order_by()
            .values("project_id")
            .annotate(total=Count("pk"), unrevoked=Count("pk", filter=Q(revoked_at__isnull=True))))
    return {row["project_id"]: {"total": row["total"], "unrevoked": row["unrevoked"]}
            for row in rows}


def listed_masked_key(api_key: ApiKey, *, now: datetime | None = None) -> str:
    """masked_key() from the prefetched secrets of tenant_keys(), without a query per key."""
    now = now or timezone.now()
    secrets = list(api_key.secrets.all())  # newest first
    for secret in secrets:
        if secret.revoked_at is None and (secret.expires_at is None or secret.expires_at > now):
            return secret.masked
    return secrets[0].masked if secrets else ""


def plans() -> QuerySet[Plan]:
    return Plan.objects.order_by("name")


def tenant_projects(tenant: Tenant) -> QuerySet[Project]:
    return Project.objects.filter(tenant=tenant).select_related("tenant__plan").order_by("slug")


def management_tokens(tenant: Tenant) -> QuerySet[ManagementToken]:
    return ManagementToken.objects.filter(tenant=tenant).order_by("-created_at", "-id")


def audit_events(
    tenant: Tenant,
    *,
    start: date | None = None,
    end: date | None = None,
    action: str = "",
    actor: str = "",
) -> QuerySet[AuditEvent]:
    """The tenant's audit trail, newest first; start..end are inclusive UTC days, action an exact
    name (key.issued) or a family (key.), actor a substring (user:alice, token:)."""
    events = AuditEvent.objects.filter(tenant=tenant)
    if start is not None:
        events = events.filter(created_at__gte=datetime.combine(start, time.min, tzinfo=UTC))
    if end is not None:
        events = events.filter(
            created_at__lt=datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC))
    if action:
        events = (events.filter(action__startswith=action) if action.endswith(".")
                  else events.filter(action=action))
    if actor:
        events = events.filter(actor__icontains=actor)
    return events.order_by("-created_at", "-id")


def audit_actions(tenant: Tenant) -> list[str]:
    """The action names in the tenant's trail, sorted, for a filter's choices.

    A loose index scan (one probe of the (tenant, action) index per distinct name, a recursive
    query) rather than DISTINCT over the trail: a tenant with a million events has a few dozen
    action names, and reading every row for them cost more than the rest of the page."""
    table = AuditEvent._meta.db_table
    sql = f"""
        WITH RECURSIVE names(action) AS (
            (SELECT action FROM {table} WHERE tenant_id = %s ORDER BY action LIMIT 1)
            UNION ALL
            SELECT (SELECT e.action FROM {table} e
                    WHERE e.tenant_id = %s AND e.action > names.action
                    ORDER BY e.action LIMIT 1)
            FROM names WHERE names.action IS NOT NULL
        )
        SELECT action FROM names WHERE action IS NOT NULL"""
    with connection.cursor() as cursor:
        cursor.execute(sql, [tenant.pk, tenant.pk])
        return [row[0] for row in cursor.fetchall()]


@dataclass(frozen=True)
class AuditPosition:
    """Where a page of an audit listing ended: the last event's time, and how many events of
    exactly that time were already listed (events are ordered by time, then id; an id never
    leaves the server, so ties are skipped by count)."""

    created_at: datetime
    skip: int


def audit_page(
    events: QuerySet[AuditEvent], after: AuditPosition | None, size: int
) -> tuple[list[AuditEvent], AuditPosition | None]:
    """Up to `size` events of audit_events() after `after` (None: from the newest), and the
    position to continue from (None on the last page). A keyset walk: no COUNT and no OFFSET
    over the trail, so a page costs the same at the millionth event as at the first (the
    (tenant, created_at, id) index); only ties of one instant are skipped by OFFSET."""
    if after is not None:
        events = events.filter(created_at__lte=after.created_at)
    skip = after.skip if after is not None else 0
    rows = list(events[skip:skip + size + 1])
    if len(rows) <= size:
        return rows, None
    rows = rows[:size]
    last = rows[-1].created_at
    same = sum(1 for row in rows if row.created_at == last)
    if after is not None and last == after.created_at:
        same += after.skip
    return rows, AuditPosition(last, same)
