"""Management API representations of tenants. Public ids only: database ids never leave."""

from __future__ import annotations

import re
from typing import Any

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from billing.webhooks import MAX_GRACE_SECONDS
from config.api.billing_serializers import KeyScopePageSerializer
from config.api.strict_types import StrictJSONTypes
from tenants import selectors
from tenants.management_tokens import masked_token
from tenants.models import (
    PACE_COOLDOWN_MAX_SECONDS,
    PACE_PERIODS,
    ApiKey,
    AuditEvent,
    ManagementToken,
    Plan,
    Project,
    Tenant,
)


class TenantSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    plan = serializers.CharField(source="plan.name", read_only=True)
    role = serializers.SerializerMethodField()

    class Meta:
        model = Tenant
        fields = ["id", "slug", "name", "plan", "status", "role", "created_at"]
        read_only_fields = fields

    def get_role(self, tenant: Tenant) -> str | None:
        roles = self.context.get("roles")  # a listing's, read in one query (TenantListView)
        if roles is not None:
            return roles[tenant.pk]
        principal = self.context.get("principal")
        return principal.role_in(tenant) if principal is not None else None


# -- projects and keys -----------------------------------------------------------------------------
# Read serializers take `usage` ({public id: {"today": n, "month": n}}) and `now` in their
# context, computed once per request (tenants.selectors), so a page of keys costs no query per key.

# An API key's rotation grace has the same bound as a webhook secret's: MAX_GRACE_SECONDS,
# imported above from its one home (billing.webhooks).

# The largest limit, budget or quantity the API takes: far beyond any real one, and inside both
# PostgreSQL's bigint and the integers the Lua scripts hold exactly (2^53), so that no number a
# client sends can overflow a column or a counter (a 400 instead).
MAX_QUANTITY = 10**15


def _sub_limit(help_text: str = "Tokens; null: no sub-limit of its own.") -> serializers.IntegerField:
    return serializers.IntegerField(required=False, allow_null=True, min_value=0,
                                    max_value=MAX_QUANTITY, help_text=help_text)


# RFC 3339, what the schema's `format: date-time` means: a full date and time with its offset.
# DRF alone would also take "2026-01-31T12:00" (no offset) or "2026-1-31", which the schema
# refuses, so a client reading the schema and the server would disagree.
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII)


class RFC3339DateTimeField(serializers.DateTimeField):
    def to_internal_value(self, value: Any) -> Any:
        if not (isinstance(value, str) and _RFC3339.fullmatch(value)):
            raise serializers.ValidationError(
                "Give a date and time with its offset (RFC 3339), e.g. 2026-01-31T12:00:00Z.")
        return super().to_internal_value(value)


def _pace_share(help_text: str = "Burn-rate breaker: percent of its daily limit per pace "
                "period; null: the tenant's (100: none of its own).") -> serializers.IntegerField:
    return serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=100,
                                    help_text=help_text)


def _pace_spend() -> serializers.IntegerField:
    return serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_QUANTITY,
        help_text="Burn-rate breaker: micro-dollars per pace period; null: none of its own.")


def _allotment(window: str) -> serializers.IntegerField:
    return serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_QUANTITY,
        help_text=f"Tokens {window} reserved for it alone out of the tenant's quota (its calls "
        "borrow beyond it from the shared pool); null: none. Refused when the allotments would "
        "exceed the tenant's quota of the window, or its project's allotment. Needs a full-scope "
        "token: a keys-scope token gets a 403 when it would set or change one (it may send the "
        "stored value back).")


def _day_allotment() -> serializers.IntegerField:
    return _allotment("per day")


def _cycle_allotment() -> serializers.IntegerField:
    return _allotment("per cycle (the tenant's month)")


class UsageSerializer(serializers.Serializer):
    today = serializers.IntegerField(help_text="Tokens used today (UTC), from the ledger.")
    month = serializers.IntegerField(help_text="Tokens used this month (UTC), from the ledger.")


def _usage(serializer: serializers.Serializer, public_id: str) -> dict[str, int]:
    usage = serializer.context.get("usage", {}).get(public_id, {})
    return {"today": usage.get("today", 0), "month": usage.get("month", 0)}


class ProjectSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    usage = serializers.SerializerMethodField()

    class Meta:
        model = Project
        fields = ["id", "slug", "name", "tokens_per_day", "tokens_per_month",
                  "pace_share_percent", "pace_spend_micros", "allotment_tokens_per_day",
                  "allotment_tokens_per_month", "usage", "created_at"]
        read_only_fields = fields

    @extend_schema_field(UsageSerializer)
    def get_usage(self, project: Project) -> dict[str, int]:
        return _usage(self, project.public_id)


class ProjectCreateSerializer(StrictJSONTypes):
    slug = serializers.SlugField(max_length=63)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    tokens_per_day = _sub_limit()
    tokens_per_month = _sub_limit()
    pace_share_percent = _pace_share()
    pace_spend_micros = _pace_spend()
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()


class ProjectUpdateSerializer(StrictJSONTypes):
    name = serializers.CharField(max_length=200, required=False)
    tokens_per_day = _sub_limit()
    tokens_per_month = _sub_limit()
    pace_share_percent = _pace_share()
    pace_spend_micros = _pace_spend()
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # The slug names the project in scripts and the CLI; silently ignoring it would hide a typo.
        if "slug" in self.initial_data:
            raise serializers.ValidationError({"slug": ["A project's slug cannot change."]})
        return attrs


class ApiKeySerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    project = serializers.CharField(source="project.public_id", read_only=True)
    masked = serializers.SerializerMethodField()
    status = serializers.SerializerMethodField(help_text="active, expired or revoked")
    rotating = serializers.SerializerMethodField(
        help_text="Active, with the previous secret of a rotation still in its grace period.")
    usage = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id", "project", "name", "masked", "status", "rotating", "tokens_per_day", "tokens_per_month",
            "requests_per_minute", "max_concurrency", "allowed_models", "pace_share_percent",
            "pace_spend_micros", "allotment_tokens_per_day", "allotment_tokens_per_month",
            "expires_at",
            "revoked_at", "last_used_at", "created_at", "created_by", "usage",
        ]
        read_only_fields = fields

    def _now(self) -> Any:
        return self.context.get("now") or timezone.now()

    def get_masked(self, api_key: ApiKey) -> str:
        return selectors.listed_masked_key(api_key, now=self._now())

    @extend_schema_field(OpenApiTypes.STR)
    def get_status(self, api_key: ApiKey) -> str:
        return selectors.key_status(api_key, now=self._now())

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_rotating(self, api_key: ApiKey) -> bool:
        return selectors.key_in_rotation(api_key, now=self._now())

    @extend_schema_field(UsageSerializer)
    def get_usage(self, api_key: ApiKey) -> dict[str, int]:
        return _usage(self, api_key.public_id)


class IssuedApiKeySerializer(ApiKeySerializer):
    key = serializers.SerializerMethodField(
        help_text="The plaintext key. Shown in this response only: store it now."
    )

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields

    def get_key(self, api_key: ApiKey) -> str:
        return self.context["plaintext"]


