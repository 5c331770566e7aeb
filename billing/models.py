"""The usage ledger: the durable truth about what every request cost. Model prices live in the
gateway app (gateway.models.ModelPrice), where the hot path and the ledger both resolve them."""
from __future__ import annotations

from datetime import datetime

from django.db import models


class UsageRecord(models.Model):
    """One row per finished request (unique request id), written from the gateway's usage events
    off the hot path (billing/ledger.py)."""

    class Status(models.TextChoices):
        SETTLED = "settled", "Settled with the upstream's usage"
        PARTIAL = "partial", "Settled with what was produced (stream cut, client left, no usage)"
        RELEASED = "released", "Released: the upstream produced nothing"
        SWEPT = "swept", "Swept: the gateway process never ended its hold"
        # A fail-open call (quota store down, operator's choice) that reached the upstream: no
        # hold existed, so nothing bounded or pre-checked it; billed like a settled call.
        UNMETERED = "unmetered", "Unmetered: admitted without a hold while the quota store was down"

    class SweepBasis(models.TextChoices):
        """How far the call had got when the sweep ended its hold, hence what it charged."""

        RESERVED = "reserved", "Never forwarded: nothing charged"
        FORWARDED = "forwarded", "Reached the upstream (not streamed): the full hold charged"
        STREAMING = "streaming", "Streaming: the input and the last output checkpoint charged"

    # Unique with ended_at (constraint usage_request_once below): the table is partitioned by
    # month on ended_at (billing/partitions.py), and PostgreSQL's unique keys on a partitioned
    # table must include the partition key. A redelivered event carries the same ended_at.
    request_id = models.CharField(max_length=128)
    # No index of its own: (tenant, ended_at) below serves every lookup by tenant.
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage",
                               db_index=False)
    # The three references a call may outlive are not foreign key constraints in PostgreSQL
    # (db_constraint=False): each constraint is a check per row at every drain commit, together
    # about a quarter of PostgreSQL's CPU per ledger row (docs/benchmarks.md, "The ledger at
    # scale"). What they guarded is kept: the drain's insert sets a reference to NULL when its
    # object no longer exists (billing/rollups.py), and deleting one still sets its rows' to NULL
    # (Django's on_delete). Only a delete racing a drain's commit can leave the id of a deleted
    # provider key in a row (projects and keys are archived and revoked, never deleted), which the
    # readers then show like a deleted one. The tenant stays a constraint (PROTECT).
    project = models.ForeignKey("tenants.Project", on_delete=models.SET_NULL, null=True,
                                related_name="usage", db_constraint=False)
    api_key = models.ForeignKey("tenants.ApiKey", on_delete=models.SET_NULL, null=True,
                                related_name="usage", db_constraint=False)
    # Its index is (provider_key, served_model, ended_at) below.
    provider_key = models.ForeignKey("gateway.ProviderKey", on_delete=models.SET_NULL, null=True,
                                     related_name="usage", db_constraint=False, db_index=False)
    endpoint = models.CharField(max_length=32, blank=True)
    model = models.CharField(max_length=200, help_text="The model the client asked for.")
    served_model = models.CharField(max_length=200, help_text="The model forwarded (fallback).")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    # The token classes the upstream priced apart (gateway/usage.py): each is part of its total,
    # so quota and the sums above stay totals; the cost prices each class at its own price.
    cached_input_tokens = models.BigIntegerField(
        default=0, help_text="Of input_tokens: read from the provider's prompt cache.")
    cache_write_tokens = models.BigIntegerField(
        default=0, help_text="Of input_tokens: written to the provider's prompt cache.")
    reasoning_tokens = models.BigIntegerField(
        default=0, help_text="Of output_tokens: reasoning (thinking).")
    held_tokens = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0, help_text="Micro-dollars (1e-6 USD).")
    status = models.CharField(max_length=16, choices=Status.choices)
    detail = models.CharField(max_length=64, blank=True, help_text="How the call ended.")
    http_status = models.PositiveSmallIntegerField(null=True)
    latency_ms = models.PositiveIntegerField(null=True)
    streamed = models.BooleanField(default=False)
    over_soft_limit = models.BooleanField(default=False)
    started_at = models.DateTimeField(help_text="When the hold was made (Redis clock).")
    ended_at = models.DateTimeField(db_index=True, help_text="When it ended (Redis clock).")
    recorded_at = models.DateTimeField(auto_now_add=True)
    # Swept rows: what the sweep charged from. Kept when a late settle corrects the row.
    sweep_basis = models.CharField(max_length=16, blank=True, choices=SweepBasis.choices)
    # A settle or release that arrived after the sweep replaces the tokens, cost and status with
    # the real ones (billing/ledger.py); what the sweep had charged stays here, for the reports.
    # All null: never corrected.
    swept_input_tokens = models.BigIntegerField(null=True, blank=True)
    swept_output_tokens = models.BigIntegerField(null=True, blank=True)
    swept_cost_micros = models.BigIntegerField(null=True, blank=True)
    corrected_at = models.DateTimeField(
        null=True, blank=True, help_text="When the late settle or release ended (Redis clock).")
    # Tokens used above the hold (the tokenizer's estimate was low): invariant 2 says it must be
    # rare and measured; /metrics reads it through the partial index below.
    over_hold_tokens = models.BigIntegerField(default=0)

    class Meta:
        # The database's primary key is (id, ended_at), the partition key being part of it;
        # Django keeps `id` as the pk: one identity sequence numbers every partition's rows, so
        # it is unique in practice, and the ORM and the admin address rows by it.
        indexes = [
            # (Corrections find a swept row by request id alone, billing/ledger.py: through the
            # dedupe key usage_request_once, whose first column it is.)
            models.Index(fields=["tenant", "ended_at"]),
            models.Index(fields=["provider_key", "served_model", "ended_at"]),
            # Both are rare rows counted by /metrics on every scrape: partial indexes keep that
            # cheap however long the ledger grows.
            models.Index(fields=["corrected_at"], name="usage_corrected",
                         condition=models.Q(corrected_at__isnull=False)),
            models.Index(fields=["over_hold_tokens"], name="usage_over_hold",
                         condition=models.Q(over_hold_tokens__gt=0)),
        ]
        constraints = [
            # One row per request: a redelivered usage event conflicts here and inserts nothing.
            models.UniqueConstraint(fields=["request_id", "ended_at"], name="usage_request_once"),
            models.CheckConstraint(
                name="usage_non_negative",
                condition=models.Q(input_tokens__gte=0, output_tokens__gte=0, held_tokens__gte=0,
                                   cost_micros__gte=0)),
            models.CheckConstraint(
                name="usage_over_hold_non_negative", condition=models.Q(over_hold_tokens__gte=0)),
            models.CheckConstraint(
                name="usage_classes_within_totals",
                condition=models.Q(cached_input_tokens__gte=0, cache_write_tokens__gte=0,
                                   reasoning_tokens__gte=0,
                                   reasoning_tokens__lte=models.F("output_tokens"))
                & models.Q(input_tokens__gte=models.F("cached_input_tokens")
                           + models.F("cache_write_tokens"))),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class UsageRollup(models.Model):
    """The ledger summed per day: one row per (tenant, zone, day, project, key, provider key,
    model, served model, status, corrected), kept in the same transaction as the drain's inserts
    and corrections (billing/rollups.py), so that reports, the dashboard, the usage API and
    /metrics read a row per group and day instead of a row per request.

    Each usage row is summed twice: on its day in UTC (`zone` "UTC": the platform report,
    /metrics, reconciliation, and the check before a raw month is dropped) and on its day in the
    tenant's time zone at the time it was drained (a tenant report's local days); a UTC tenant has
    the one row. A corrected swept row moves from its `swept` group to its new status with
    `corrected` true, on the day it was swept (the row's ended_at does not change).

    project / api_key / provider_key keep the id without a database constraint: the rollup
    outlives the raw rows and names a deleted project as its id, like the ledger's "(deleted)".
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    zone = models.CharField(max_length=64)
    day = models.DateField()
    project = models.ForeignKey("tenants.Project", on_delete=models.DO_NOTHING, null=True,
                                db_constraint=False, related_name="+")
    api_key = models.ForeignKey("tenants.ApiKey", on_delete=models.DO_NOTHING, null=True,
                                db_constraint=False, related_name="+")
    provider_key = models.ForeignKey("gateway.ProviderKey", on_delete=models.DO_NOTHING,
                                     null=True, db_constraint=False, related_name="+")
    model = models.CharField(max_length=200)
    served_model = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=UsageRecord.Status.choices)
    corrected = models.BooleanField(default=False)
    requests = models.BigIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cached_input_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    reasoning_tokens = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    over_hold_tokens = models.BigIntegerField(default=0)
    over_hold_requests = models.BigIntegerField(default=0)
    # Of corrected rows: what the sweep had charged (UsageRecord.swept_*).
    swept_input_tokens = models.BigIntegerField(default=0)
    swept_output_tokens = models.BigIntegerField(default=0)
    swept_cost_micros = models.BigIntegerField(default=0)

    GROUP_FIELDS = ("tenant", "zone", "day", "project", "api_key", "provider_key", "model",
                    "served_model", "status", "corrected")
    SUM_FIELDS = ("requests", "input_tokens", "output_tokens", "cached_input_tokens",
                  "cache_write_tokens", "reasoning_tokens", "cost_micros", "over_hold_tokens",
                  "over_hold_requests", "swept_input_tokens", "swept_output_tokens",
                  "swept_cost_micros")

    class Meta:
        constraints = [
            # NULLS NOT DISTINCT: a deleted project's or an unmetered call's null is one group.
            models.UniqueConstraint(
                fields=["tenant", "zone", "day", "project", "api_key", "provider_key", "model",
                        "served_model", "status", "corrected"],
                name="usage_rollup_group", nulls_distinct=False),
        ]
        indexes = [
            models.Index(fields=["zone", "day"], name="usage_rollup_zone_day"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.zone} {self.day} {self.served_model} {self.status}"


class LedgerTotal(models.Model):
    """The UTC rollups summed over every day before `through`, per (status, corrected): what
    /metrics' ledger counters add the rollups of the days from `through` on to (billing/metrics.py
    ledger_sums), so a scrape reads the last few days' rollup rows instead of every day's since
    the first. Written whole once a day (refresh_closed_days, by the ensure_ledger_partitions
    job); no rows: never written, and a scrape sums every rollup row."""

    through = models.DateField(help_text="The first UTC day not summed here.")
    status = models.CharField(max_length=16)
    corrected = models.BooleanField()
    requests = models.BigIntegerField()
    over_hold_requests = models.BigIntegerField()
    over_hold_tokens = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["status", "corrected"],
                                               name="ledger_total_once")]

    def __str__(self) -> str:
        return f"{self.status} {self.corrected} before {self.through}"


class UsageHourly(models.Model):
    """The ledger's tokens per UTC hour: one row per (tenant, hour, project, key), kept in the
    same transaction (and statement) as the drain's inserts and corrections and the daily rollup
    (billing/rollups.py), so that usage forecasts (billing/forecast.py) read a row per scope and
    hour instead of a row per request. `hour` is the start of the UTC hour the row's ended_at
    falls in; `tokens` is input + output (what forecasts burn); a correction changes a swept
    row's tokens in place, so its delta goes to the hour the row ended in.

    Kept only TOLLGATE_FORECAST_HISTORY_DAYS + 2 days (billing.rollups.prune_hourly, from the
    daily partition task): forecasts read no further back. project / api_key keep the id without
    a database constraint, like UsageRollup's.
    """

    # No index of their own: the group's unique index (tenant first) is the one every reader
    # and the drain's upsert use, and each more index is one more write per drained group.
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+",
                               db_index=False)
    hour = models.DateTimeField()
    project = models.ForeignKey("tenants.Project", on_delete=models.DO_NOTHING, null=True,
                                db_constraint=False, db_index=False, related_name="+")
    api_key = models.ForeignKey("tenants.ApiKey", on_delete=models.DO_NOTHING, null=True,
                                db_constraint=False, db_index=False, related_name="+")
    requests = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)

    GROUP_FIELDS = ("tenant", "hour", "project", "api_key")
    SUM_FIELDS = ("requests", "tokens")

    class Meta:
        constraints = [
            # NULLS NOT DISTINCT: a call without a project or key (or whose were deleted) is one
            # group. Also the forecasts' index: (tenant, hour range).
            models.UniqueConstraint(fields=["tenant", "hour", "project", "api_key"],
                                    name="usage_hourly_group", nulls_distinct=False),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.hour:%Y-%m-%d %H:00} {self.tokens}"


class LedgerExport(models.Model):
    """A raw ledger month written to CSV (`manage.py ledger_export`, billing/retention.py), and
    when retention dropped its partition. Retention drops a month only if its export's row count
    is the partition's (else rows came after the export) or it is forced."""

    month = models.DateField(unique=True, help_text="The month's first day (UTC).")
    rows = models.BigIntegerField()
    sha256 = models.CharField(max_length=64, help_text="Of the CSV file as written.")
    path = models.CharField(max_length=1000)
    exported_at = models.DateTimeField()
    dropped_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.month:%Y-%m} ({self.rows} rows)"


