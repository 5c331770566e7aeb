"""Which counters exist: the one definition of every quota counter, with its limit, its label and
the reason a refusal by it is counted under.

Each counter is stated once here: its scope (`quotas.keys`), window, unit (tokens or
micro-dollars), limit, the name a person reads (tenant name, project slug, key name, model) and
its refusal reason code (a key of REFUSAL_REASONS). The readers all come here:

- the gateway reserves `request_counters` (cached per key and model in gateway.auth.KeyContext),
  and a refusal is counted under the full counter's `reason` (quotas.engine.CounterState);
- the status page, the API and `manage.py quota_show` show `standing_counters` (quotas/status.py);
- alerts watch the limited tenant and project counters of `standing_counters` (billing/alerts.py);
- the rebuild restores `request_counters` from the ledger (billing/rebuild.py);
- `manage.py quota_recharge` tops up `tenant_counter` / `project_counter`.

Limits live in PostgreSQL (plans, tenant overrides, project and key sub-limits) and travel to the
reserve script as ARGV on every request, so a plan change takes effect on the next request.
Scopes without a limit are still counted where a dashboard needs the figure (tenant month,
project, key and model per day); monthly project and key counters exist only when limited, the
tenant's minute counter only under a tokens-per-minute limit and its spend counter (micro-dollars)
only under a spend budget.

Pace counters (the burn-rate breaker, quotas/pace.py) exist only under a pace rule: per pace
period, a share of the tenant's, project's or key's daily token limit (for a scope that has one),
and a spend in micro-dollars (the tenant's from its plan or override, a project's or key's own).
They are reserved with the others and refuse with `spend_rate_exceeded`; they are not shown as
standing counters and not rebuilt from the ledger (a period is minutes long).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quotas import keys
from quotas.engine import UNLIMITED, ScopeLimit, Unit
from quotas.pace import PaceLimit
from quotas.windows import WindowKind, pace_kind

if TYPE_CHECKING:  # annotations only: the reason codes import without the models
    from tenants.models import ApiKey, Project, Tenant
    from tenants.selectors import AllotmentSums, EffectiveLimits

# -- whose counter --------------------------------------------------------------------------------

TENANT, PROJECT, KEY, MODEL = "tenant", "project", "key", "model"

# -- why a request was refused: the refused-today reasons ------------------------------------------

# A full token quota, per kind of counter.
QUOTA_TENANT = "quota_tenant"
QUOTA_PROJECT = "quota_project"
QUOTA_KEY = "quota_key"
QUOTA_MODEL = "quota_model"
# The tenant's shared pool is used up: what is left of its quota is other scopes' allotments.
QUOTA_POOL = "quota_pool"
TOKENS_PER_MINUTE = "tokens_per_minute"
SPEND_BUDGET = "spend_budget"
# Refusals that are not a full counter.
QUEUE_TIMEOUT = "queue_timeout"
QUEUE_FULL = "queue_full"  # the tenant already had its bound of waiters (queue policy)
RATE_LIMIT = "rate_limit"
CONCURRENCY = "concurrency"
MODEL_NOT_ALLOWED = "model_not_allowed"
MODEL_NOT_PRICED = "model_not_priced"
# A pace counter is full: the scope spends far above its pace (the burn-rate breaker).
SPEND_RATE_EXCEEDED = "spend_rate_exceeded"
# Every upstream key for the model was resting: circuit breakers open (gateway/circuit.py).
UPSTREAM_UNAVAILABLE = "upstream_unavailable"

_QUOTA_REASON = {TENANT: QUOTA_TENANT, PROJECT: QUOTA_PROJECT, KEY: QUOTA_KEY, MODEL: QUOTA_MODEL}

# The field names of the refused-requests hash (quotas.keys.refused_key), and what the console
# shows for each.
REFUSAL_REASONS: dict[str, str] = {
    QUOTA_TENANT: "Tenant token quota used up",
    QUOTA_PROJECT: "Project token quota used up",
    QUOTA_KEY: "API key token quota used up",
    QUOTA_MODEL: "Model's daily token limit used up",
    QUOTA_POOL: "Tenant's shared pool used up (the rest is reserved as other allotments)",
    TOKENS_PER_MINUTE: "Tokens-per-minute limit reached",
    SPEND_BUDGET: "Monthly spend budget used up",
    QUEUE_TIMEOUT: "Waited in the over-quota queue and timed out",
    QUEUE_FULL: "The over-quota queue was full",
    RATE_LIMIT: "Request rate limit reached",
    CONCURRENCY: "Too many requests in flight",
    MODEL_NOT_ALLOWED: "Model not allowed for the API key",
    MODEL_NOT_PRICED: "Model has no price on this gateway",
    SPEND_RATE_EXCEEDED: "Spending far above its pace (burn-rate breaker tripped)",
    UPSTREAM_UNAVAILABLE: "Every upstream for the model was failing (circuit breakers open)",
}


@dataclass(frozen=True)
class Counter:
    """One counter: whose it is, and what the engine is given (scope, window, unit, limit, label,
    refusal reason)."""

    kind: str  # tenant / project / key / model
    ref: str  # the tenant's, project's or key's public id, or the model name
    scope_limit: ScopeLimit

    @property
    def scope(self) -> str:
        return self.scope_limit.scope

    @property
    def window(self) -> WindowKind:
        return self.scope_limit.window

    @property
    def unit(self) -> Unit:
        return self.scope_limit.unit

    @property
    def limit(self) -> int:
        return self.scope_limit.limit

    @property
    def label(self) -> str:
        return self.scope_limit.label

    @property
    def reason(self) -> str:
        return self.scope_limit.reason


def _limit(value: int | None) -> int:
    return UNLIMITED if value is None else value


def _counter(kind: str, ref: str, label: str, scope: str, window: WindowKind, limit: int,
             unit: Unit = Unit.TOKENS, reason: str | None = None) -> Counter:
    # Allotment tiers and the pool are never waited for under the queue policy: a call of a
    # protected project touches the pool too, and would otherwise queue behind callers waiting
    # for the pool although its own allotment has room. A short pool answers at once.
    return Counter(kind, ref, ScopeLimit(scope, window, limit, unit, label=label,
                                         reason=reason or _QUOTA_REASON[kind],
                                         queueable=not unit.tiered))


# -- one counter ----------------------------------------------------------------------------------


def tenant_counter(tenant: Tenant, limits: EffectiveLimits, window: WindowKind) -> Counter:
    """The tenant's token counter of the day (its daily limit) or month (its monthly budget)."""
    limit = limits.tokens_per_day if window is WindowKind.DAY else limits.monthly_token_budget
    return _counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(), window, limit)


