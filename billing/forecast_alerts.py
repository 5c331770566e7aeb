"""Forecast warnings: `quota.forecast` (webhook and the owners' email) when a limited scope's
forecast (billing/forecast.py) reaches the tenant's forecast_threshold_percent of its limit.

Run by the beat (billing.tasks.check_quota_forecasts) for every tenant whose threshold is not 0,
like the threshold alerts' catch-up (billing/alerts.py), with the same economy: the counters of a
chunk of tenants are read in one Redis round trip per tenant (idle tenants, with no counter in
their current windows since nothing was reserved in them, cost that pipelined read only); for
the active scopes, the ForecastAlert rows of the current day and cycle windows are read next, and
the ledger's history (one grouped query per tenant) only for the active scopes not yet warned in
their window: a tenant whose active scopes were all warned reads no history.

Exactly once per scope per window: a warning fires when its ForecastAlert row is inserted
(INSERT ... ON CONFLICT DO NOTHING on the unique (tenant, scope, window)); only the detector whose
insert returned the row creates the webhook deliveries (in the same transaction) and mails the
owners. A scope whose limit is already reached gets no forecast warning: quota.exhausted says
more (billing/alerts.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction

from billing import webhooks
from billing.alerts import mail_owners, owner_emails
from billing.forecast import ForecastSettings, ScopeForecast, scope_forecasts
from billing.models import ForecastAlert, WebhookEvent
from quotas.engine import QuotaStoreUnavailable
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import Tenant

log = logging.getLogger(__name__)

_CHUNK = 200


@dataclass(frozen=True)
class ForecastWarning:
    """A warning that this call fired (inserted its ForecastAlert)."""

    tenant_id: int
    tenant: str  # slug
    threshold: int
    scope: ScopeForecast
    delivery_ids: tuple[int, ...] = ()
    emailed: tuple[str, ...] = ()


def _due(item: ScopeForecast, threshold: int) -> bool:
    fc = item.forecast
    if fc.so_far >= fc.capacity:
        return False  # reached already: quota.exhausted's business
    return fc.tokens * 100 >= threshold * fc.capacity


def _insert(tenant: Tenant, item: ScopeForecast, threshold: int) -> bool:
    """True when this call inserted the row (so it, and only it, fires the warning)."""
    fc = item.forecast
    q = connection.ops.quote_name
    columns = ["tenant_id", "scope", "window", "threshold", "limit", "used", "forecast",
               "reach_at", "method", "fired_at"]
    reach = None if fc.reach_ms is None else datetime.fromtimestamp(fc.reach_ms / 1000, UTC)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {q(ForecastAlert._meta.db_table)} "
            f"({', '.join(q(c) for c in columns)}) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now()) "
            f"ON CONFLICT ({q('tenant_id')}, {q('scope')}, {q('window')}) DO NOTHING "
            "RETURNING id",
            [tenant.pk, item.scope, fc.window.id, threshold, fc.capacity, fc.so_far, fc.tokens,
             reach, fc.method])
        return cursor.fetchone() is not None


def _what(item: ScopeForecast) -> str:
    window = "daily" if item.window_kind is WindowKind.DAY else "cycle"
    quota = f"the {window} token quota"
    return quota if item.kind == "tenant" else f"{quota} of {item.who}"


def _subject(tenant: Tenant, item: ScopeForecast) -> str:
    fc = item.forecast
    return (f"[Tollgate] {tenant.slug}: {_what(item)} is forecast to reach {fc.percent:g}% "
            "by the end of its window")


def _body(tenant: Tenant, item: ScopeForecast, threshold: int) -> str:
    fc = item.forecast
    reach = ("At this pace the limit would be reached at "
             f"{webhooks_iso(fc.reach_ms)}." if fc.reach_ms is not None else
             "At this pace the limit would not be reached in this window.")
    return (f"{tenant.slug}: {_what(item)} is forecast to end its window at {fc.tokens:,} "
            f"tokens, {fc.percent:g}% of its limit (your forecast threshold is {threshold}%).\n\n"
            f"Window: {fc.window.id} ({webhooks_iso(fc.window.start_ms)} to "
            f"{webhooks_iso(fc.window.end_ms)})\nLimit: {fc.capacity:,} tokens\n"
            f"Used so far: {fc.used:,}\nIn flight: {fc.pending:,}\n"
            f"Forecast: {fc.tokens:,}\n{reach}\n\n"
            f"How: {fc.explanation()}\n\n"
            "One warning per window. An owner or admin can change the threshold (0: no "
            "forecast warnings) on the console's Limits page.\n")


def webhooks_iso(ms: int | None) -> str:
    return "" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).strftime(
        "%Y-%m-%d %H:%M UTC")


def _fire(tenant: Tenant, item: ScopeForecast, threshold: int) -> ForecastWarning | None:
    with transaction.atomic():
        if not _insert(tenant, item, threshold):
            return None
        payload = webhooks.event_payload(WebhookEvent.FORECAST, tenant, **item.as_dict(),
                                         threshold=threshold)
        deliveries = webhooks.create_deliveries(tenant, WebhookEvent.FORECAST, payload)
    log.info("forecast warning: %s %s %s at %s%% (%s)", tenant.slug, item.who,
             item.forecast.window.id, item.forecast.percent, item.forecast.method)
    emailed = mail_owners(_subject(tenant, item), _body(tenant, item, threshold),
                           owner_emails(tenant),
                           f"the {item.forecast.window.id} forecast of {tenant.slug}")
    return ForecastWarning(tenant.pk, tenant.slug, threshold, item,
                           delivery_ids=tuple(d.pk for d in deliveries), emailed=emailed)


def check_tenant(tenant: Tenant, *, engine: Any = None,
                 settings: ForecastSettings | None = None) -> list[ForecastWarning]:
    """Fire the tenant's forecast warnings due now; returns the ones this call fired."""
    threshold = int(tenant.forecast_threshold_percent or 0)
    if threshold <= 0:
        return []

    def warned(window_ids: set[str]) -> set[tuple[str, str]]:
        # The scopes already warned in the current windows, read before any history (asked only
        # when a scope is active), so a warned scope costs no ledger read. A window that turns
        # meanwhile is not in it: its scopes are forecast, and the insert's ON CONFLICT still
        # fires each warning once.
        return set(ForecastAlert.objects.filter(tenant=tenant, window__in=window_ids)
                   .values_list("scope", "window"))

    items = scope_forecasts(tenant, engine=engine, active_only=True, settings=settings,
                            exclude=warned)
    fired = []
    for item in items:
        if not _due(item, threshold):
            continue
        warning = _fire(tenant, item, threshold)
        if warning is not None:
            fired.append(warning)
    return fired


