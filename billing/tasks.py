"""Background jobs of the ledger (scheduled in config/settings.py CELERY_BEAT_SCHEDULE).

Every task has a soft and a hard time limit, and webhook deliveries run on their own queue
(config/celery.py), so a slow receiver can neither hold a worker nor delay the sweep and the
ledger drain."""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping

from celery import shared_task
from django.db import DatabaseError, transaction
from django.utils import timezone

from billing.alerts import check_thresholds
from billing.alerts import check_ledger_backlog as check_ledger_backlog_now
from billing.alerts import check_pending_health as check_pending_health_now
from billing.forecast_alerts import check_forecasts
from billing.ledger import DrainProgress, DrainResult, drain_all
from billing.metrics import refresh_closed_days
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.partitions import ensure_partitions
from billing.retention import apply_retention
from billing.rollups import prune_hourly
from billing.webhooks import (
    clear_expired_previous_secrets,
    deliver,
    due_delivery_ids,
    request_redelivery,
    request_test_event,
)
from quotas import active
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import Window
from tenants.models import Tenant

log = logging.getLogger(__name__)


@shared_task
def drain_usage() -> int:
    """Move the gateway's usage events into the ledger. Idempotent (unique request ids), and
    safe on several workers: a batch drained twice inserts nothing the second time.

    The tenants of the index of active tenants only (quotas/active.py), and every tenant on the
    job's full walk (TOLLGATE_ACTIVE_FULL_WALK_SECONDS, or at once when the index was lost),
    which marks again those it finds with events."""
    client = get_engine().client
    run = active.visit(client, active.DRAIN)
    progress = DrainProgress()
    try:
        result = drain_all(client, tenant_ids=run.tenants, progress=progress)
    except Exception:
        # PostgreSQL or Redis gone part-way: the batches committed before are in the ledger and
        # gone from their streams, so the next run will not bring their windows back. Checked
        # now (a window that has ended since is not in the per-minute check's), then the run
        # fails as it would have.
        _alerts_after_drain(progress.result())
        raise
    if run.full and result.windows:
        active.mark(client, (tenant_tag(t) for t in result.windows))
    active.walked(client, run)
    if result.events:
        log.info("recorded %d usage events of %d tenants (%d swept rows corrected)",
                 result.events, result.tenants, result.corrected)
    _alerts_after_drain(result)
    return result.events


# -- threshold alerts, webhooks and health (billing/alerts.py, billing/webhooks.py) -------------
# Beat entries (CELERY_BEAT_SCHEDULE): check_quota_thresholds, retry_due_webhooks and
# check_ledger_backlog every minute, check_pending_health every five minutes. Detection at
# settle time runs in drain_usage.

# Retries due within this long are queued with a countdown; later ones are left to the beat
# (retry_due_webhooks), so no task waits for hours in a worker (or past the broker's
# visibility timeout).
_COUNTDOWN_MAX_S = 300


def dispatch_deliveries(delivery_ids: Iterable[int]) -> int:
    """Queue one deliver_webhook task per delivery. A broker error is logged, not raised: the
    deliveries are due in PostgreSQL and retry_due_webhooks queues them within a minute."""
    queued = 0
    for delivery_id in delivery_ids:
        try:
            deliver_webhook.delay(delivery_id)
            queued += 1
        except Exception:  # noqa: BLE001 - see the docstring
            log.warning("could not queue webhook delivery %s; the beat will", delivery_id,
                        exc_info=True)
    return queued


def dispatch_after_commit(delivery_ids: Iterable[int]) -> None:
    """Queue the deliveries once the current transaction commits (at once outside one), so the
    worker finds their rows."""
    ids = list(delivery_ids)
    transaction.on_commit(lambda: dispatch_deliveries(ids))


def queue_test_event(endpoint: WebhookEndpoint, *, actor: str) -> WebhookDelivery:
    """A person's "send test event" (console, API): audited, queued for a worker, and returned
    pending at once; the delivery log shows its result when the receiver has answered."""
    delivery = request_test_event(endpoint, actor=actor)
    dispatch_after_commit([delivery.pk])
    return delivery


