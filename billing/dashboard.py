"""The figures the console dashboard shows of a tenant, gathered in one place (the page in
config/console/dashboard_views.py only draws them).

Live figures (gauges, open holds, refused today) come from the Redis counters, so a /v1 call
shows at once; the 30-day usage per day and model (the chart's data) comes from the ledger, a few
seconds behind. When Redis is down the live part is None and the page says so; the ledger part
still renders. Days and the "month" are the tenant's: its local days and its cycle window
(quotas.cycles), the windows its counters count in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from billing.forecast import Forecast, ScopeForecast, scope_forecasts
from billing.models import AlertState, ForecastAlert, WebhookDelivery
from billing.usage import total_tokens, usage_totals, window_totals
from quotas.cycles import Span, current_windows, cycle_standing
from quotas.engine import QuotaStoreUnavailable
from quotas.keys import api_key_scope
from quotas.limits import PROJECT, TENANT
from quotas.status import (
    QuotaStatus,
    RefusedCount,
    ScopeStatus,
    quota_status,
    refused_today,
)
from tenants.models import ApiKey, Project, Tenant

log = logging.getLogger(__name__)

CHART_DAYS = 30


@dataclass(frozen=True)
class Gauge:
    """One scope's usage in one window, as the dashboard draws it."""

    label: str
    window: str  # "day" / "month"
    used: int
    pending: int
    limit: int | None  # None: unlimited (usage shown without a bar)
    remaining: int | None
    percent: float | None
    # "live": the Redis counter; "ledger": a scope without a live counter (a project's month
    # when it has no monthly limit), read from the usage ledger, a few seconds behind.
    source: str = "live"
    # Where the window is heading (billing/forecast.py): drawn as a dashed mark on the bar.
    forecast: Forecast | None = None

    @property
    def level(self) -> str:
        """CSS class of the bar: green below 75 %, amber below 90 %, red above."""
        if self.percent is None or self.percent < 75:
            return ""
        return "warn" if self.percent < 90 else "bad"

    @property
    def percent_text(self) -> str:
        return "" if self.percent is None else f"{self.percent:.0f}%"

    @property
    def width(self) -> str:
        """The bar's CSS width (a dot, not a comma, whatever the locale)."""
        return "0%" if self.percent is None else f"{self.percent:.1f}%"

    @property
    def forecast_left(self) -> str:
        """Where the dashed forecast mark stands on the bar (CSS left; the bar's end when the
        forecast goes past the limit)."""
        if self.forecast is None:
            return "0%"
        return f"{min(max(self.forecast.percent, 0.0), 100.0):.1f}%"

    @property
    def forecast_over(self) -> bool:
        return self.forecast is not None and self.forecast.tokens > self.forecast.capacity

    @property
    def forecast_text(self) -> str:
        return "" if self.forecast is None else self.forecast.summary()


@dataclass(frozen=True)
class ScopeGauges:
    label: str
    kind: str  # tenant / project
    ref: str
    day: Gauge
    month: Gauge


@dataclass(frozen=True)
class LiveStatus:
    scopes: list[ScopeGauges]
    open_holds: int
    refused: list[RefusedCount]
    # The tenant's own limited windows (day, cycle) with their forecasts, for the charts.
    forecasts: list[ScopeForecast] = field(default_factory=list)

    @property
    def refused_total(self) -> int:
        return sum(r.count for r in self.refused)


@dataclass(frozen=True)
class Dashboard:
    tenant: Tenant
    live: LiveStatus | None  # None: Redis is unreachable
    # Tokens per day and model over the CHART_DAYS days up to today (billing.usage.usage_totals
    # rows grouped by ("day", "model")), from chart_first_day.
    daily_usage: list[dict[str, Any]]
    chart_first_day: date
    alerts: list[AlertState]
    deliveries: list[WebhookDelivery]
    month_tokens: int  # from the ledger, in the current cycle window
    today: date  # the tenant's local day
    project_labels: dict[str, str] = field(default_factory=dict)
    key_labels: dict[str, str] = field(default_factory=dict)  # "key:<pk>" -> name
    forecast_alerts: list[ForecastAlert] = field(default_factory=list)
    cycle: Span | None = None  # the current cycle window ("this month")
    cycle_description: str = ""  # e.g. "monthly from the 15th"


def cycle_label(span: Span | None) -> str:
    """What the gauges call the 'month' window: "This month" for a calendar month, else
    "This cycle" (a day, a week, a month from a billing day...)."""
    return "This month" if span is None or span.id.startswith("m") else "This cycle"


ForecastIndex = dict[tuple[str, str, str], Forecast]


def forecast_index(forecasts: list[ScopeForecast]) -> ForecastIndex:
    """Forecasts by (scope kind, public id, window: "day" / "month"), as ScopeStatus names
    them."""
    return {(f.kind, f.ref, f.window_kind.value): f.forecast for f in forecasts}


def _gauge(status: ScopeStatus, label: str, forecasts: ForecastIndex | None = None) -> Gauge:
    forecast = (forecasts or {}).get((status.kind, status.ref, status.window))
    return Gauge(label=label, window=status.window, used=status.used, pending=status.pending,
                 limit=status.limit if status.limited else None,
                 remaining=status.remaining if status.limited else None,
                 percent=status.percent_used,
                 forecast=forecast if status.limited else None)


