"""Which counters a request is checked against, and with which limits.

Limits live in PostgreSQL (plans, tenant overrides, project and key sub-limits) and travel to the
reserve script as ARGV on every request, so a plan change takes effect on the next request.
Scopes without a limit are still counted where a dashboard needs the figure (tenant month,
project, key and model per day); monthly project and key counters exist only when limited.
"""
from __future__ import annotations

from quotas import keys
from quotas.engine import UNLIMITED, ScopeLimit
from quotas.windows import WindowKind
from tenants.models import ApiKey, Project
from tenants.selectors import EffectiveLimits


def _limit(value: int | None) -> int:
    return UNLIMITED if value is None else value


def tenant_tag(tenant_id: int) -> str:
    """The tenant id used in Redis key names (its hash tag)."""
    return str(tenant_id)


def scope_limits(
    limits: EffectiveLimits, project: Project, api_key: ApiKey, model: str
) -> tuple[ScopeLimit, ...]:
    day, month = WindowKind.DAY, WindowKind.MONTH
    scopes = [
        ScopeLimit(keys.tenant_scope(), day, limits.tokens_per_day),
        ScopeLimit(keys.tenant_scope(), month, limits.monthly_token_budget),
        ScopeLimit(keys.project_scope(project.pk), day, _limit(project.tokens_per_day)),
        ScopeLimit(keys.api_key_scope(api_key.pk), day, _limit(api_key.tokens_per_day)),
        ScopeLimit(keys.model_scope(model), day, limits.model_tokens_per_day.get(model, UNLIMITED)),
    ]
    if project.tokens_per_month is not None:
        scopes.append(ScopeLimit(keys.project_scope(project.pk), month, project.tokens_per_month))
    if api_key.tokens_per_month is not None:
        scopes.append(ScopeLimit(keys.api_key_scope(api_key.pk), month, api_key.tokens_per_month))
    return tuple(scopes)
