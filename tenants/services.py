"""Everything that changes tenants, projects and keys. Each service runs in one transaction and
records one AuditEvent when it changes something (a call that changes nothing records nothing).

Services update the instance they are given, so a caller holding it sees the new state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from tenants.exceptions import (
    ApiKeyNotFound,
    KeyExpired,
    KeyRevoked,
    SlugTaken,
    TenantNotFound,
)
from tenants.invalidation import publish
from tenants.keys import (
    digest_key,
    digests_match,
    generate_key,
    mask_plaintext,
    parse_key,
)
from tenants.management_tokens import generate_token, masked_token
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
from tenants.selectors import effective_limits, plan_by_name, secret_by_prefix

# What set_tenant_limits (and create_tenant's **overrides) may change.
TENANT_OVERRIDE_FIELDS: tuple[str, ...] = (
    "tokens_per_day",
    "tokens_per_minute",
    "requests_per_second",
    "monthly_token_budget",
    "monthly_spend_budget_micros",
    "model_tokens_per_day",
    "alert_thresholds",
)


@dataclass(frozen=True)
class IssuedKey:
    """A key as returned once at issue or rotation: the only place the plaintext ever exists."""

    api_key: ApiKey
    plaintext: str = field(repr=False)  # kept out of logs and tracebacks

    @property
    def masked(self) -> str:
        return mask_plaintext(self.plaintext)


def record_audit_event(
    *,
    actor: str,
    action: str,
    target: str,
    tenant: Tenant | None = None,
    data: dict[str, Any] | None = None,
) -> AuditEvent:
    """Append to the audit trail. `data` must never contain a secret or a plaintext key."""
    if not actor.strip():
        raise ValueError("An audit event needs an actor (e.g. 'cli', 'user:alice', 'system').")
    return AuditEvent.objects.create(
        tenant=tenant, actor=actor, action=action, target=target, data=data or {}
    )


def _check_override_names(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - set(TENANT_OVERRIDE_FIELDS))
    if unknown:
        raise ValueError(
            f"Unknown tenant limit field(s): {', '.join(unknown)}; "
            f"known: {', '.join(TENANT_OVERRIDE_FIELDS)}"
        )


def _clean(instance: models.Model) -> None:
    # Field validators only; uniqueness is left to the database so that a concurrent insert of
    # the same slug is caught too (see _insert_with_slug).
    instance.full_clean(validate_unique=False, validate_constraints=False)


def _insert_with_slug(
    instance: models.Model, *, taken: QuerySet[Any], kind: str, slug: str
) -> None:
    try:
        # A savepoint, so the caller's transaction stays usable after a unique violation.
        with transaction.atomic():
            instance.save(force_insert=True)
    except IntegrityError:
        if taken.exists():
            raise SlugTaken(kind, slug) from None
        raise


def _lock_tenant(tenant: Tenant) -> Tenant:
    # Row lock so concurrent edits of one tenant serialise instead of losing an update.
    try:
        return (
            Tenant.objects.select_for_update(of=("self",)).select_related("plan").get(pk=tenant.pk)
        )
    except Tenant.DoesNotExist:
        raise TenantNotFound(tenant.slug) from None


def _lock_api_key(api_key: ApiKey) -> ApiKey:
    try:
        return (
            ApiKey.objects.select_for_update(of=("self",))
            .select_related("project__tenant")
            .get(pk=api_key.pk)
        )
    except ApiKey.DoesNotExist:
        raise ApiKeyNotFound(api_key.public_id) from None


def _new_secret(api_key: ApiKey) -> tuple[str, ApiKeySecret]:
    plaintext, prefix, digest, last4 = generate_key()
    secret = ApiKeySecret.objects.create(api_key=api_key, prefix=prefix, digest=digest, last4=last4)
    return plaintext, secret


def create_tenant(
    slug: str, *, plan_name: str, actor: str, name: str = "", **overrides: Any
) -> Tenant:
    _check_override_names(overrides)
    with transaction.atomic():
        plan = plan_by_name(plan_name)
        tenant = Tenant(slug=slug, name=name or slug, plan=plan, **overrides)
        _clean(tenant)
        _insert_with_slug(tenant, taken=Tenant.objects.filter(slug=slug), kind="tenant", slug=slug)
        record_audit_event(
            tenant=tenant,
            actor=actor,
            action="tenant.created",
            target=tenant.public_id,
            data={"slug": slug, "name": tenant.name, "plan": plan.name, "overrides": overrides},
        )
    return tenant


def create_project(
    tenant: Tenant,
    slug: str,
    *,
    actor: str,
    name: str = "",
    tokens_per_day: int | None = None,
    tokens_per_month: int | None = None,
    within_limits: bool = False,
) -> Project:
    """With within_limits=True (the console and the API), sub-limits above the tenant's effective
    limits are refused with a ValidationError naming the field; operator tools may skip that."""
    if within_limits:
        check_project_limits(tenant, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month)
    with transaction.atomic():
        project = Project(
            tenant=tenant,
            slug=slug,
            name=name or slug,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
        )
        _clean(project)
        _insert_with_slug(
            project,
            taken=Project.objects.filter(tenant=tenant, slug=slug),
            kind=f"project in tenant {tenant.slug!r}",
            slug=slug,
        )
        record_audit_event(
            tenant=tenant,
            actor=actor,
            action="project.created",
            target=project.public_id,
            data={
                "slug": slug,
                "name": project.name,
                "tokens_per_day": tokens_per_day,
                "tokens_per_month": tokens_per_month,
            },
        )
    return project


def issue_key(
    project: Project,
    *,
    actor: str,
    name: str = "",
    tokens_per_day: int | None = None,
    tokens_per_month: int | None = None,
    requests_per_minute: int | None = None,
    max_concurrency: int | None = None,
    allowed_models: list[str] | None = None,
    expires_at: datetime | None = None,
    within_limits: bool = False,
) -> IssuedKey:
    """With within_limits=True (the console and the API), sub-limits beyond the project's or the
    tenant's and models outside the plan are refused with a ValidationError naming the field."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    if within_limits:
        check_key_limits(
            project, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month,
            requests_per_minute=requests_per_minute, allowed_models=allowed_models or [],
        )
    with transaction.atomic():
        api_key = ApiKey(
            project=project,
            name=name,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
            requests_per_minute=requests_per_minute,
            max_concurrency=max_concurrency,
            allowed_models=list(allowed_models or []),
            expires_at=expires_at,
            created_by=actor,
        )
        _clean(api_key)
        api_key.save(force_insert=True)
        plaintext, secret = _new_secret(api_key)
        record_audit_event(
            tenant=project.tenant,
            actor=actor,
            action="key.issued",
            target=api_key.public_id,
            data={
                "project": project.public_id,
                "name": name,
                "masked": secret.masked,
                "tokens_per_day": tokens_per_day,
                "tokens_per_month": tokens_per_month,
                "requests_per_minute": requests_per_minute,
                "max_concurrency": max_concurrency,
                "allowed_models": api_key.allowed_models,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    return IssuedKey(api_key=api_key, plaintext=plaintext)


def rotate_key(api_key: ApiKey, *, actor: str, grace_seconds: int = 0) -> IssuedKey:
    """Give the key a new secret; its previous secrets die now, or after `grace_seconds`.

    The grace period lets a client deploy the new secret before the old one stops working.
    A secret already due to expire sooner (from an earlier rotation) keeps its earlier deadline.
    """
    if grace_seconds < 0:
        raise ValueError("grace_seconds must be >= 0")
    with transaction.atomic():
        locked = _lock_api_key(api_key)
        now = timezone.now()
        if locked.revoked_at is not None:
            raise KeyRevoked(locked.public_id)
        if locked.expires_at is not None and locked.expires_at <= now:
            raise KeyExpired(locked.public_id)
        live = locked.secrets.filter(revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )
        previous = live.count()
        valid_until = now + timedelta(seconds=grace_seconds)
        if grace_seconds == 0:
            live.update(revoked_at=now)
        else:
            live.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=valid_until)).update(
                expires_at=valid_until
            )
        plaintext, secret = _new_secret(locked)
        record_audit_event(
            tenant=locked.project.tenant,
            actor=actor,
            action="key.rotated",
            target=locked.public_id,
            data={
                "masked": secret.masked,
                "grace_seconds": grace_seconds,
                "previous_secrets": previous,
                "previous_valid_until": valid_until.isoformat(),
            },
        )
        publish("api_key", locked.pk)
    return IssuedKey(api_key=locked, plaintext=plaintext)