# -- threshold alerts and webhooks (billing/alerts.py, billing/webhooks.py) ---------------------


def _new_webhook_id() -> str:
    from tenants.ids import PUBLIC_ID_RANDOM_LENGTH, random_base62

    return "whk_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def new_delivery_id() -> str:
    from tenants.ids import PUBLIC_ID_RANDOM_LENGTH, random_base62

    return "dlv_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


class WebhookEvent(models.TextChoices):
    THRESHOLD = "quota.threshold", "A quota crossed one of the tenant's alert thresholds"
    EXHAUSTED = "quota.exhausted", "A quota has nothing left"
    TEST = "test", "A test event sent on request"
    BREAKER_TRIPPED = "breaker.tripped", "A scope spent far above its pace and was paused"
    FORECAST = "quota.forecast", "A quota is forecast to reach the tenant's forecast threshold"


class WebhookEndpoint(models.Model):
    """Where a tenant wants its alerts. The signing secret is stored encrypted (gateway.crypto);
    its plaintext is shown once, at creation or rotation (billing.webhooks.create_endpoint,
    rotate_secret). After a rotation with a grace period the replaced secret, still encrypted,
    keeps signing until previous_secret_expires_at."""

    public_id = models.CharField(max_length=32, unique=True, editable=False,
                                 default=_new_webhook_id)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="webhook_endpoints")
    url = models.URLField(max_length=2000)
    secret_encrypted = models.TextField(editable=False, help_text="Fernet ciphertext.")
    previous_secret_encrypted = models.TextField(
        blank=True, default="", editable=False,
        help_text="Fernet ciphertext of the secret replaced by the last rotation; empty if none.")
    previous_secret_expires_at = models.DateTimeField(
        null=True, blank=True, editable=False,
        help_text="Until when the replaced secret also signs deliveries (a rotation's grace).")
    events = models.JSONField(default=list, blank=True,
                              help_text='Event types sent here, e.g. ["quota.threshold"].')
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant_id", "created_at"]

    def __str__(self) -> str:
        return self.public_id

    @property
    def secret(self) -> str:
        from gateway.crypto import decrypt_secret

        return decrypt_secret(self.secret_encrypted)

    def previous_secret_valid_until(self, now: datetime) -> datetime | None:
        """The end of the replaced secret's grace period, or None when it no longer signs."""
        if self.previous_secret_encrypted and self.previous_secret_expires_at is not None \
                and self.previous_secret_expires_at > now:
            return self.previous_secret_expires_at
        return None


