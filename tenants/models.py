"""Tenants, plans, projects, API keys and the audit trail: the truth that PostgreSQL holds.

Limits convention. Every limit is a BigIntegerField. In a Plan, UNLIMITED (-1) means explicitly
no limit and 0 means nothing is allowed. In a Tenant override, NULL means "inherit the plan" and
-1 means unlimited. Project and key sub-limits are NULL for "no sub-limit" and never negative:
a sub-limit can only narrow the tenant's limit, so "unlimited" would be the same as NULL.

Pace (the burn-rate breaker, quotas/pace.py). A plan may cap how fast a scope spends: at most
`pace_share_percent` % of the scope's daily token limit, and/or `pace_spend_micros` micro-dollars,
within one period of `pace_period_seconds`; a scope that goes over is closed for
`pace_cooldown_seconds` (rounded up to whole periods). In a Plan, NULL share or spend means no
such rule. A Tenant overrides each (NULL inherits, -1 switches the plan's rule off). A project's
or key's `pace_share_percent` overrides the tenant's share for that scope's own daily limit (NULL
inherits; 100 lets it spend a whole day in one period, i.e. no pace rule), and its
`pace_spend_micros` is a spend pace of its own (NULL: none).
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from tenants.api_key_format import DIGEST_LENGTH, LAST4_LENGTH, PREFIX_LENGTH, masked
from tenants.ids import (
    PUBLIC_ID_MAX_LENGTH,
    new_api_key_id,
    new_invitation_id,
    new_management_token_id,
    new_project_id,
    new_tenant_id,
)
from tenants.validators import (
    validate_alert_thresholds,
    validate_model_limits,
    validate_model_list,
    validate_time_zone,
)

UNLIMITED = -1

_AT_LEAST_UNLIMITED = [MinValueValidator(UNLIMITED)]
_NON_NEGATIVE = [MinValueValidator(0)]


# The pace periods offered (seconds): each divides an hour, so periods align to the clock.
PACE_PERIOD_CHOICES: list[tuple[int, str]] = [
    (1, "1 second"), (2, "2 seconds"), (5, "5 seconds"), (10, "10 seconds"), (30, "30 seconds"),
    (60, "1 minute"), (300, "5 minutes"), (600, "10 minutes"), (900, "15 minutes"),
    (1200, "20 minutes"), (1800, "30 minutes"), (3600, "1 hour"),
]
PACE_PERIODS: tuple[int, ...] = tuple(seconds for seconds, _ in PACE_PERIOD_CHOICES)
PACE_COOLDOWN_MAX_SECONDS = 86400
_SHARE = [MinValueValidator(1), MaxValueValidator(100)]
_POSITIVE = [MinValueValidator(1)]
_COOLDOWN = [MinValueValidator(1), MaxValueValidator(PACE_COOLDOWN_MAX_SECONDS)]


def _share_or_off(value: int | None) -> None:
    # A tenant's share override: NULL inherits, -1 switches the plan's rule off, else 1..100.
    if value is not None and value != UNLIMITED and not 1 <= value <= 100:
        raise ValidationError("Enter a percentage from 1 to 100, or -1 to switch pace off.")


def _spend_or_off(value: int | None) -> None:
    if value is not None and value != UNLIMITED and value < 1:
        raise ValidationError("Enter at least 1 micro-dollar, or -1 to switch pace off.")


def _pace_period(value: int | None) -> None:
    if value is not None and value not in PACE_PERIODS:
        raise ValidationError(
            f"Choose a period of {', '.join(map(str, PACE_PERIODS))} seconds.")


# A trip closes every pace period of its cool-down in one script call (lua/pace_trip.lua), one
# counter key each: bounded so that no trip holds Redis for long (3,600 keys: a 1-second period
# may cool down for an hour, a 10-second one for 10 hours).
PACE_COOLDOWN_MAX_PERIODS = 3600


def pace_cooldown_error(period_s: int | None, cooldown_s: int | None) -> str | None:
    """Why this period and cool-down cannot go together, or None."""
    if period_s and cooldown_s and cooldown_s > PACE_COOLDOWN_MAX_PERIODS * period_s:
        return (f"A cool-down may last at most {PACE_COOLDOWN_MAX_PERIODS:,} pace periods "
                f"({PACE_COOLDOWN_MAX_PERIODS * period_s:,} s for a {period_s}-second period).")
    return None


def _default_alert_thresholds() -> list[int]:
    return [10, 5]


def _min_value_constraints(
    model_label: str, fields: tuple[str, ...], minimum: int
) -> list[models.BaseConstraint]:
    # The validators only run in full_clean(); these make the database refuse the same values
    # when something writes around the services (admin bulk edits, raw updates, shell).
    return [
        models.CheckConstraint(
            condition=models.Q(**{f"{field}__gte": minimum}), name=f"{model_label}_{field}_min"
        )
        for field in fields
    ]


class OverQuotaPolicy(models.TextChoices):
    REJECT = "reject", "Reject (HTTP 429)"
    QUEUE = "queue", "Queue, then reject"
    SOFT = "soft", "Soft limit (admit over the limit up to a ceiling)"
    FALLBACK = "fallback", "Fall back to a cheaper model"


class ResetCycle(models.TextChoices):
    """A plan's cycle: the window of the 'month' counters (budgets, project and key monthly
    limits and allotments) of its tenants, unless a tenant has a cycle of its own."""

    DAILY = "daily", "Daily"
    MONTHLY = "monthly", "Monthly (calendar month)"


class TenantCycle(models.TextChoices):
    """A tenant's own cycle (plans that allow it): '' follows the plan's reset cycle."""

    PLAN = "", "The plan's"
    MONTHLY = "monthly", "Monthly from a billing day"
    WEEKLY = "weekly", "Weekly"
    DAYS = "days", "Every N days"


class Plan(models.Model):
    name = models.SlugField(max_length=50, unique=True)
    display_name = models.CharField(max_length=100)
    tokens_per_day = models.BigIntegerField(validators=_AT_LEAST_UNLIMITED)
    tokens_per_minute = models.BigIntegerField(default=UNLIMITED, validators=_AT_LEAST_UNLIMITED)
    requests_per_second = models.BigIntegerField(validators=_AT_LEAST_UNLIMITED)
    over_quota_policy = models.CharField(
        max_length=16, choices=OverQuotaPolicy.choices, default=OverQuotaPolicy.REJECT
    )
    queue_timeout_seconds = models.PositiveIntegerField(default=0)
    queue_priority = models.IntegerField(default=0, help_text="Higher is served first.")
    soft_limit_percent = models.PositiveIntegerField(
        default=100,
        # Below 100 a "soft" limit would be stricter than the hard one.
        validators=[MinValueValidator(100)],
        help_text="With the soft policy, admit requests up to this percentage of the limit.",
    )
    fallback_model = models.CharField(max_length=200, blank=True)
    safety_factor = models.DecimalField(
        max_digits=4,
        decimal_places=2,
        default=Decimal("1.25"),
        # Below 1 the hold would be smaller than the estimate, breaking "the hold bounds the bill".
        validators=[MinValueValidator(Decimal("1"))],
    )
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_model_list],
        help_text="Model names this plan may use; empty means every model.",
    )
    shrink_hold_to_headroom = models.BooleanField(default=True)
    pace_share_percent = models.SmallIntegerField(
        null=True, blank=True, validators=_SHARE,
        help_text="Burn-rate breaker: at most this percent of a scope's daily token limit within "
        "one pace period (tenant, and each project and key with a daily limit). Empty: none.",
    )
    pace_spend_micros = models.BigIntegerField(
        null=True, blank=True, validators=_POSITIVE,
        help_text="Burn-rate breaker: at most this many micro-dollars per pace period for the "
        "tenant. Empty: none.",
    )
    pace_period_seconds = models.PositiveIntegerField(
        default=600, choices=PACE_PERIOD_CHOICES, help_text="The pace period.")
    pace_cooldown_seconds = models.PositiveIntegerField(
        default=1800, validators=_COOLDOWN,
        help_text="How long a scope that went over its pace stays closed (rounded up to whole "
        "periods); then it admits a period's share again.",
    )
    responses_context_allowance_tokens = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Responses API: tokens held for the earlier turns of a previous_response_id or "
        "conversation this gateway has not seen (made elsewhere, or expired here). Empty: such "
        "a call is refused (400), since its context cannot be held for honestly.",
    )
    reset_cycle = models.CharField(
        max_length=8, choices=ResetCycle.choices, default=ResetCycle.MONTHLY,
        help_text="When the tenant's cycle quotas (the 'month' budgets) reset: every day, or "
        "every calendar month, at midnight in the tenant's time zone.",
    )
    allows_custom_cycle = models.BooleanField(
        default=False,
        help_text="Its tenants may have a cycle of their own (anchored on a billing day, "
        "weekly, or every N days).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            *_min_value_constraints(
                "plan", ("tokens_per_day", "tokens_per_minute", "requests_per_second"), UNLIMITED
            ),
            models.CheckConstraint(
                condition=models.Q(safety_factor__gte=Decimal("1")), name="plan_safety_factor_min"
            ),
            models.CheckConstraint(
                condition=models.Q(pace_share_percent__gte=1, pace_share_percent__lte=100),
                name="plan_pace_share_range",
            ),
            *_min_value_constraints("plan", ("pace_spend_micros", "pace_cooldown_seconds"), 1),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.over_quota_policy == OverQuotaPolicy.FALLBACK and not self.fallback_model:
            raise ValidationError({"fallback_model": "The fallback policy needs a fallback model."})
        error = pace_cooldown_error(self.pace_period_seconds, self.pace_cooldown_seconds)
        if error:
            raise ValidationError({"pace_cooldown_seconds": error})


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False, default=new_tenant_id
    )
    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="tenants")
    tokens_per_day = models.BigIntegerField(null=True, blank=True, validators=_AT_LEAST_UNLIMITED)
    tokens_per_minute = models.BigIntegerField(
        null=True, blank=True, validators=_AT_LEAST_UNLIMITED
    )
    requests_per_second = models.BigIntegerField(
        null=True, blank=True, validators=_AT_LEAST_UNLIMITED
    )
    monthly_token_budget = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    monthly_spend_budget_micros = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE, help_text="Micro-dollars (1e-6 USD)."
    )
    model_tokens_per_day = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_model_limits],
        help_text='Daily token limits of single models, e.g. {"gpt-4o": 1000000}. '
        "Models not listed are only bounded by the tenant's limits.",
    )
    alert_thresholds = models.JSONField(
        default=_default_alert_thresholds,
        blank=True,
        validators=[validate_alert_thresholds],
        help_text="Alert when this many percent of a quota or budget remain.",
    )
    pace_share_percent = models.SmallIntegerField(
        null=True, blank=True, validators=[_share_or_off],
        help_text="Overrides the plan's pace share (1-100 percent); -1: no pace share.",
    )
    pace_spend_micros = models.BigIntegerField(
        null=True, blank=True, validators=[_spend_or_off],
        help_text="Overrides the plan's spend pace (micro-dollars per period); -1: none.",
    )
    pace_period_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[_pace_period],
        help_text=f"Overrides the plan's pace period ({', '.join(map(str, PACE_PERIODS))} s).",
    )
    pace_cooldown_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=_COOLDOWN,
        help_text="Overrides the plan's pace cool-down (seconds).",
    )
    # The tenant's windows: its day and its cycle, at local midnight in its time zone.
    time_zone = models.CharField(
        max_length=64, default="UTC", validators=[validate_time_zone],
        help_text="IANA time zone of the tenant's days and cycle (e.g. Europe/Paris).",
    )
    cycle = models.CharField(
        max_length=8, choices=TenantCycle.choices, default=TenantCycle.PLAN, blank=True,
        help_text="A cycle of the tenant's own (plans that allow it); empty: the plan's.",
    )
    cycle_anchor = models.DateField(
        null=True, blank=True,
        help_text="Monthly: the billing day is its day of the month (31 ends on the month's "
        "last day); weekly: its weekday; every N days: the first day of a cycle.",
    )
    cycle_every_days = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(366)],
        help_text="Every N days: N.",
    )
    # A change of cycle or time zone waits for the current cycle to end (quotas/cycles.py):
    # what it will be, and when (the end of the window that was current when it was asked for).
    next_cycle = models.JSONField(null=True, blank=True, editable=False)
    cycle_changes_at = models.DateTimeField(null=True, blank=True, editable=False)
    forecast_threshold_percent = models.PositiveSmallIntegerField(
        default=80, validators=[MaxValueValidator(100)],
        help_text="Warn (quota.forecast) when a window's forecast reaches this percent of its "
        "limit; 0: no forecast warnings.",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            *_min_value_constraints(
                "tenant", ("tokens_per_day", "tokens_per_minute", "requests_per_second"), UNLIMITED
            ),
            *_min_value_constraints(
                "tenant", ("monthly_token_budget", "monthly_spend_budget_micros"), 0
            ),
            models.CheckConstraint(
                condition=models.Q(pace_share_percent=UNLIMITED)
                | models.Q(pace_share_percent__gte=1, pace_share_percent__lte=100),
                name="tenant_pace_share_range",
            ),
            *_min_value_constraints("tenant", ("pace_spend_micros",), UNLIMITED),
            *_min_value_constraints("tenant", ("pace_cooldown_seconds",), 1),
        ]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        # The effective pair: the tenant's overrides, else its plan's.
        plan = self.plan if self.plan_id else None
        period = self.pace_period_seconds or (plan.pace_period_seconds if plan else None)
        cooldown = self.pace_cooldown_seconds or (plan.pace_cooldown_seconds if plan else None)
        error = pace_cooldown_error(period, cooldown)
        if error:
            raise ValidationError({"pace_cooldown_seconds": error})


class Project(models.Model):
    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False, default=new_project_id
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="projects")
    slug = models.SlugField(max_length=63)
    name = models.CharField(max_length=200)
    tokens_per_day = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    tokens_per_month = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    pace_share_percent = models.SmallIntegerField(
        null=True, blank=True, validators=_SHARE,
        help_text="Pace share of the project's daily limit (percent per pace period); empty: "
        "the tenant's.",
    )
    pace_spend_micros = models.BigIntegerField(
        null=True, blank=True, validators=_POSITIVE,
        help_text="The project's spend pace (micro-dollars per pace period); empty: none.",
    )
    allotment_tokens_per_day = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Tokens per day reserved for it alone out of the tenant's daily quota.",
    )
    allotment_tokens_per_month = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Tokens per cycle reserved for it alone out of the tenant's cycle budget.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant_id", "slug"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "slug"], name="project_unique_slug_per_tenant"
            ),
            *_min_value_constraints("project", ("tokens_per_day", "tokens_per_month",
                                                "allotment_tokens_per_day",
                                                "allotment_tokens_per_month"), 0),
            models.CheckConstraint(
                condition=models.Q(pace_share_percent__gte=1, pace_share_percent__lte=100),
                name="project_pace_share_range",
            ),
            *_min_value_constraints("project", ("pace_spend_micros",), 1),
        ]

    def __str__(self) -> str:
        return self.slug


class ApiKey(models.Model):
    """The identity that carries limits and usage. It survives rotation: only secrets change."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False, default=new_api_key_id
    )
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True)
    tokens_per_day = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    tokens_per_month = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    requests_per_minute = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    max_concurrency = models.BigIntegerField(null=True, blank=True, validators=_NON_NEGATIVE)
    pace_share_percent = models.SmallIntegerField(
        null=True, blank=True, validators=_SHARE,
        help_text="Pace share of the key's daily limit (percent per pace period); empty: the "
        "tenant's.",
    )
    pace_spend_micros = models.BigIntegerField(
        null=True, blank=True, validators=_POSITIVE,
        help_text="The key's spend pace (micro-dollars per pace period); empty: none.",
    )
    allotment_tokens_per_day = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Tokens per day reserved for it alone out of the tenant's daily quota.",
    )
    allotment_tokens_per_month = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Tokens per cycle reserved for it alone out of the tenant's cycle budget.",
    )
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_model_list],
        help_text="Narrows the plan's models; empty means every model the plan allows.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=200, blank=True)

    class Meta:
        verbose_name = "API key"
        ordering = ["-created_at"]
        constraints = [
            *_min_value_constraints(
                "apikey",
                ("tokens_per_day", "tokens_per_month", "requests_per_minute", "max_concurrency",
                 "allotment_tokens_per_day", "allotment_tokens_per_month"),
                0,
            ),
            models.CheckConstraint(
                condition=models.Q(pace_share_percent__gte=1, pace_share_percent__lte=100),
                name="apikey_pace_share_range",
            ),
            *_min_value_constraints("apikey", ("pace_spend_micros",), 1),
        ]

    def __str__(self) -> str:
        return self.public_id


