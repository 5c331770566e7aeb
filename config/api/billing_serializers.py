"""Serializers of the management API's usage, quota and webhook endpoints: query validation and response shapes (the
response serializers also document the OpenAPI schema)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from billing.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from billing.usage import GROUPINGS
from billing.webhooks import MAX_GRACE_SECONDS, masked_url, shown_error
from config.api.strict_types import StrictJSONTypes

DEFAULT_USAGE_DAYS = 30
MAX_USAGE_DAYS = 366


def today_utc() -> date:
    return datetime.now(UTC).date()


class UsageQuerySerializer(serializers.Serializer):
    """?from=YYYY-MM-DD&to=YYYY-MM-DD&group_by=day,model&project=prj_..&key=key_.."""

    from_ = serializers.DateField(required=False, help_text="First day, the tenant's local day "
                                  "(default: 29 days before `to`).")
    to = serializers.DateField(required=False, help_text="Last day, inclusive, the tenant's "
                               "local day (default: today in the tenant's time zone).")
    group_by = serializers.CharField(required=False, default="day",
                                     help_text="Comma-separated, of: " + ", ".join(GROUPINGS))
    project = serializers.CharField(required=False, max_length=64,
                                    help_text="Only this project (prj_...).")
    key = serializers.CharField(required=False, max_length=64,
                                help_text="Only this API key (key_...).")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `from` is a Python keyword: the field is from_ in code, `from` on the wire.
        self.fields["from"] = self.fields.pop("from_")

    def validate_group_by(self, value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in names if n not in GROUPINGS]
        if unknown:
            raise serializers.ValidationError(
                f"Unknown grouping {unknown[0]!r}; use some of: {', '.join(GROUPINGS)}.")
        if not names:
            raise serializers.ValidationError("Give at least one grouping.")
        return list(dict.fromkeys(names))

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Today: the tenant's local day when the view gives it (context "today").
        end = attrs.get("to") or self.context.get("today") or today_utc()
        # The renamed field keeps its first binding's source: validated data calls it from_.
        start = attrs.pop("from_", None) or end - timedelta(days=DEFAULT_USAGE_DAYS - 1)
        if start > end:
            raise serializers.ValidationError({"from": ["`from` must not be after `to`."]})
        if (end - start).days + 1 > MAX_USAGE_DAYS:
            raise serializers.ValidationError(
                {"to": [f"A range covers at most {MAX_USAGE_DAYS} days."]})
        attrs["from"], attrs["to"] = start, end
        attrs.setdefault("group_by", ["day"])
        if isinstance(attrs["group_by"], str):  # the default skipped validate_group_by
            attrs["group_by"] = self.validate_group_by(attrs["group_by"])
        return attrs


class UsageRowSerializer(serializers.Serializer):
    day = serializers.DateField(required=False)
    project = serializers.CharField(required=False, allow_null=True)
    project_slug = serializers.CharField(required=False, allow_null=True)
    key = serializers.CharField(required=False, allow_null=True)
    key_name = serializers.CharField(required=False, allow_null=True)
    model = serializers.CharField(required=False)
    requests = serializers.IntegerField()
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cached_input_tokens = serializers.IntegerField(
        help_text="Of input_tokens: read from the provider's prompt cache.")
    cache_write_tokens = serializers.IntegerField(
        help_text="Of input_tokens: written to the provider's prompt cache.")
    reasoning_tokens = serializers.IntegerField(
        help_text="Of output_tokens: reasoning (thinking).")
    cost_micros = serializers.IntegerField(
        required=False, help_text="Micro-dollars; left out for members (finance data).")


class UsageResponseSerializer(serializers.Serializer):
    from_ = serializers.DateField()
    to = serializers.DateField()
    group_by = serializers.ListField(child=serializers.CharField())
    results = UsageRowSerializer(many=True)
    note = serializers.CharField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["from"] = self.fields.pop("from_")


class ForecastSerializer(serializers.Serializer):
    """Where a limited scope's window will end at the current pace (billing/forecast.py)."""

    window = serializers.CharField(help_text="The window's id, e.g. d2026-11-30, m2026-11, "
                                   "c2026-11-15.")
    window_start = serializers.DateTimeField()
    window_end = serializers.DateTimeField()
    used = serializers.IntegerField()
    pending = serializers.IntegerField()
    limit = serializers.IntegerField()
    credit = serializers.IntegerField()
    forecast = serializers.IntegerField(help_text="Tokens forecast at the window's end (used and "
                                        "held included).")
    percent = serializers.FloatField(help_text="The forecast as a percentage of limit + credit.")
    would_reach_limit_at = serializers.DateTimeField(
        allow_null=True, help_text="When the limit would be reached at this pace; null: not in "
        "this window.")
    method = serializers.ChoiceField(choices=["trailing_rate", "daily_shape"])
    inputs = serializers.DictField(help_text="The figures the method used (trailing_hours, "
                                   "rate_per_hour, ... or history_days, ratio, ...).")


class ScopeStatusSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=["tenant", "project", "key", "model"])
    id = serializers.CharField(help_text="Tenant slug, project or key public id, model name.")
    label = serializers.CharField()
    window = serializers.ChoiceField(choices=["day", "month"])
    limit = serializers.IntegerField(allow_null=True, help_text="null: unlimited.")
    used = serializers.IntegerField()
    pending = serializers.IntegerField(help_text="Held by requests in flight.")
    credit = serializers.IntegerField()
    remaining = serializers.IntegerField(allow_null=True, help_text="null: unlimited.")
    forecast = ForecastSerializer(allow_null=True, help_text="Tenant, project and key scopes "
                                  "with a limit; null otherwise.")


class RefusedSerializer(serializers.Serializer):
    reason = serializers.CharField()
    label = serializers.CharField()
    count = serializers.IntegerField()


class RefusedTodaySerializer(serializers.Serializer):
    day = serializers.CharField(help_text="The tenant's day in its time zone, e.g. d2026-11-30.")
    total = serializers.IntegerField()
    by_reason = RefusedSerializer(many=True)


class AllotmentPoolSerializer(serializers.Serializer):
    """The tenant's shared pool in a window with allotments: its quota minus the allotments."""

    window = serializers.ChoiceField(choices=["day", "month"],
                                     help_text="day, or month: the tenant's cycle.")
    quota = serializers.IntegerField(help_text="The tenant's quota of the window.")
    allotted = serializers.IntegerField(help_text="The top-level allotments: every project's, "
                                        "and those of keys whose project has none.")
    pool = serializers.IntegerField(help_text="The pool's size: quota - allotted, never below 0.")
    credit = serializers.IntegerField(help_text="Recharged on top of the pool.")
    borrowed = serializers.IntegerField(help_text="Taken from the pool by every scope (calls in "
                                        "flight included).")
    left = serializers.IntegerField(help_text="What is left in the pool.")
    over = serializers.IntegerField(help_text="By how many tokens the allotments exceed a "
                                    "lowered quota; 0: they fit.")


class AllotmentFiguresSerializer(serializers.Serializer):
    """A project's or key's allotment in a window, and what it took."""

    scope = serializers.ChoiceField(choices=["project", "key"])
    id = serializers.CharField(help_text="The project's or key's public id.")
    label = serializers.CharField()
    window = serializers.ChoiceField(choices=["day", "month"])
    allotment = serializers.IntegerField(help_text="Tokens reserved for it alone.")
    used_from_allotment = serializers.IntegerField(help_text="Taken from its allotment (a "
                                                   "project's: its keys' included).")
    borrowed = serializers.IntegerField(help_text="Taken beyond its allotment (from its "
                                        "project's or the shared pool).")
    left = serializers.IntegerField(help_text="What is left of its allotment.")


class AllotmentStandingSerializer(serializers.Serializer):
    pools = AllotmentPoolSerializer(many=True, help_text="Windows where the tenant has "
                                    "allotments and a quota.")
    allotments = AllotmentFiguresSerializer(many=True)


class KeyScopePageSerializer(serializers.Serializer):
    """Which keys' scopes a /quota or /limits document lists (config/api/key_scopes.py)."""

    count = serializers.IntegerField(help_text="Unrevoked keys (each has a day counter).")
    limit = serializers.IntegerField()
    offset = serializers.IntegerField()
    next = serializers.URLField(allow_null=True,
                                help_text="The next page of keys' scopes; null on the last.")


class QuotaResponseSerializer(serializers.Serializer):
    scopes = ScopeStatusSerializer(many=True)
    keys = KeyScopePageSerializer(help_text="The keys whose scopes are listed, a page of them.")
    open_holds = serializers.IntegerField()
    refused_today = RefusedTodaySerializer()
    allotments = AllotmentStandingSerializer(help_text="Allotments and the shared pool per "
                                             "window (the console's figures).")


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()