def revoke_key(api_key: ApiKey, *, actor: str) -> bool:
    """Revoke the key and every secret of it. True if this call revoked it, False if it already
    was revoked (then nothing is written)."""
    with transaction.atomic():
        locked = _lock_api_key(api_key)
        if locked.revoked_at is not None:
            api_key.revoked_at = locked.revoked_at
            return False
        now = timezone.now()
        locked.revoked_at = now
        locked.save(update_fields=["revoked_at"])
        secrets_revoked = locked.secrets.filter(revoked_at__isnull=True).update(revoked_at=now)
        record_audit_event(
            tenant=locked.project.tenant,
            actor=actor,
            action="key.revoked",
            target=locked.public_id,
            data={"secrets_revoked": secrets_revoked},
        )
        publish("api_key", locked.pk)
    api_key.revoked_at = now
    return True


def change_plan(tenant: Tenant, plan_name: str, *, actor: str) -> Tenant:
    with transaction.atomic():
        plan = plan_by_name(plan_name)
        locked = _lock_tenant(tenant)
        previous = locked.plan
        if previous.pk != plan.pk:
            locked.plan = plan
            locked.save(update_fields=["plan"])
            record_audit_event(
                tenant=locked,
                actor=actor,
                action="tenant.plan_changed",
                target=locked.public_id,
                data={"from": previous.name, "to": plan.name},
            )
            publish("tenant", locked.pk)
    tenant.plan = plan
    return tenant