class ApiKeySecret(models.Model):
    """One issued secret of an ApiKey; rotation adds a row. Holds a digest, never the plaintext."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="secrets")
    prefix = models.CharField(max_length=PREFIX_LENGTH, unique=True, db_index=True)
    digest = models.CharField(max_length=DIGEST_LENGTH)
    last4 = models.CharField(max_length=LAST4_LENGTH)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key secret"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.masked

    @property
    def masked(self) -> str:
        return masked(self.prefix, self.last4)


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        ADMIN = "admin", "Admin"
        MEMBER = "member", "Member"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique_user_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.tenant_id} ({self.role})"


class AuditEvent(models.Model):
    """Who did what to which object. `data` must never hold a secret or a plaintext key."""

    # SET_NULL so that the trail outlives a deleted tenant.
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events"
    )
    actor = models.CharField(max_length=200)
    action = models.CharField(max_length=64)
    # A public id, a slug, or a catalog model name (gateway/prices.py audits models, prices and
    # aliases by name): as long as the longest of them, MODEL_NAME_MAX_LENGTH (128).
    target = models.CharField(max_length=200)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # A tenant's trail a page at a time, newest first (tenants.selectors.audit_page),
            # and its action names (audit_actions) or one action's events: without them a
            # tenant with a million events was read whole for either.
            models.Index(fields=["tenant", "-created_at", "-id"], name="audit_tenant_newest"),
            models.Index(fields=["tenant", "action"], name="audit_tenant_action"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.target} by {self.actor}"


class ManagementToken(models.Model):
    """A bearer token for the management API (/api/), for scripts. Not a /v1 API key.

    A tenant token acts as an admin of its tenant and sees nothing else; an operator token
    (no tenant) sees every tenant. Only a digest of the token is stored (tenants/management_tokens.py).

    Its `scope` narrows what it may do there (read < keys < full, ranked by SCOPE_ORDER; the API
    checks it per view, config/api/scopes.py), and a token issued by a console user is tied to that user (`issued_by`): it is
    revoked when they leave the tenant or lose its admin rights (tenants.membership).
    """

    class Scope(models.TextChoices):
        READ = "read", "Read only"
        KEYS = "keys", "Read, and manage projects and API keys"
        FULL = "full", "Everything a tenant admin may do"

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False,
        default=new_management_token_id,
    )
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="management_tokens",
        help_text="Empty: an operator token that sees every tenant.",
    )
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=PREFIX_LENGTH, unique=True)
    digest = models.CharField(max_length=DIGEST_LENGTH)
    last4 = models.CharField(max_length=LAST4_LENGTH)
    created_by = models.CharField(max_length=200)
    scope = models.CharField(max_length=8, choices=Scope.choices, default=Scope.FULL)
    # CASCADE: a deleted user's tokens go with them (a token must never outlive its issuer).
    issued_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
        related_name="management_tokens",
        help_text="The console user whose rights the token carries; empty: issued by an operator "
        "with the CLI.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.public_id

    @property
    def is_operator(self) -> bool:
        return self.tenant_id is None

    def allows(self, needed: str) -> bool:
        """Whether this token's scope covers `needed` (a Scope value): each scope includes the
        ones before it in SCOPE_ORDER."""
        return SCOPE_ORDER.index(self.scope) >= SCOPE_ORDER.index(needed)


# Narrowest first: a token of one scope may do everything the earlier ones may.
SCOPE_ORDER: tuple[str, ...] = (
    ManagementToken.Scope.READ, ManagementToken.Scope.KEYS, ManagementToken.Scope.FULL,
)


class Invitation(models.Model):
    """An invitation for someone to join a tenant's console. The link carries a secret of which
    only a digest is stored; it works once, until it expires."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False, default=new_invitation_id
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(
        max_length=16, choices=Membership.Role.choices, default=Membership.Role.ADMIN
    )
    digest = models.CharField(max_length=DIGEST_LENGTH, unique=True)
    invited_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="accepted_invitations",
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.email} to {self.tenant_id} ({self.role})"