# -- webhooks -----------------------------------------------------------------------------------


class WebhookEndpointSerializer(serializers.ModelSerializer):
    """An endpoint. Its URL is shown in full only with context {"show_url": True} (callers who
    may change it); others (members) get `url: null` and the masked form only, since receivers
    often carry a token in the URL."""

    id = serializers.CharField(source="public_id", read_only=True)
    url = serializers.URLField(max_length=2000, allow_null=True, help_text=(
        "The endpoint's URL; null for members (read-only role), who see url_masked only."))
    url_masked = serializers.SerializerMethodField(help_text=(
        'The scheme and the end of the host name only, e.g. "https://…example.com/…".'))
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices),
                                   allow_empty=True)
    previous_secret_valid_until = serializers.SerializerMethodField(help_text=(
        "After a secret rotation with a grace period: until when the replaced secret also signs "
        "deliveries (a second v1 signature); null otherwise."))

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "url", "url_masked", "events", "enabled", "previous_secret_valid_until",
                  "created_at"]
        read_only_fields = ["id", "url_masked", "previous_secret_valid_until", "created_at"]

    def get_url_masked(self, endpoint: WebhookEndpoint) -> str:
        return masked_url(endpoint.url)

    def get_previous_secret_valid_until(self, endpoint: WebhookEndpoint) -> datetime | None:
        return endpoint.previous_secret_valid_until(timezone.now())

    def to_representation(self, instance: WebhookEndpoint) -> dict[str, Any]:
        data = super().to_representation(instance)
        if not self.context.get("show_url", False):
            data["url"] = None
        return data


class WebhookEndpointCreateSerializer(StrictJSONTypes):
    url = serializers.URLField(max_length=2000)
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=WebhookEvent.choices),
        default=[WebhookEvent.THRESHOLD.value, WebhookEvent.EXHAUSTED.value])


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(read_only=True, help_text=(
        "The signing secret (whsec_ + base64, the Standard Webhooks format: give it as it is to "
        "a standardwebhooks library): shown in this response only, never again."))

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]


class WebhookSecretRotatedSerializer(WebhookEndpointCreatedSerializer):
    previous_secret_unusable = serializers.CharField(read_only=True, allow_null=True, help_text=(
        "Why the replaced secret was not kept for the grace period asked for (no configured "
        "encryption key decrypts it, or it is not whsec_ + base64): it signed nothing, so only "
        "the new secret signs from now on. Null when it was kept, or when no grace was asked."))

    class Meta(WebhookEndpointCreatedSerializer.Meta):
        fields = [*WebhookEndpointCreatedSerializer.Meta.fields, "previous_secret_unusable"]


class WebhookSecretRotateSerializer(StrictJSONTypes):
    grace_seconds = serializers.IntegerField(
        min_value=0, max_value=MAX_GRACE_SECONDS, default=0,
        help_text="How long the replaced secret keeps signing beside the new one (0: it stops "
        "now; at most 7 days). A secret replaced by an earlier rotation stops now.")


class WebhookEndpointUpdateSerializer(StrictJSONTypes):
    url = serializers.URLField(max_length=2000, required=False)
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices),
                                   required=False)
    enabled = serializers.BooleanField(required=False)


class WebhookDeliverySerializer(serializers.ModelSerializer):
    """A delivery. Without context {"show_url": True} (members) `last_error` names the
    endpoint's host masked, as url_masked does."""

    id = serializers.CharField(source="public_id", read_only=True)
    # Plain strings in the schema: the event names are the `events` enum of the endpoint, and a
    # second enum of the same values would collide in the generated OpenAPI names.
    event_type = serializers.CharField(read_only=True, help_text="quota.threshold, "
                                       "quota.exhausted or test.")
    status = serializers.CharField(read_only=True, help_text="pending, delivered or failed.")
    event_id = serializers.SerializerMethodField()

    class Meta:
        model = WebhookDelivery
        fields = ["id", "event_type", "event_id", "status", "attempts", "last_status_code",
                  "last_error", "next_attempt_at", "created_at", "delivered_at"]
        read_only_fields = fields

    def get_event_id(self, delivery: WebhookDelivery) -> str:
        return str((delivery.payload or {}).get("id", ""))

    def to_representation(self, instance: WebhookDelivery) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["last_error"] = shown_error(instance, self.context.get("show_url", False))
        return data