def queue_redelivery(delivery: WebhookDelivery, *, actor: str) -> WebhookDelivery:
    """A person's "redeliver" (console, API): audited, due now, queued for a worker."""
    delivery = request_redelivery(delivery, actor=actor)
    dispatch_after_commit([delivery.pk])
    return delivery


def _fire_alerts(tenant_ids: Iterable[int], windows: Mapping[int, Collection[Window]] | None = None,
                 ) -> int:
    alerts = check_thresholds(tenant_ids, windows=windows)
    dispatch_deliveries([i for alert in alerts for i in alert.delivery_ids])
    return len(alerts)


def _alerts_after_drain(result: DrainResult) -> None:
    """Detection at settle time, off the gateway's hot path: the drained events say whose
    counters moved and in which windows (also one that has ended since, for a settle just
    before midnight)."""
    if not result.windows:
        return
    try:
        _fire_alerts(list(result.windows), result.windows)
    except Exception:  # noqa: BLE001 - check_quota_thresholds catches up within a minute
        log.exception("threshold check after the drain failed; the beat will catch up")


@shared_task
def check_quota_thresholds() -> int:
    """The threshold alerts of the index's tenants (quotas/active.py: catch-up for anything
    the drain-time check missed; a tenant stays indexed for TOLLGATE_ACTIVE_RETENTION_SECONDS
    after its last call), and of every tenant on the job's full walk (a limit lowered under an
    idle tenant's usage). Safe on several workers: each alert is fired by the one detector that
    inserts its state."""
    client = get_engine().client
    run = active.visit(client, active.THRESHOLDS)
    fired = _fire_alerts(run.tenants)
    active.walked(client, run)
    if fired:
        log.info("fired %d quota alerts", fired)
    return fired


@shared_task
def check_quota_forecasts() -> int:
    """Every tenant's usage forecasts against its forecast_threshold_percent: a `quota.forecast`
    webhook and email once per scope per window (billing/forecast_alerts.py). Beat entry
    check-quota-forecasts, every TOLLGATE_FORECAST_INTERVAL_SECONDS (300). Safe on several
    workers: each warning is fired by the one detector that inserts its ForecastAlert row."""
    client = get_engine().client
    run = active.visit(client, active.FORECASTS)
    # Every tenant with a threshold on the full walk (a forecast that moves with the clock
    # alone, on an idle tenant's usual day), the index's in between.
    warnings = check_forecasts(None if run.full else list(
        Tenant.objects.filter(pk__in=run.tenants, forecast_threshold_percent__gt=0)
        .order_by("pk").values_list("pk", flat=True)))
    active.walked(client, run)
    dispatch_deliveries([i for warning in warnings for i in warning.delivery_ids])
    if warnings:
        log.info("sent %d forecast warnings", len(warnings))
    return len(warnings)


@shared_task
def deliver_webhook(delivery_id: int) -> str:
    """One attempt of a webhook delivery if due (idempotent: a delivered or not-yet-due one is
    skipped, and a conditional UPDATE gives each attempt to exactly one worker). A failed
    attempt is queued again after its backoff. Runs on the `webhooks` queue, each attempt within
    TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS, the task within its time limits (config/celery.py)."""
    delivery = deliver(delivery_id)
    if delivery is None:
        return "missing"
    if delivery.status == WebhookDelivery.Status.PENDING and delivery.next_attempt_at:
        wait = (delivery.next_attempt_at - timezone.now()).total_seconds()
        if wait <= _COUNTDOWN_MAX_S:
            try:
                deliver_webhook.apply_async((delivery_id,), countdown=max(wait, 0))
            except Exception:  # noqa: BLE001 - retry_due_webhooks queues it when due
                log.warning("could not queue the retry of delivery %s", delivery_id,
                            exc_info=True)
    return str(delivery.status)


@shared_task
def retry_due_webhooks() -> int:
    """Queue every pending delivery that is due (retries, new ones whose task was lost, attempts
    whose worker died). Duplicated tasks are harmless: deliver() claims each attempt once. Then
    forget the replaced signing secrets whose rotation grace has ended."""
    queued = dispatch_deliveries(due_delivery_ids())
    cleared = clear_expired_previous_secrets()
    if cleared:
        log.info("cleared %d webhook secret(s) replaced by a rotation whose grace ended", cleared)
    return queued