def set_tenant_limits(tenant: Tenant, *, actor: str, **overrides: Any) -> Tenant:
    """Set tenant overrides: None inherits the plan, UNLIMITED (-1) lifts the limit."""
    if not overrides:
        raise ValueError("No limits given")
    _check_override_names(overrides)
    with transaction.atomic():
        locked = _lock_tenant(tenant)
        changes = {
            name: {"from": getattr(locked, name), "to": value}
            for name, value in overrides.items()
            if getattr(locked, name) != value
        }
        for name, value in overrides.items():
            setattr(locked, name, value)
        _clean(locked)
        if changes:
            locked.save(update_fields=list(changes))
            record_audit_event(
                tenant=locked,
                actor=actor,
                action="tenant.limits_changed",
                target=locked.public_id,
                data={"changes": changes},
            )
            publish("tenant", locked.pk)
    for name in TENANT_OVERRIDE_FIELDS:
        setattr(tenant, name, getattr(locked, name))
    return tenant


def set_tenant_status(tenant: Tenant, status: str, *, actor: str) -> Tenant:
    if status not in Tenant.Status.values:
        raise ValueError(
            f"Unknown tenant status {status!r}; expected one of {', '.join(Tenant.Status.values)}"
        )
    with transaction.atomic():
        locked = _lock_tenant(tenant)
        previous = locked.status
        if previous != status:
            locked.status = status
            locked.save(update_fields=["status"])
            record_audit_event(
                tenant=locked,
                actor=actor,
                action="tenant.status_changed",
                target=locked.public_id,
                data={"from": previous, "to": status},
            )
            publish("tenant", locked.pk)
    tenant.status = status
    return tenant