def project_counter(project: Project, window: WindowKind) -> Counter:
    limit = project.tokens_per_day if window is WindowKind.DAY else project.tokens_per_month
    return _counter(PROJECT, project.public_id, project.slug, keys.project_scope(project.pk),
                    window, _limit(limit))


def key_counter(api_key: ApiKey, window: WindowKind) -> Counter:
    limit = api_key.tokens_per_day if window is WindowKind.DAY else api_key.tokens_per_month
    return _counter(KEY, api_key.public_id, api_key.name or api_key.public_id,
                    keys.api_key_scope(api_key.pk), window, _limit(limit))


def model_counter(limits: EffectiveLimits, model: str) -> Counter:
    """A model's daily token counter (ValueError for a name that cannot be a scope)."""
    return _counter(MODEL, model, model, keys.model_scope(model), WindowKind.DAY,
                    limits.model_tokens_per_day.get(model, UNLIMITED))


def tokens_per_minute_counter(tenant: Tenant, limits: EffectiveLimits) -> Counter | None:
    """The tenant's minute counter, under a tokens-per-minute limit only."""
    if limits.tokens_per_minute == UNLIMITED:
        return None
    return _counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(),
                    WindowKind.MINUTE, limits.tokens_per_minute, reason=TOKENS_PER_MINUTE)


def spend_counter(tenant: Tenant, limits: EffectiveLimits) -> Counter | None:
    """The tenant's monthly spend in micro-dollars, under a spend budget only."""
    if limits.monthly_spend_budget_micros == UNLIMITED:
        return None
    return _counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(), WindowKind.MONTH,
                    limits.monthly_spend_budget_micros, Unit.MICROS, reason=SPEND_BUDGET)