class WebhookDelivery(models.Model):
    """One event for one endpoint, and the log of its delivery attempts."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed (gave up)"

    # What the API and the console call a delivery (database ids are never shown).
    public_id = models.CharField(max_length=32, unique=True, editable=False,
                                 default=new_delivery_id)
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE,
                                 related_name="deliveries")
    event_type = models.CharField(max_length=32, choices=WebhookEvent.choices)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # A person asked for it (a test event or a redelivery): while it is pending it counts
    # against the tenant's TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX (billing.webhooks).
    manual = models.BooleanField(default=False, help_text="Requested by a person (test event "
                                 "or redelivery).")
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True,
                                           help_text="When the next attempt is due (pending).")
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.event_type} to {self.endpoint_id} ({self.status})"


class AlertState(models.Model):
    """A threshold alert that has fired. The unique constraint is what makes an alert fire once
    per threshold per window, whatever the number of detectors racing (billing/alerts.py)."""

    EXHAUSTED = 0  # the threshold value of "nothing left"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="alert_states")
    scope = models.CharField(max_length=64, help_text='"tenant" or "project:<id>".')
    window = models.CharField(max_length=32, help_text='e.g. "d2026-11-30" or "m2026-11".')
    threshold = models.PositiveSmallIntegerField(help_text="Percent remaining; 0: exhausted.")
    fired_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "scope", "window", "threshold"],
                                    name="alert_state_once_per_window"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.scope} {self.window} {self.threshold}%"


class PaceTrip(models.Model):
    """A burn-rate breaker trip (quotas/pace.py) that has been announced. Its unique constraint
    makes the `breaker.tripped` webhook and the owners' email go out once per trip, whatever the
    number of detectors racing (billing/alerts.py); the rows are the trips' history."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="pace_trips")
    scope = models.CharField(max_length=64, help_text='"tenant", "project:<id>" or "key:<id>".')
    tripped_ms = models.BigIntegerField(help_text="When it tripped (Redis clock, ms).")
    until_ms = models.BigIntegerField(help_text="When its cool-down ends (Redis clock, ms).")
    owner = models.CharField(max_length=100, blank=True, help_text='e.g. "project:prj_...".')
    label = models.CharField(max_length=200, blank=True)
    rules = models.JSONField(default=list, blank=True)
    fired_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "scope", "tripped_ms"],
                                    name="pace_trip_once"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.scope} tripped at {self.tripped_ms}"