class _KeyLimitFields(StrictJSONTypes):
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    tokens_per_day = _sub_limit()
    tokens_per_month = _sub_limit()
    requests_per_minute = _sub_limit("Requests per minute; null: no sub-limit.")
    max_concurrency = _sub_limit("Requests in flight at once; null: no sub-limit.")
    pace_share_percent = _pace_share()
    pace_spend_micros = _pace_spend()
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, allow_empty=True,
        help_text="Narrows the plan's models; empty: every model the plan allows.",
    )

    def validate_allowed_models(self, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError("Model names must not repeat.")
        return value


class KeyIssueSerializer(_KeyLimitFields):
    project = serializers.CharField(help_text="The project's id (prj_...), in this tenant.")
    expires_at = RFC3339DateTimeField(required=False, allow_null=True)

    def validate_expires_at(self, value: Any) -> Any:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("Must be in the future.")
        return value


class KeyUpdateSerializer(_KeyLimitFields):
    pass


class KeyRotateSerializer(StrictJSONTypes):
    grace_seconds = serializers.IntegerField(
        min_value=0, max_value=MAX_GRACE_SECONDS, default=0,
        help_text="How long the previous secret keeps working (0: it stops now; at most 7 days).",
    )


# -- plans, tenants and limits -------------------------------------------------------------------


def _pace_period(value: int | None) -> int | None:
    if value is not None and value not in PACE_PERIODS:
        raise serializers.ValidationError(
            f"Choose one of {', '.join(map(str, PACE_PERIODS))} seconds.")
    return value


class PlanSerializer(StrictJSONTypes, serializers.ModelSerializer):
    # An integer in JSON (the model's choices would make it a string enum in the schema).
    pace_period_seconds = serializers.IntegerField(
        required=False, min_value=1, max_value=max(PACE_PERIODS), validators=[_pace_period],
        help_text=f"Burn-rate breaker period in seconds, one of "
        f"{', '.join(map(str, PACE_PERIODS))}.")

    class Meta:
        model = Plan
        fields = [
            "name", "display_name", "tokens_per_day", "tokens_per_minute", "requests_per_second",
            "over_quota_policy", "queue_timeout_seconds", "queue_priority", "soft_limit_percent",
            "fallback_model", "safety_factor", "allowed_models", "shrink_hold_to_headroom",
            "pace_share_percent", "pace_spend_micros", "pace_period_seconds",
            "pace_cooldown_seconds", "responses_context_allowance_tokens", "reset_cycle",
            "allows_custom_cycle", "created_at", "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]
        extra_kwargs = {"display_name": {"required": False}}


class PlanUpdateSerializer(PlanSerializer):
    # A plan's cycle is fixed once created (tenants.services.plans.PLAN_CREATE_FIELDS).
    class Meta(PlanSerializer.Meta):
        read_only_fields = ["name", "reset_cycle", "allows_custom_cycle", "created_at",
                            "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Read-only fields would be dropped without a word: say why instead.
        fixed = [name for name in ("reset_cycle", "allows_custom_cycle")
                 if isinstance(self.initial_data, dict) and name in self.initial_data]
        if fixed:
            raise serializers.ValidationError({name: [
                "Fixed once the plan is created: it is its tenants' windows. Move tenants to "
                "another plan, or change a tenant's own cycle."] for name in fixed})
        return super().validate(attrs)


class PlanNameField(serializers.SlugRelatedField):
    """A plan by name. The name is checked as a slug before the lookup: a value PostgreSQL cannot
    compare (a NUL character) is a 400 "no such plan", not a database error."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="name", queryset=selectors.plans(), **kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if not (isinstance(data, str) and _PLAN_NAME.fullmatch(data)):
            self.fail("does_not_exist", slug_name=self.slug_field, value=str(data)[:60])
        return super().to_internal_value(data)


_PLAN_NAME = re.compile(r"[-a-zA-Z0-9_]{1,50}")


class TenantCreateSerializer(StrictJSONTypes):
    slug = serializers.SlugField(max_length=63)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    plan = PlanNameField()


class TenantUpdateSerializer(StrictJSONTypes):
    name = serializers.CharField(max_length=200, required=False)
    plan = PlanNameField(required=False, help_text="Operators only.")
    status = serializers.ChoiceField(choices=Tenant.Status.choices, required=False,
                                     help_text="Operators only.")


def _nullable_limit(minimum: int, help_text: str) -> serializers.IntegerField:
    return serializers.IntegerField(required=False, allow_null=True, min_value=minimum,
                                    max_value=MAX_QUANTITY, help_text=help_text)


class EffectiveLimitsSerializer(serializers.Serializer):
    """Null: unlimited."""

    tokens_per_day = serializers.IntegerField(allow_null=True)
    tokens_per_minute = serializers.IntegerField(allow_null=True)
    requests_per_second = serializers.IntegerField(allow_null=True)
    monthly_token_budget = serializers.IntegerField(allow_null=True)
    monthly_spend_budget_micros = serializers.IntegerField(allow_null=True)
    model_tokens_per_day = serializers.DictField(child=serializers.IntegerField())
    allowed_models = serializers.ListField(child=serializers.CharField())
    over_quota_policy = serializers.CharField()
    pace_share_percent = serializers.IntegerField(
        allow_null=True, help_text="Burn-rate breaker: percent of each scope's daily limit per "
        "pace period; null: none.")
    pace_spend_micros = serializers.IntegerField(
        allow_null=True, help_text="Burn-rate breaker: the tenant's micro-dollars per pace "
        "period; null: none.")
    pace_period_seconds = serializers.IntegerField()
    pace_cooldown_seconds = serializers.IntegerField()


class TenantOverridesSerializer(StrictJSONTypes):
    """Tenant overrides of the plan: null inherits the plan, -1 lifts the limit."""

    tokens_per_day = _nullable_limit(-1, "null: the plan's; -1: unlimited.")
    tokens_per_minute = _nullable_limit(-1, "null: the plan's; -1: unlimited.")
    requests_per_second = _nullable_limit(-1, "null: the plan's; -1: unlimited.")
    monthly_token_budget = _nullable_limit(0, "Tokens per month; null: none.")
    monthly_spend_budget_micros = _nullable_limit(0, "Micro-dollars per month; null: none.")
    model_tokens_per_day = serializers.DictField(
        child=serializers.IntegerField(min_value=0, max_value=MAX_QUANTITY), required=False,
        help_text='Daily token limits of single models, e.g. {"gpt-4o": 1000000}.',
    )
    pace_share_percent = _nullable_limit(
        -1, "Burn-rate breaker share (1-100 percent per period); null: the plan's; -1: none.")
    pace_spend_micros = _nullable_limit(
        -1, "Burn-rate breaker spend (micro-dollars per period); null: the plan's; -1: none.")
    pace_period_seconds = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=max(PACE_PERIODS),
        validators=[_pace_period],
        help_text=f"Pace period in seconds, one of {', '.join(map(str, PACE_PERIODS))}; null: "
        "the plan's.")
    pace_cooldown_seconds = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=PACE_COOLDOWN_MAX_SECONDS,
        help_text="Pace cool-down in seconds; null: the plan's.")

    def validate_model_tokens_per_day(self, value: dict[str, int]) -> dict[str, int]:
        # Keys are model names: the same rule as a key's allowed_models (and PostgreSQL's jsonb
        # cannot hold a NUL).
        for name in value:
            if not name.strip() or len(name) > 200 or "\x00" in name:
                raise serializers.ValidationError(f"Not a model name: {name[:60]!r}.")
        return value


class LimitScopeStatusSerializer(serializers.Serializer):
    scope = serializers.CharField(help_text="tenant, project, key or model")
    id = serializers.CharField()
    label = serializers.CharField()
    window = serializers.CharField(help_text="day or month")
    limit = serializers.IntegerField(allow_null=True, help_text="null: no limit")
    used = serializers.IntegerField()
    pending = serializers.IntegerField(help_text="Held by requests in flight.")
    credit = serializers.IntegerField()
    remaining = serializers.IntegerField(allow_null=True, help_text="null: no limit")


class LiveStatusSerializer(serializers.Serializer):
    open_holds = serializers.IntegerField()
    scopes = LimitScopeStatusSerializer(many=True)
    keys = KeyScopePageSerializer(help_text="The keys whose scopes are listed, a page of them.")


class AllotmentWindowSerializer(serializers.Serializer):
    """A window's allotments: the tenant's quota, what projects and keys reserved of it, and
    the shared pool left for everyone to borrow from."""

    window = serializers.ChoiceField(choices=["day", "month"],
                                     help_text="day, or month: the tenant's cycle.")
    quota = serializers.IntegerField(allow_null=True, help_text="The tenant's quota of the "
                                     "window; null: none, so nothing can be allotted.")
    allotted = serializers.IntegerField(help_text="The top-level allotments: every project's, "
                                        "and those of keys whose project has none.")
    pool = serializers.IntegerField(allow_null=True, help_text="The shared pool: the quota minus "
                                    "the allotments, never below 0; null: no quota.")
    over = serializers.IntegerField(help_text="By how many tokens the allotments exceed the "
                                    "quota (after the quota was lowered); 0: they fit.")
    warning = serializers.CharField(allow_blank=True, help_text="What to do when `over` > 0.")


class CycleWindowSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="As the window's counters and cost reports name it "
                               "(m2026-12, c2026-12-15, c2026-12-15@<switch>, d2026-12-01).")
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    label = serializers.CharField()


class PendingCycleSerializer(serializers.Serializer):
    cycle = serializers.CharField()
    time_zone = serializers.CharField()
    changes_at = serializers.DateTimeField(help_text="When it takes over: the end of the "
                                           "current cycle window.")


class AskedCycleSerializer(serializers.Serializer):
    cycle = serializers.CharField(help_text='"" (the plan\'s), monthly, weekly or days.')
    anchor = serializers.DateField(allow_null=True)
    every_days = serializers.IntegerField(allow_null=True)
    time_zone = serializers.CharField()


class TenantCycleSerializer(serializers.Serializer):
    """The tenant's reset cycle (quotas/cycles.py): the window of its 'month' quotas."""

    cycle = serializers.CharField(help_text='In words, e.g. "monthly from the 15th", "daily".')
    time_zone = serializers.CharField(help_text="The zone of its days and cycle.")
    window = CycleWindowSerializer(help_text="The current cycle window.")
    day = CycleWindowSerializer(help_text="Today, in the tenant's time zone.")
    pending = PendingCycleSerializer(allow_null=True, help_text="A change waiting for the "
                                     "current window to end.")
    asked = AskedCycleSerializer(help_text="The cycle fields as last asked for.")
    windows = CycleWindowSerializer(many=True, help_text="Its cycle windows since it was "
                                    "created (at most 12), newest first: the periods of its "
                                    "cost reports.")
    change = serializers.CharField(required=False, help_text="After a PATCH of the cycle: "
                                   "what the change does, in words.")


class TenantLimitsSerializer(serializers.Serializer):
    plan = PlanSerializer()
    effective = EffectiveLimitsSerializer()
    overrides = TenantOverridesSerializer()
    alert_thresholds = serializers.ListField(child=serializers.IntegerField())
    forecast_threshold_percent = serializers.IntegerField(
        help_text="quota.forecast warns when a window's forecast reaches this percent of its "
        "limit; 0: off.")
    allotments = AllotmentWindowSerializer(many=True)
    cycle = TenantCycleSerializer()
    live = LiveStatusSerializer(allow_null=True, help_text="null when the quota store is down.")


class PaceTripSerializer(serializers.Serializer):
    """A burn-rate breaker trip (quotas/pace.py)."""

    scope = serializers.CharField(help_text='"tenant", "project:<n>" or "key:<n>": what resume '
                                  "takes.")
    kind = serializers.CharField(help_text="tenant, project or key")
    id = serializers.CharField(help_text="The tenant's, project's or key's public id.")
    label = serializers.CharField()
    rules = serializers.ListField(child=serializers.CharField())
    tripped_at = serializers.DateTimeField()
    until = serializers.DateTimeField(help_text="When the cool-down ends (or ended).")
    active = serializers.BooleanField(help_text="Calls touching the scope are refused now.")
    resumed_by = serializers.CharField(allow_blank=True)


class PaceResumeSerializer(StrictJSONTypes):
    scope = serializers.CharField(max_length=200, help_text="A tripped scope, as listed.")


class TenantLimitsUpdateSerializer(TenantOverridesSerializer):
    alert_thresholds = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=99), required=False,
        allow_empty=True,
        help_text="Percentages of a quota or budget remaining that raise an alert. Tenant admins "
        "may change these; every other field is for operators.",
    )

    forecast_threshold_percent = serializers.IntegerField(
        min_value=0, max_value=100, required=False,
        help_text="Warn (quota.forecast webhook and email, once per window) when a window's "
        "forecast reaches this percent of its limit; 0: no forecast warnings. Tenant admins may "
        "change it.")

    # The reset cycle (operators): the current window finishes on the old cycle, unless the
    # tenant counted nothing in it (quotas.cycles.change_cycle). Fields not given keep what was
    # last asked for; a new cycle starts without the old anchor and number of days.
    cycle = serializers.ChoiceField(
        choices=["", "monthly", "weekly", "days"], required=False, allow_blank=True,
        help_text='"" follows the plan; monthly from the anchor\'s day of the month (29-31: the '
        "last day of shorter months), weekly from the anchor's weekday, days: every N days from "
        "the anchor. Plans that allow a cycle of the tenant's own only. Operators.")
    cycle_anchor = serializers.DateField(required=False, allow_null=True,
                                         help_text="The cycle's anchor date. Operators.")
    cycle_every_days = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                                max_value=366,
                                                help_text="N of every N days. Operators.")
    time_zone = serializers.CharField(required=False, max_length=64,
                                      help_text="IANA time zone of the tenant's days and cycle "
                                      "(e.g. Europe/Paris). Operators.")

    def validate_alert_thresholds(self, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError("Thresholds must not repeat.")
        return sorted(value, reverse=True)


# -- management tokens and audit events ---------------------------------------------------------


class ManagementTokenSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    masked = serializers.SerializerMethodField()
    status = serializers.SerializerMethodField(help_text="active, expired or revoked")
    issued_by = serializers.CharField(
        source="issued_by.username", read_only=True, allow_null=True, default=None,
        help_text="The console user whose rights the token carries (revoked when they leave the "
        "tenant or lose its admin role); null: issued by an operator.")

    class Meta:
        model = ManagementToken
        fields = ["id", "name", "masked", "status", "scope", "issued_by", "created_by",
                  "created_at", "expires_at", "revoked_at", "last_used_at"]
        read_only_fields = fields

    def get_masked(self, token: ManagementToken) -> str:
        return masked_token(token.prefix, token.last4)

    @extend_schema_field(OpenApiTypes.STR)
    def get_status(self, token: ManagementToken) -> str:
        if token.revoked_at is not None:
            return "revoked"
        if token.expires_at is not None and token.expires_at <= timezone.now():
            return "expired"
        return "active"


class IssuedManagementTokenSerializer(ManagementTokenSerializer):
    token = serializers.SerializerMethodField(
        help_text="The plaintext token (tgm_...). Shown in this response only: store it now."
    )

    class Meta(ManagementTokenSerializer.Meta):
        fields = [*ManagementTokenSerializer.Meta.fields, "token"]
        read_only_fields = fields

    def get_token(self, token: ManagementToken) -> str:
        return self.context["plaintext"]


class ManagementTokenIssueSerializer(StrictJSONTypes):
    name = serializers.CharField(max_length=200, help_text="What the token is for.")
    scope = serializers.ChoiceField(
        choices=ManagementToken.Scope.choices, default=ManagementToken.Scope.FULL,
        help_text="read: read only; keys: read, and manage projects and API keys (not their "
        "allotments); full: "
        "everything a tenant admin may do (the default). A token issuing a token cannot give it "
        "a wider scope than its own.")
    expires_at = RFC3339DateTimeField(
        required=False, allow_null=True,
        help_text="When the token stops working. Omitted: 90 days from now; null: never (an "
        "explicit choice). A token issuing a token cannot give it a later expiry than its own.")

    def validate_expires_at(self, value: Any) -> Any:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("Must be in the future.")
        return value


class AuditEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = ["created_at", "actor", "action", "target", "data"]
        read_only_fields = fields


class AuditFilterSerializer(serializers.Serializer):
    action = serializers.CharField(required=False, max_length=64,
                                   help_text="Exact (key.issued) or a family ending in a dot.")
    actor = serializers.CharField(required=False, max_length=200)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        # "from" is a Python keyword, so these cannot be declared as class attributes.
        fields["from"] = serializers.DateField(required=False, help_text="YYYY-MM-DD, inclusive.")
        fields["to"] = serializers.DateField(required=False, help_text="YYYY-MM-DD, inclusive.")
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("from") and attrs.get("to") and attrs["from"] > attrs["to"]:
            raise serializers.ValidationError({"to": "Must not be before 'from'."})
        return attrs