def _pace(kind: str, ref: str, label: str, scope: str, limits: EffectiveLimits, limit: int,
          unit: Unit, rule: str) -> Counter:
    window = pace_kind(limits.pace_period_seconds)
    return Counter(kind, ref, PaceLimit(scope, window, limit, unit, label=label,
                                        reason=SPEND_RATE_EXCEEDED,
                                        cooldown_s=limits.pace_cooldown_seconds,
                                        owner=f"{kind}:{ref}", rule=rule))


def _share_counter(kind: str, ref: str, label: str, scope: str, limits: EffectiveLimits,
                   share: int, day_limit: int | None) -> Counter | None:
    """A share of the scope's daily token limit per period (none without a daily limit: there
    is nothing to take a share of; a daily limit of 0 refuses everything already)."""
    if share == UNLIMITED or day_limit is None or day_limit <= 0:
        return None
    limit = max(1, day_limit * share // 100)
    rule = (f"{share}% of {day_limit:,} tokens a day = {limit:,} tokens per "
            f"{limits.pace_period_seconds} s")
    return _pace(kind, ref, label, scope, limits, limit, Unit.TOKENS, rule)


def _spend_counter(kind: str, ref: str, label: str, scope: str, limits: EffectiveLimits,
                   micros: int | None) -> Counter | None:
    if micros is None or micros == UNLIMITED:
        return None
    rule = f"{micros:,} micro-dollars per {limits.pace_period_seconds} s"
    return _pace(kind, ref, label, scope, limits, micros, Unit.MICROS, rule)


def pace_counters(tenant: Tenant, limits: EffectiveLimits, project: Project,
                  api_key: ApiKey) -> tuple[Counter, ...]:
    """The pace counters of a call with this key: the tenant's, the project's and the key's
    share of their daily limits, and the tenant's, project's and key's spend pace, where set.
    The share of a project or key is its own, else the tenant's (tenants.selectors.pace_share)."""
    key_label = api_key.name or api_key.public_id
    project_share = limits.pace_share_percent if project.pace_share_percent is None \
        else project.pace_share_percent
    key_share = limits.pace_share_percent if api_key.pace_share_percent is None \
        else api_key.pace_share_percent
    found = (
        _share_counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(), limits,
                       limits.pace_share_percent, limits.tokens_per_day),
        _share_counter(PROJECT, project.public_id, project.slug, keys.project_scope(project.pk),
                       limits, project_share, project.tokens_per_day),
        _share_counter(KEY, api_key.public_id, key_label, keys.api_key_scope(api_key.pk),
                       limits, key_share, api_key.tokens_per_day),
        _spend_counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(), limits,
                       limits.pace_spend_micros),
        _spend_counter(PROJECT, project.public_id, project.slug, keys.project_scope(project.pk),
                       limits, project.pace_spend_micros),
        _spend_counter(KEY, api_key.public_id, key_label, keys.api_key_scope(api_key.pk),
                       limits, api_key.pace_spend_micros),
    )
    return tuple(c for c in found if c is not None)


# -- allotments: a chain of tiers per window -------------------------------------------------------


def tenant_window_limit(limits: EffectiveLimits, window: WindowKind) -> int:
    """The tenant's token quota of a window that allotments are carved from (day or cycle)."""
    return limits.tokens_per_day if window is WindowKind.DAY else limits.monthly_token_budget


def own_allotment(scope: Project | ApiKey, window: WindowKind) -> int | None:
    """A project's or key's allotment in a window; None when it has none (0 is an allotment:
    a project allotted 0 still nests its keys, tenants/allotments.py)."""
    return (scope.allotment_tokens_per_day if window is WindowKind.DAY
            else scope.allotment_tokens_per_month)


def allotment_chain(tenant: Tenant, limits: EffectiveLimits, project: Project, api_key: ApiKey,
                    window: WindowKind, sums: AllotmentSums) -> tuple[Counter, ...]:
    """The tiers a call of this key takes from in `window` (lua/lib/tiers.lua): the key's
    allotment, then its project's (the part its keys are not allotted), then the tenant's shared
    pool (its quota minus the top-level allotments, never below 0). None while the tenant has
    no allotment in the window, or no quota there to carve from."""
    quota = tenant_window_limit(limits, window)
    allotted = sums.tenant_day if window is WindowKind.DAY else sums.tenant_month
    if quota == UNLIMITED or allotted <= 0:
        return ()
    chain = []
    key_allotment = own_allotment(api_key, window)
    if key_allotment is not None and api_key.revoked_at is None:
        chain.append(_counter(KEY, api_key.public_id, api_key.name or api_key.public_id,
                              keys.api_key_scope(api_key.pk), window, key_allotment,
                              Unit.ALLOTMENT))
    project_allotment = own_allotment(project, window)
    if project_allotment is not None:
        to_keys = sums.project_keys_day if window is WindowKind.DAY else sums.project_keys_month
        chain.append(_counter(PROJECT, project.public_id, project.slug,
                              keys.project_scope(project.pk), window,
                              max(0, project_allotment - to_keys), Unit.ALLOTMENT))
    chain.append(_counter(TENANT, tenant.public_id, tenant.name, keys.tenant_scope(), window,
                          max(0, quota - allotted), Unit.POOL, reason=QUOTA_POOL))
    return tuple(chain)


