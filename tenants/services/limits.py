"""Sub-limits can only narrow: a project's within its tenant's effective limits, a key's within
its project's and its tenant's, a key's models within its tenant's plan. The console, the API
and Django admin check here before they change a project or a key."""

from __future__ import annotations

from django.core.exceptions import ValidationError

from tenants.models import UNLIMITED, Project, Tenant
from tenants.selectors import effective_limits


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