def authenticate_key(plaintext: str, *, now: datetime | None = None) -> ApiKey | None:
    """The ApiKey a presented plaintext key belongs to, or None if it must not be accepted.

    One query, no writes: the gateway calls this on every request and records last use in
    batches with touch_last_used(). The returned key has project, tenant and plan loaded.
    """
    prefix = parse_key(plaintext)
    if prefix is None:
        return None
    secret = secret_by_prefix(prefix)
    if secret is None:
        # Spend the same HMAC work as for a known prefix, so timing does not tell callers
        # which prefixes exist.
        digest_key(plaintext)
        return None
    if not digests_match(plaintext, secret.digest):
        return None
    now = now or timezone.now()
    api_key = secret.api_key
    if secret.revoked_at is not None or api_key.revoked_at is not None:
        return None
    if secret.expires_at is not None and secret.expires_at <= now:
        return None
    if api_key.expires_at is not None and api_key.expires_at <= now:
        return None
    if api_key.project.tenant.status != Tenant.Status.ACTIVE:
        return None
    return api_key


def touch_last_used(api_key_ids: Iterable[int], when: datetime) -> int:
    """Record that keys were used at `when`, in one UPDATE; returns how many rows moved.

    Not audited: this is usage telemetry from the hot path, not a change anyone made. It never
    moves last_used_at backwards, so batches flushed out of order are harmless.
    """
    ids = list(api_key_ids)
    if not ids:
        return 0
    return (
        ApiKey.objects.filter(pk__in=ids)
        .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=when))
        .update(last_used_at=when)
    )


# -- management API tokens ----------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedToken:
    """A management token as returned once at issue: the only place its plaintext exists."""

    token: ManagementToken
    plaintext: str = field(repr=False)


def issue_management_token(
    tenant: Tenant | None, *, name: str, actor: str, expires_at: datetime | None = None
) -> IssuedToken:
    """A bearer token for /api/: scoped to `tenant` (as its admin), or an operator token that
    sees every tenant when `tenant` is None."""
    if not name.strip():
        raise ValueError("A management token needs a name (what it is for).")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    plaintext, prefix, digest, last4 = generate_token()
    with transaction.atomic():
        token = ManagementToken(
            tenant=tenant, name=name.strip(), prefix=prefix, digest=digest, last4=last4,
            created_by=actor, expires_at=expires_at,
        )
        _clean(token)
        token.save(force_insert=True)
        record_audit_event(
            tenant=tenant, actor=actor, action="token.issued", target=token.public_id,
            data={"name": token.name, "masked": masked_token(prefix, last4),
                  "operator": tenant is None,
                  "expires_at": expires_at.isoformat() if expires_at else None},
        )
    return IssuedToken(token=token, plaintext=plaintext)


def revoke_management_token(token: ManagementToken, *, actor: str) -> bool:
    """True if this call revoked the token, False if it already was revoked."""
    with transaction.atomic():
        now = timezone.now()
        changed = ManagementToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if changed:
            token.revoked_at = now
            record_audit_event(
                tenant=token.tenant, actor=actor, action="token.revoked", target=token.public_id,
                data={"name": token.name},
            )
    return bool(changed)


# -- sub-limits, project and key edits, plans, tenant names -------------------------------------

PROJECT_EDIT_FIELDS: tuple[str, ...] = ("name", "tokens_per_day", "tokens_per_month")
KEY_EDIT_FIELDS: tuple[str, ...] = (
    "name",
    "tokens_per_day",
    "tokens_per_month",
    "requests_per_minute",
    "max_concurrency",
    "allowed_models",
)
PLAN_FIELDS: tuple[str, ...] = (
    "display_name",
    "tokens_per_day",
    "tokens_per_minute",
    "requests_per_second",
    "over_quota_policy",
    "queue_timeout_seconds",
    "queue_priority",
    "soft_limit_percent",
    "fallback_model",
    "safety_factor",
    "allowed_models",
    "shrink_hold_to_headroom",
)