def forecast_tenant_ids() -> list[int]:
    """The tenants that want forecast warnings (threshold above 0)."""
    return list(Tenant.objects.filter(forecast_threshold_percent__gt=0).order_by("pk")
                .values_list("pk", flat=True))


def _chunks(items: Sequence[int]) -> Iterable[Sequence[int]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start:start + _CHUNK]


def check_forecasts(tenant_ids: Iterable[int] | None = None, *, engine: Any = None,
                    ) -> list[ForecastWarning]:
    """Fire every forecast warning due for these tenants (default: every tenant with a
    threshold); returns the ones this call fired (deliveries created, not yet dispatched: see
    billing.tasks.dispatch_deliveries). One tenant's failure (a ledger query, say) is logged
    and does not stop the others."""
    engine = engine or get_engine()
    settings = ForecastSettings.from_django()
    ids = forecast_tenant_ids() if tenant_ids is None else list(dict.fromkeys(tenant_ids))
    fired: list[ForecastWarning] = []
    for chunk in _chunks(ids):
        for tenant in Tenant.objects.select_related("plan").filter(pk__in=chunk).order_by("pk"):
            try:
                fired += check_tenant(tenant, engine=engine, settings=settings)
            except QuotaStoreUnavailable:
                raise  # every tenant would fail alike: the next run catches up
            except Exception:  # noqa: BLE001 - one tenant's failure must not starve the rest
                log.exception("forecast check of tenant %s failed", tenant.slug)
    return fired
