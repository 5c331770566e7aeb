"""Tenants: creating one, its plan, its limit overrides, its status and its name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.exceptions import TenantNotFound
from tenants.models import Plan, Tenant
from tenants.selectors import plan_by_name
from tenants.services._base import (
    Entity,
    check_field_names,
    clean,
    Diff,
    from_to,
    insert_with_slug,
    record_change,
    update,
)

# What set_tenant_limits (and create_tenant's **overrides) may change.
TENANT_OVERRIDE_FIELDS: tuple[str, ...] = (
    "tokens_per_day",
    "tokens_per_minute",
    "requests_per_second",
    "monthly_token_budget",
    "monthly_spend_budget_micros",
    "model_tokens_per_day",
    "alert_thresholds",
    # quota.forecast warnings (billing/forecast_alerts.py): percent of a limit; 0 is off.
    "forecast_threshold_percent",
    # The burn-rate breaker (quotas/pace.py): None inherits the plan's, -1 switches share or
    # spend off.
    "pace_share_percent",
    "pace_spend_micros",
    "pace_period_seconds",
    "pace_cooldown_seconds",
)


def _lock_tenant(tenant: Tenant) -> Tenant:
    # Row lock so concurrent edits of one tenant serialise instead of losing an update.
    try:
        return (
            Tenant.objects.select_for_update(of=("self",)).select_related("plan").get(pk=tenant.pk)
        )
    except Tenant.DoesNotExist:
        raise TenantNotFound(tenant.slug) from None


TENANT: Entity[Tenant] = Entity(
    lock=_lock_tenant,
    tenant=lambda tenant: tenant,
    target=lambda tenant: tenant.public_id,
    invalidation=lambda tenant: ("tenant", tenant.pk),  # its keys' contexts carry its limits
)


def create_tenant(
    slug: str, *, plan_name: str, actor: str, name: str = "", **overrides: Any
) -> Tenant:
    check_field_names(overrides, TENANT_OVERRIDE_FIELDS, "tenant limit")
    with transaction.atomic():
        plan = plan_by_name(plan_name)
        tenant = Tenant(slug=slug, name=name or slug, plan=plan, **overrides)
        clean(tenant)
        insert_with_slug(tenant, taken=Tenant.objects.filter(slug=slug), kind="tenant", slug=slug)
        record_change(
            TENANT, tenant, actor=actor, action="tenant.created", publish=False,
            data={"slug": slug, "name": tenant.name, "plan": plan.name, "overrides": overrides},
        )
    return tenant


# A plan decides its tenants' cycle (Plan.reset_cycle, allows_custom_cycle), so a move to another
# plan may move the tenant's windows. The rule that schedules that (the current window finishes
# first) needs the quota engine's calendar and the Redis clock, which tenants/ cannot import:
# quotas.apps installs quotas.cycles.plan_cycle_rule here. It gets the locked tenant (still on its
# old plan) and the new plan, and returns the cycle fields to save with the plan.
PlanCycleRule = Callable[[Tenant, Plan], dict[str, Any]]
_plan_cycle_rule: PlanCycleRule | None = None


def set_plan_cycle_rule(rule: PlanCycleRule) -> None:
    global _plan_cycle_rule
    _plan_cycle_rule = rule


def _plan_change_data(diff: Diff) -> dict[str, Any]:
    data = from_to("plan", show=lambda plan: plan.name)(diff)
    switch = diff.get("cycle_changes_at")
    if switch is not None:
        # The plan's cycle takes over when the tenant's current window ends (quotas.cycles).
        moment = switch["to"]
        data["cycle_changes_at"] = moment.isoformat(timespec="seconds") if moment else None
    return data


def change_plan(tenant: Tenant, plan_name: str, *, actor: str) -> Tenant:
    """Move the tenant to another plan: its limits apply from the next request; a different
    reset cycle takes over when the tenant's current cycle window ends (quotas.cycles)."""
    plan = plan_by_name(plan_name)
    with transaction.atomic():
        locked = _lock_tenant(tenant)
        cycle = (_plan_cycle_rule(locked, plan)
                 if _plan_cycle_rule is not None and locked.plan_id != plan.pk else {})
        return update(
            TENANT, tenant, {"plan": plan, **cycle}, actor=actor, action="tenant.plan_changed",
            data=_plan_change_data,
        )


def set_tenant_limits(tenant: Tenant, *, actor: str, **overrides: Any) -> Tenant:
    """Set tenant overrides: None inherits the plan, UNLIMITED (-1) lifts the limit."""
    if not overrides:
        raise ValueError("No limits given")
    check_field_names(overrides, TENANT_OVERRIDE_FIELDS, "tenant limit")
    return update(
        TENANT, tenant, overrides, actor=actor, action="tenant.limits_changed",
        refresh=TENANT_OVERRIDE_FIELDS,
    )


def set_tenant_status(tenant: Tenant, status: str, *, actor: str) -> Tenant:
    if status not in Tenant.Status.values:
        raise ValueError(
            f"Unknown tenant status {status!r}; expected one of {', '.join(Tenant.Status.values)}"
        )
    return update(
        TENANT, tenant, {"status": status}, actor=actor, action="tenant.status_changed",
        data=from_to("status"),
    )


def rename_tenant(tenant: Tenant, name: str, *, actor: str) -> Tenant:
    name = name.strip()
    if not name:
        raise ValidationError({"name": "A tenant needs a name."})
    return update(
        TENANT, tenant, {"name": name}, actor=actor, action="tenant.renamed",
        data=from_to("name"), publish=False,  # the gateways do not cache names
    )