def _at_most(
    errors: dict[str, str], field_name: str, value: int | None, bound: int | None, what: str
) -> None:
    # A sub-limit can only narrow: None (no sub-limit) and an unlimited bound always pass.
    if value is None or bound is None or bound == UNLIMITED or field_name in errors:
        return
    if value > bound:
        errors[field_name] = f"Must be at most {bound:,}, {what}."


def check_project_limits(
    tenant: Tenant, *, tokens_per_day: int | None, tokens_per_month: int | None
) -> None:
    """ValidationError (per field) if a project's sub-limits exceed the tenant's effective
    limits: the daily limit and the monthly token budget."""
    limits = effective_limits(tenant)
    errors: dict[str, str] = {}
    _at_most(errors, "tokens_per_day", tokens_per_day, limits.tokens_per_day,
             "the tenant's daily token limit")
    _at_most(errors, "tokens_per_month", tokens_per_month, limits.monthly_token_budget,
             "the tenant's monthly token budget")
    if errors:
        raise ValidationError(errors)


def check_key_limits(
    project: Project,
    *,
    tokens_per_day: int | None,
    tokens_per_month: int | None,
    requests_per_minute: int | None,
    allowed_models: list[str],
) -> None:
    """ValidationError (per field) if a key's sub-limits exceed its project's or its tenant's,
    or it names models its tenant's plan does not allow."""
    tenant = project.tenant
    limits = effective_limits(tenant)
    errors: dict[str, str] = {}
    _at_most(errors, "tokens_per_day", tokens_per_day, project.tokens_per_day,
             "the project's daily token limit")
    _at_most(errors, "tokens_per_day", tokens_per_day, limits.tokens_per_day,
             "the tenant's daily token limit")
    _at_most(errors, "tokens_per_month", tokens_per_month, project.tokens_per_month,
             "the project's monthly token limit")
    _at_most(errors, "tokens_per_month", tokens_per_month, limits.monthly_token_budget,
             "the tenant's monthly token budget")
    per_minute = (UNLIMITED if limits.requests_per_second == UNLIMITED
                  else limits.requests_per_second * 60)
    _at_most(errors, "requests_per_minute", requests_per_minute, per_minute,
             "the tenant's request rate (60 x requests per second)")
    if limits.allowed_models and isinstance(allowed_models, list):
        outside = [m for m in allowed_models if m not in limits.allowed_models]
        if outside:
            errors["allowed_models"] = (
                f"Not in the {limits.plan_name} plan: {', '.join(map(str, outside))}. "
                f"The plan allows: {', '.join(limits.allowed_models)}."
            )
    if errors:
        raise ValidationError(errors)


def _check_edit_names(changes: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(changes) - set(allowed))
    if unknown:
        raise ValueError(f"Unknown {what} field(s): {', '.join(unknown)}; known: {', '.join(allowed)}")


def _diff(instance: models.Model, changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {"from": getattr(instance, name), "to": value}
        for name, value in changes.items()
        if getattr(instance, name) != value
    }


def update_project(project: Project, *, actor: str, **changes: Any) -> Project:
    """Rename a project or change its sub-limits (None removes one), within the tenant's limits."""
    _check_edit_names(changes, PROJECT_EDIT_FIELDS, "project")
    with transaction.atomic():
        locked = (
            Project.objects.select_for_update(of=("self",)).select_related("tenant__plan")
            .get(pk=project.pk)
        )
        diff = _diff(locked, changes)
        for name, value in changes.items():
            setattr(locked, name, value)
        _clean(locked)
        check_project_limits(
            locked.tenant, tokens_per_day=locked.tokens_per_day,
            tokens_per_month=locked.tokens_per_month,
        )
        if diff:
            locked.save(update_fields=list(diff))
            record_audit_event(
                tenant=locked.tenant, actor=actor, action="project.updated",
                target=locked.public_id, data={"changes": diff},
            )
            publish("tenant", locked.tenant_id)  # gateways cache projects with the keys
    for name in PROJECT_EDIT_FIELDS:
        setattr(project, name, getattr(locked, name))
    return project


