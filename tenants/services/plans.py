"""Plans: creating, changing and deleting one. A change reaches every gateway, which applies it
to the next request of every tenant on the plan."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.models import Plan
from tenants.services._base import (
    Entity,
    check_field_names,
    clean,
    insert_with_slug,
    record_change,
    update,
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
    "pace_share_percent",
    "pace_spend_micros",
    "pace_period_seconds",
    "pace_cooldown_seconds",
    "responses_context_allowance_tokens",
)
# Set when a plan is created, fixed after: a plan's cycle is its tenants' windows, and changing it
# under them would cut every tenant's current window at once. Tenants move to another cycle one
# by one, by the change rule: a change of plan or of their own cycle (quotas.cycles).
PLAN_CREATE_FIELDS: tuple[str, ...] = (*PLAN_FIELDS, "reset_cycle", "allows_custom_cycle")

PLAN: Entity[Plan] = Entity(
    lock=lambda plan: Plan.objects.select_for_update().get(pk=plan.pk),
    tenant=lambda plan: None,  # the platform's trail: a plan belongs to no tenant
    target=lambda plan: plan.name,
    invalidation=lambda plan: ("plan", plan.pk),
)


def _plan_data(plan: Plan) -> dict[str, Any]:
    # JSON-safe, for the audit trail.
    return {name: str(value) if name == "safety_factor" else value
            for name, value in ((n, getattr(plan, n)) for n in PLAN_CREATE_FIELDS)}


def create_plan(name: str, *, actor: str, **fields: Any) -> Plan:
    check_field_names(fields, PLAN_CREATE_FIELDS, "plan")
    with transaction.atomic():
        plan = Plan(name=name, **fields)
        if not plan.display_name:
            plan.display_name = name
        clean(plan)
        insert_with_slug(plan, taken=Plan.objects.filter(name=name), kind="plan", slug=name)
        record_change(PLAN, plan, actor=actor, action="plan.created", data=_plan_data(plan),
                      publish=False)
    return plan


def update_plan(plan: Plan, *, actor: str, **changes: Any) -> Plan:
    """Change a plan's limits or policy; every gateway hears of it and applies it to the next
    request of every tenant on the plan."""
    check_field_names(changes, PLAN_FIELDS, "plan")
    return update(PLAN, plan, changes, actor=actor, action="plan.updated", refresh=PLAN_FIELDS)


def delete_plan(plan: Plan, *, actor: str) -> None:
    """Delete a plan no tenant is on (ValidationError otherwise); recorded with its limits."""
    with transaction.atomic():
        locked = PLAN.lock(plan)
        if locked.tenants.exists():
            raise ValidationError(f"Tenants are on the plan {locked.name!r}: move them first.")
        data = _plan_data(locked)
        locked.delete()
        # Nothing to publish: no tenant is on the plan, so no gateway holds it.
        record_change(PLAN, plan, actor=actor, action="plan.deleted", data=data, publish=False)