# -- the lists ------------------------------------------------------------------------------------


def project_counters(project: Project) -> tuple[Counter, ...]:
    """A project's day counter, and its month counter while it has a monthly limit."""
    day = project_counter(project, WindowKind.DAY)
    if project.tokens_per_month is None:
        return (day,)
    return (day, project_counter(project, WindowKind.MONTH))


def key_counters(api_key: ApiKey) -> tuple[Counter, ...]:
    """A key's day counter, and its month counter while it has a monthly limit."""
    day = key_counter(api_key, WindowKind.DAY)
    if api_key.tokens_per_month is None:
        return (day,)
    return (day, key_counter(api_key, WindowKind.MONTH))


def request_counters(tenant: Tenant, limits: EffectiveLimits, project: Project,
                     api_key: ApiKey, model: str,
                     allotments: AllotmentSums | None = None) -> tuple[Counter, ...]:
    """The counters a call of `model` with this key is checked against and charged to, in the
    order reserve checks them (the first full one is the refusal reported): tenant day and
    month, project day, key day, model day, then the project's and key's months where limited,
    the tenant's minute under a tokens-per-minute limit and its spend under a spend budget, then
    the pace counters (`pace_counters`: last, so a full quota is reported as such), then the
    allotment chains of the day and the cycle (`allotment_chain`; after the tenant's own
    counters, so a full tenant quota is reported as such, a short pool as `quota_pool`).
    `allotments`: the tenant's sums (the gateway's key lookup reads them with the key); queried
    when not given. ValueError when `model` cannot be a scope."""
    if allotments is None:
        from tenants.selectors import allotment_sums  # noqa: PLC0415 - a query, off the hot path

        allotments = allotment_sums(project)
    project_day, *project_month = project_counters(project)
    key_day, *key_month = key_counters(api_key)
    extra = (tokens_per_minute_counter(tenant, limits), spend_counter(tenant, limits))
    return (
        tenant_counter(tenant, limits, WindowKind.DAY),
        tenant_counter(tenant, limits, WindowKind.MONTH),
        project_day,
        key_day,
        model_counter(limits, model),
        *project_month,
        *key_month,
        *(c for c in extra if c is not None),
        *pace_counters(tenant, limits, project, api_key),
        *allotment_chain(tenant, limits, project, api_key, WindowKind.DAY, allotments),
        *allotment_chain(tenant, limits, project, api_key, WindowKind.MONTH, allotments),
    )


def request_limits(tenant: Tenant, limits: EffectiveLimits, project: Project, api_key: ApiKey,
                   model: str, allotments: AllotmentSums | None = None) -> tuple[ScopeLimit, ...]:
    """What reserve is given for such a call: `request_counters`' ScopeLimits."""
    return tuple(c.scope_limit for c in request_counters(tenant, limits, project, api_key, model,
                                                         allotments))


def standing_counters(tenant: Tenant, limits: EffectiveLimits, projects: Iterable[Project],
                      api_keys: Iterable[ApiKey]) -> tuple[Counter, ...]:
    """The day and month token counters of a tenant that dashboards show: the tenant's, these
    projects' and keys' (months where limited), and each model with a daily limit."""
    return (
        tenant_counter(tenant, limits, WindowKind.DAY),
        tenant_counter(tenant, limits, WindowKind.MONTH),
        *(c for project in projects for c in project_counters(project)),
        *(c for api_key in api_keys for c in key_counters(api_key)),
        *(model_counter(limits, model) for model in sorted(limits.model_tokens_per_day)),
    )