class ForecastAlert(models.Model):
    """A `quota.forecast` warning that has been sent: the scope's forecast reached the tenant's
    forecast_threshold_percent in this window (billing/forecast_alerts.py). Its unique
    constraint makes the webhook and the owners' email go out once per scope per window,
    whatever the number of detectors racing; the row keeps what was forecast."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="forecast_alerts")
    scope = models.CharField(max_length=64, help_text='"tenant", "project:<id>" or "key:<id>".')
    window = models.CharField(max_length=48, help_text='e.g. "d2026-11-30", "m2026-11", '
                              '"c2026-11-15".')
    threshold = models.PositiveSmallIntegerField(help_text="The tenant's threshold (percent of "
                                                 "the limit) when it fired.")
    limit = models.BigIntegerField(help_text="The limit plus recharged credit.")
    used = models.BigIntegerField(help_text="Used and held when it fired.")
    forecast = models.BigIntegerField(help_text="Tokens forecast at the window's end.")
    reach_at = models.DateTimeField(null=True, blank=True,
                                    help_text="When the limit would be reached at that pace.")
    method = models.CharField(max_length=32)
    fired_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "scope", "window"],
                                    name="forecast_alert_once_per_window"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.scope} {self.window} forecast {self.forecast}"


# ---------------------------------------------------------------------------------------------
# Reconciliation against the upstream bill (billing/reconciliation.py, billing/bills.py)
# ---------------------------------------------------------------------------------------------

from datetime import date  # noqa: E402 - kept with the reconciliation models
from decimal import Decimal  # noqa: E402

from tenants.ids import PUBLIC_ID_RANDOM_LENGTH, random_base62  # noqa: E402


def new_reconciliation_run_id() -> str:
    return "rec_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


class UpstreamKeyAlias(models.Model):
    """How an upstream bill names one of our provider keys.

    The mock upstream (and CSV exports made in its shape) name a key
    `gateway.mock_upstream.api_key_id(secret)` = "key_" + 12 hex digits of sha256(secret):
    reconciliation computes that alias itself (`derived`) whenever it runs. OpenAI's usage API
    reports its own key ids ("key_..."), which nothing here can compute: an operator enters them
    in the admin. A provider key may have several aliases (e.g. its secret was rotated).
    """

    provider_key = models.ForeignKey("gateway.ProviderKey", on_delete=models.CASCADE,
                                     related_name="upstream_aliases")
    upstream_key_id = models.CharField(max_length=200, unique=True,
                                       help_text="The key id as the upstream's bill names it.")
    derived = models.BooleanField(default=False, help_text="Computed from the secret (mock "
                                  "naming), not entered by an operator.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "upstream key alias"
        verbose_name_plural = "upstream key aliases"
        ordering = ["provider_key_id", "-created_at"]

    def __str__(self) -> str:
        return self.upstream_key_id


class ReconciliationRun(models.Model):
    """One comparison of the ledger with an upstream bill over [period_start, period_end).

    Every run is kept (the history): a later run of the same period, source and provider key
    points the earlier ones at itself with `superseded_by`, so "the current result" is the run
    with no successor.
    """

    class Source(models.TextChoices):
        OPENAI_API = "openai_api", "OpenAI organization usage API"
        CSV = "csv", "CSV import"
        MOCK = "mock", "Mock upstream's bill endpoint"

    class Status(models.TextChoices):
        OK = "ok", "OK: every row within tolerance"
        DRIFT = "drift", "Drift: some rows flagged"
        FAILED = "failed", "Failed: the bill could not be read"

    public_id = models.CharField(max_length=32, unique=True, editable=False,
                                 default=new_reconciliation_run_id)
    period_start = models.DateField(help_text="First UTC day compared.")
    period_end = models.DateField(help_text="UTC day after the last one compared (exclusive).")
    source = models.CharField(max_length=16, choices=Source.choices)
    source_detail = models.CharField(max_length=500, blank=True,
                                     help_text="Where the bill came from (URL or file name).")
    provider_key = models.ForeignKey("gateway.ProviderKey", on_delete=models.SET_NULL, null=True,
                                     blank=True, related_name="reconciliation_runs",
                                     help_text="Empty: every provider key.")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    status = models.CharField(max_length=8, choices=Status.choices)
    tolerance = models.DecimalField(max_digits=7, decimal_places=6, default=Decimal("0.05"))
    ours_input_tokens = models.BigIntegerField(default=0)
    ours_output_tokens = models.BigIntegerField(default=0)
    ours_cost_micros = models.BigIntegerField(default=0)
    theirs_input_tokens = models.BigIntegerField(default=0)
    theirs_output_tokens = models.BigIntegerField(default=0)
    theirs_cost_micros = models.BigIntegerField(null=True, blank=True,
                                                help_text="Empty: the bill gives no cost.")
    rows_count = models.PositiveIntegerField(default=0)
    flagged_count = models.PositiveIntegerField(default=0)
    max_difference_rate = models.DecimalField(max_digits=9, decimal_places=6, default=Decimal(0))
    error = models.TextField(blank=True)
    superseded_by = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True,
                                      related_name="superseded")

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["period_start", "source", "provider_key"])]
        constraints = [
            models.CheckConstraint(name="reconciliation_period_ordered",
                                   condition=models.Q(period_end__gt=models.F("period_start"))),
        ]

    def __str__(self) -> str:
        return self.public_id

    @property
    def day(self) -> date | None:
        """The UTC day compared, for a one-day run."""
        days = (self.period_end - self.period_start).days
        return self.period_start if days == 1 else None


class ReconciliationRow(models.Model):
    """Ours and theirs for one (provider key, model, UTC day) of a run."""

    run = models.ForeignKey(ReconciliationRun, on_delete=models.CASCADE, related_name="rows")
    provider_key = models.ForeignKey("gateway.ProviderKey", on_delete=models.SET_NULL, null=True,
                                     blank=True, related_name="+",
                                     help_text="Empty: the bill's key is none of ours.")
    api_key_id = models.CharField(max_length=500, blank=True,
                                  help_text="The upstream's key id(s) as the bill names them.")
    model = models.CharField(max_length=200)
    day = models.DateField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.SET_NULL, null=True, blank=True,
                               related_name="+",
                               help_text="Set when the provider key is dedicated to one tenant.")
    ours_requests = models.BigIntegerField(default=0)
    ours_input = models.BigIntegerField(default=0)
    ours_output = models.BigIntegerField(default=0)
    ours_cost_micros = models.BigIntegerField(default=0)
    theirs_requests = models.BigIntegerField(default=0)
    theirs_input = models.BigIntegerField(default=0)
    theirs_output = models.BigIntegerField(default=0)
    theirs_cost_micros = models.BigIntegerField(null=True, blank=True,
                                                help_text="Empty: the bill gives no cost.")
    # Token classes (part of the input and output above). Theirs are empty when the bill does
    # not report the class (OpenAI's usage API reports no reasoning tokens): not compared then.
    ours_cached_input = models.BigIntegerField(default=0)
    ours_cache_write = models.BigIntegerField(default=0)
    ours_reasoning = models.BigIntegerField(default=0)
    theirs_cached_input = models.BigIntegerField(null=True, blank=True,
                                                 help_text="Empty: the bill does not say.")
    theirs_cache_write = models.BigIntegerField(null=True, blank=True,
                                                help_text="Empty: the bill does not say.")
    theirs_reasoning = models.BigIntegerField(null=True, blank=True,
                                              help_text="Empty: the bill does not say.")
    theirs_priced_micros = models.BigIntegerField(
        null=True, blank=True, help_text="The bill's usage at our prices (each token class at "
        "its price, the price of the start of the day); empty: the model has no price.")
    difference = models.BigIntegerField(default=0,
                                        help_text="Their tokens minus ours (input + output).")
    difference_rate = models.DecimalField(
        max_digits=9, decimal_places=6, default=Decimal(0),
        help_text="|difference| / max(ours, theirs) in tokens; 0 when both are 0.")
    flagged = models.BooleanField(default=False)
    note = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["day", "provider_key_id", "model"]
        indexes = [models.Index(fields=["run", "flagged"])]

    def __str__(self) -> str:
        return f"{self.day} {self.api_key_id or self.provider_key_id} {self.model}"