def scope_gauges(status: QuotaStatus, tenant: Tenant,
                 ledger_month: dict[str, int] | None = None,
                 forecasts: ForecastIndex | None = None,
                 month_label: str = "This month") -> list[ScopeGauges]:
    """The tenant's gauges first, then one per project (with its own limits or not).
    `ledger_month` (project public id -> tokens this month) stands in for month counters
    that do not exist live; `forecasts` (forecast_index) put a forecast on limited gauges."""
    out = []
    for kind in ("tenant", "project"):
        days = {s.ref: s for s in status.of(kind, "day")}
        months = {s.ref: s for s in status.of(kind, "month")}
        for ref, day in days.items():
            label = tenant.name if kind == "tenant" else day.label
            live_month = months.get(ref)
            month = (_gauge(live_month, month_label, forecasts) if live_month is not None else
                     Gauge(label=month_label, window="month",
                           used=(ledger_month or {}).get(ref, 0), pending=0, limit=None,
                           remaining=None, percent=None, source="ledger"))
            out.append(ScopeGauges(label=label, kind=kind, ref=ref,
                                   day=_gauge(day, "Today", forecasts), month=month))
    return out


def live_status(tenant: Tenant, ledger_month: dict[str, int] | None = None,
                month_label: str = "This month") -> LiveStatus | None:
    try:
        # No key's counters: the dashboard draws the tenant's and the projects' gauges only.
        status = quota_status(tenant, keys=())
        refused = refused_today(tenant)
        # Only the scopes the dashboard draws gauges for: the tenant and its projects.
        forecasts = scope_forecasts(tenant, kinds=(TENANT, PROJECT))
    except QuotaStoreUnavailable as exc:
        log.warning("dashboard of %s without live counters: %s", tenant.public_id, exc)
        return None
    return LiveStatus(scope_gauges(status, tenant, ledger_month, forecast_index(forecasts),
                                   month_label),
                      status.open_holds, refused,
                      [f for f in forecasts if f.kind == "tenant"])


def build(tenant: Tenant, *, now: datetime | None = None) -> Dashboard:
    # The tenant's day and cycle window now (on the Redis clock unless `now` is given).
    at_ms = int(now.timestamp() * 1000) if now is not None else None
    day, cycle = current_windows(tenant, at_ms)
    today = day.start.date()
    chart_first_day = today - timedelta(days=CHART_DAYS - 1)
    daily_usage = usage_totals(tenant, chart_first_day, today, ("day", "model"))
    month_tokens = total_tokens(tenant, cycle.start, cycle.end)
    alerts = list(AlertState.objects.filter(tenant=tenant).order_by("-fired_at", "-id")[:10])
    forecast_alerts = list(ForecastAlert.objects.filter(tenant=tenant)
                           .order_by("-fired_at", "-id")[:10])
    deliveries = list(WebhookDelivery.objects.filter(endpoint__tenant=tenant)
                      .select_related("endpoint").order_by("-created_at", "-id")[:10])
    projects = {f"project:{pk}": slug for pk, slug in
                Project.objects.filter(tenant=tenant).values_list("pk", "slug")}
    key_labels = {api_key_scope(pk): name or public_id for pk, name, public_id in
                  ApiKey.objects.filter(project__tenant=tenant, revoked_at__isnull=True)
                  .values_list("pk", "name", "public_id")} if forecast_alerts else {}
    ledger_month = {row["project"]: row["total_tokens"]
                    for row in window_totals(tenant, cycle.start, cycle.end, ("project",))
                    if row["project"]}
    return Dashboard(tenant=tenant, live=live_status(tenant, ledger_month, cycle_label(cycle)),
                     daily_usage=daily_usage, chart_first_day=chart_first_day, alerts=alerts,
                     deliveries=deliveries, month_tokens=month_tokens, today=today,
                     project_labels=projects, forecast_alerts=forecast_alerts,
                     key_labels=key_labels, cycle=cycle,
                     cycle_description=cycle_standing(tenant, at_ms).description)


def alert_rows(dashboard: Dashboard) -> list[dict[str, object]]:
    """AlertState rows in words: which quota, which window, which threshold."""
    rows = []
    for alert in dashboard.alerts:
        scope = ("Tenant" if alert.scope == "tenant"
                 else f"Project {dashboard.project_labels.get(alert.scope, '(deleted)')}")
        what = ("exhausted" if alert.threshold == AlertState.EXHAUSTED
                else f"{alert.threshold}% or less left")
        rows.append({"scope": scope, "what": what, "window": _period(alert.window),
                     "fired_at": alert.fired_at,
                     "exhausted": alert.threshold == AlertState.EXHAUSTED})
    for warning in dashboard.forecast_alerts:
        percent = 100 * warning.forecast / warning.limit if warning.limit > 0 else 100.0
        rows.append({"scope": _scope_words(warning.scope, dashboard),
                     "what": f"forecast {percent:.0f}% of the limit",
                     "window": _period(warning.window), "fired_at": warning.fired_at,
                     "exhausted": False})
    rows.sort(key=lambda row: row["fired_at"], reverse=True)
    return rows[:10]


def _scope_words(scope: str, dashboard: Dashboard) -> str:
    if scope == "tenant":
        return "Tenant"
    if scope.startswith("project:"):
        return f"Project {dashboard.project_labels.get(scope, '(deleted)')}"
    return f"Key {dashboard.key_labels.get(scope, '(revoked or deleted)')}"


def _period(window: str) -> str:
    # A first window after a change of cycle ends in "@<switch, epoch seconds>".
    base, _, switch = window.partition("@")
    words = (f"day {base[1:]}" if base.startswith("d")
             else f"month {base[1:]}" if base.startswith("m")
             else f"cycle from {base[1:]}" if base.startswith("c") else base)
    return f"{words} (after a change of cycle)" if switch else words