@shared_task
def check_pending_health() -> int:
    """Alert operators when a tenant's pending holds stay high (billing.alerts): the index's
    tenants (a tenant with open holds stays indexed), every tenant on the job's full walk."""
    client = get_engine().client
    run = active.visit(client, active.PENDING)
    raised = check_pending_health_now(tenant_ids=run.tenants)
    active.walked(client, run)
    return len(raised)


@shared_task
def check_ledger_backlog() -> int:
    """Alert operators when usage events wait too long for the drain (billing.alerts)."""
    return 1 if check_ledger_backlog_now() is not None else 0


@shared_task
def reconcile_daily(day: str | None = None) -> dict[str, object]:
    """Reconcile one UTC day (default: yesterday) against the upstream bill for every enabled
    provider key the configured source covers (settings.TOLLGATE_RECONCILE_SOURCE: "mock",
    "openai", or "" to disable). Safe on several workers: a Redis lock per day (SET NX PX) lets
    one of them run it and the others skip; running it again later stores new runs that
    supersede the earlier ones (billing/reconciliation.py)."""
    from datetime import date

    from django.conf import settings

    from billing.reconciliation import DayLocked, reconcile_configured, yesterday_utc

    kind = getattr(settings, "TOLLGATE_RECONCILE_SOURCE", "") or ""
    target = date.fromisoformat(day) if day else yesterday_utc()
    if not kind:
        log.info("reconciliation disabled (TOLLGATE_RECONCILE_SOURCE is empty)")
        return {"day": target.isoformat(), "skipped": "disabled", "runs": []}
    try:
        runs = reconcile_configured(target, kind, client=get_engine().client)
    except DayLocked:
        log.info("reconciliation of %s skipped: another worker holds its lock", target)
        return {"day": target.isoformat(), "skipped": "locked", "runs": []}
    log.info("reconciled %s (%s): %s", target, kind,
             ", ".join(f"{run.public_id}={run.status}" for run in runs) or "no provider keys")
    return {"day": target.isoformat(), "skipped": "",
            "runs": [{"id": run.public_id, "status": run.status} for run in runs]}


# -- the ledger's partitions and retention (billing/partitions.py, billing/retention.py) --------
# Beat entries (config/settings.py): both daily.


@shared_task
def ensure_ledger_partitions() -> int:
    """This month's ledger partition and the next two, and the month of any row the default
    partition caught (its rows moved in); the hourly usage rows older than
    TOLLGATE_FORECAST_HISTORY_DAYS + 2 days deleted (billing.rollups.prune_hourly); and the
    /metrics ledger totals of the closed days written anew (billing.metrics.refresh_closed_days).
    Returns how many partitions were created."""
    created = ensure_partitions()
    for made in created:
        log.info("ledger partition for %s created (%d rows moved from the default partition)",
                 made.month, made.moved)
    # The hourly table's upkeep rides on this daily task (always scheduled, unlike retention,
    # which does nothing by default): hours older than the forecasts read are deleted.
    pruned = prune_hourly()
    if pruned:
        log.info("%d hourly usage rows older than the forecasts' history deleted", pruned)
    # Likewise the counters' totals: one sum of the rollups a day, not one per scrape. On its
    # own: a failure here (the rollups held by drains past the lock timeout) leaves the
    # partitions made, and the totals for the next day.
    try:
        log.info("/metrics ledger totals written for the days before %s", refresh_closed_days())
    except DatabaseError:
        log.warning("the /metrics ledger totals were not refreshed; the next day will",
                    exc_info=True)
    return len(created)


# Acknowledged when a worker takes it, not when it ends (CELERY_TASK_ACKS_LATE is on for the
# others): it may run for hours, longer than the Redis broker's visibility timeout (1 h) or
# RabbitMQ's consumer timeout (30 min), after which an unacknowledged message is delivered to a
# second worker while the first still runs. A run lost with its worker is the next day's.
@shared_task(acks_late=False)
def ledger_retention() -> int:
    """Drop the raw months past TOLLGATE_LEDGER_RETENTION_MONTHS that pass their checks
    (billing/retention.py); returns how many were dropped. Refusals are logged as warnings."""
    return sum(1 for outcome in apply_retention() if outcome.action == "dropped")