def update_key(api_key: ApiKey, *, actor: str, **changes: Any) -> ApiKey:
    """Rename a key or change its sub-limits and models (None removes a sub-limit), within its
    project's and tenant's limits. A revoked key cannot be changed."""
    _check_edit_names(changes, KEY_EDIT_FIELDS, "API key")
    with transaction.atomic():
        locked = _lock_api_key(api_key)
        if locked.revoked_at is not None:
            raise ValidationError("This key is revoked; it cannot be changed.")
        diff = _diff(locked, changes)
        for name, value in changes.items():
            setattr(locked, name, value)
        _clean(locked)
        check_key_limits(
            locked.project, tokens_per_day=locked.tokens_per_day,
            tokens_per_month=locked.tokens_per_month,
            requests_per_minute=locked.requests_per_minute, allowed_models=locked.allowed_models,
        )
        if diff:
            locked.save(update_fields=list(diff))
            record_audit_event(
                tenant=locked.project.tenant, actor=actor, action="key.updated",
                target=locked.public_id, data={"changes": diff},
            )
            publish("api_key", locked.pk)  # sub-limits and models are cached by the gateways
    for name in KEY_EDIT_FIELDS:
        setattr(api_key, name, getattr(locked, name))
    return api_key


def rename_tenant(tenant: Tenant, name: str, *, actor: str) -> Tenant:
    name = name.strip()
    if not name:
        raise ValidationError({"name": "A tenant needs a name."})
    with transaction.atomic():
        locked = _lock_tenant(tenant)
        previous = locked.name
        if previous != name:
            locked.name = name
            _clean(locked)
            locked.save(update_fields=["name"])
            record_audit_event(
                tenant=locked, actor=actor, action="tenant.renamed", target=locked.public_id,
                data={"from": previous, "to": name},
            )
    tenant.name = name
    return tenant


def _plan_data(plan: Plan) -> dict[str, Any]:
    # JSON-safe, for the audit trail.
    return {name: str(value) if name == "safety_factor" else value
            for name, value in ((n, getattr(plan, n)) for n in PLAN_FIELDS)}


def create_plan(name: str, *, actor: str, **fields: Any) -> Plan:
    _check_edit_names(fields, PLAN_FIELDS, "plan")
    with transaction.atomic():
        plan = Plan(name=name, **fields)
        if not plan.display_name:
            plan.display_name = name
        _clean(plan)
        _insert_with_slug(plan, taken=Plan.objects.filter(name=name), kind="plan", slug=name)
        record_audit_event(
            actor=actor, action="plan.created", target=plan.name, data=_plan_data(plan)
        )
    return plan


def update_plan(plan: Plan, *, actor: str, **changes: Any) -> Plan:
    """Change a plan's limits or policy; every gateway hears of it and applies it to the next
    request of every tenant on the plan."""
    _check_edit_names(changes, PLAN_FIELDS, "plan")
    with transaction.atomic():
        locked = Plan.objects.select_for_update().get(pk=plan.pk)
        before = _plan_data(locked)
        for name, value in changes.items():
            setattr(locked, name, value)
        _clean(locked)
        after = _plan_data(locked)
        diff = {n: {"from": before[n], "to": after[n]} for n in PLAN_FIELDS if before[n] != after[n]}
        if diff:
            locked.save()
            record_audit_event(
                actor=actor, action="plan.updated", target=locked.name, data={"changes": diff}
            )
            publish("plan", locked.pk)
    for name in PLAN_FIELDS:
        setattr(plan, name, getattr(locked, name))
    return plan
