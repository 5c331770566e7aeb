"""Threshold alerts (remaining quota crossing the tenant's percentages, and exhaustion) and the
pending-holds health check.

Detection reads the current day and month counters from Redis (tenant scope, and every project
with a limit of its own), off the gateway's hot path: the ledger drain calls it for the tenants
whose usage events it just moved (within seconds of the settle), and a beat job calls it for
every tenant each minute to catch anything missed.

Exactly once per threshold per window: an alert fires when its AlertState row is inserted
(INSERT ... ON CONFLICT DO NOTHING on the unique (tenant, scope, window, threshold)); only the
detector whose insert returned the row creates the webhook deliveries (in the same transaction)
and mails the tenant's owners. Any number of detectors may race.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage, mail_admins
from django.db import connection, transaction
from django.db.models import Q

from billing import webhooks
from billing.models import AlertState, WebhookEvent
from quotas import keys
from quotas.limits import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import Calendar, WindowKind
from tenants.models import Membership, Project, Tenant
from tenants.selectors import effective_limits

log = logging.getLogger(__name__)

_CHUNK = 200
# The counter hash layout documented in quotas/keys.py.
_FIELDS = ("limit", "used", "pending", "credit")
_KIND_NAMES = {WindowKind.DAY: "daily", WindowKind.MONTH: "monthly"}


@dataclass(frozen=True)
class Alert:
    """An alert that this call fired (inserted its AlertState)."""

    tenant_id: int
    tenant: str  # slug
    scope: str  # "tenant" or "project:<id>" (AlertState.scope)
    label: str  # "tenant" or "project:<slug>" (the payload's scope)
    window: str
    threshold: int  # percent remaining; 0 = exhausted
    limit: int
    used: int
    pending: int
    credit: int
    remaining: int
    delivery_ids: tuple[int, ...] = ()
    emailed: tuple[str, ...] = ()

    @property
    def event_type(self) -> str:
        return WebhookEvent.EXHAUSTED if self.threshold == AlertState.EXHAUSTED else \
            WebhookEvent.THRESHOLD


@dataclass(frozen=True)
class _Watched:
    tenant: Tenant
    scope: str
    label: str
    kind: WindowKind
    limit: int
    thresholds: tuple[int, ...]


def _chunks(items: Sequence[int], size: int = _CHUNK) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _as_int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def _thresholds(tenant: Tenant) -> tuple[int, ...]:
    """The tenant's percentages, highest first (so receivers see 10 before 5)."""
    return tuple(sorted({int(t) for t in (tenant.alert_thresholds or []) if int(t) > 0},
                        reverse=True))


def _watched(tenants: Iterable[Tenant]) -> list[_Watched]:
    """The limited counters of these tenants: tenant day and month, and projects' own limits.
    Limits come from PostgreSQL (what the gateway passes to the reserve script)."""
    tenants = list(tenants)
    by_id = {t.pk: t for t in tenants}
    watched = []
    for tenant in tenants:
        thresholds = _thresholds(tenant)
        limits = effective_limits(tenant)
        for kind, limit in ((WindowKind.DAY, limits.tokens_per_day),
                            (WindowKind.MONTH, limits.monthly_token_budget)):
            if limit > 0:
                watched.append(_Watched(tenant, keys.tenant_scope(), "tenant", kind, limit,
                                        thresholds))
    projects = Project.objects.filter(tenant_id__in=by_id).filter(
        Q(tokens_per_day__isnull=False) | Q(tokens_per_month__isnull=False)).order_by("pk")
    for project in projects:
        tenant = by_id[project.tenant_id]
        thresholds = _thresholds(tenant)
        for kind, limit in ((WindowKind.DAY, project.tokens_per_day),
                            (WindowKind.MONTH, project.tokens_per_month)):
            if limit is not None and limit > 0:
                watched.append(_Watched(tenant, keys.project_scope(project.pk),
                                        f"project:{project.slug}", kind, limit, thresholds))
    return watched


def _read_counters(client: Any, counter_keys: list[str]) -> list[list[Any]]:
    """HMGET of these counters in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for key in counter_keys:
        pipe.hmget(key, _FIELDS)
    return pipe.execute() if counter_keys else []


def _insert_state(tenant_id: int, scope: str, window: str, threshold: int) -> bool:
    """True when this call inserted the row (so it, and only it, fires the alert)."""
    q = connection.ops.quote_name
    columns = ", ".join(q(c) for c in ("tenant_id", "scope", "window", "threshold"))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {q(AlertState._meta.db_table)} ({columns}, {q('fired_at')}) "
            f"VALUES (%s, %s, %s, %s, now()) ON CONFLICT ({columns}) DO NOTHING RETURNING id",
            [tenant_id, scope, window, threshold])
        return cursor.fetchone() is not None


def _owner_emails(tenant: Tenant) -> list[str]:
    emails = (Membership.objects.filter(tenant=tenant, role=Membership.Role.OWNER,
                                        user__is_active=True)
              .exclude(user__email="").values_list("user__email", flat=True))
    return sorted(set(emails))


def _describe(alert: Alert, kind: WindowKind) -> str:
    what = f"the {_KIND_NAMES[kind]} token quota of {alert.label}" if alert.label != "tenant" \
        else f"the {_KIND_NAMES[kind]} token quota"
    if alert.threshold == AlertState.EXHAUSTED:
        return f"{alert.tenant}: {what} is exhausted"
    return f"{alert.tenant}: {alert.threshold}% or less of {what} remains"


def _email(alert: Alert, kind: WindowKind, recipients: list[str]) -> tuple[str, ...]:
    if not recipients:
        return ()
    subject = f"[Tollgate] {_describe(alert, kind)}"
    body = (f"{_describe(alert, kind)}.\n\n"
            f"Window: {alert.window}\nLimit: {alert.limit} tokens\nUsed: {alert.used}\n"
            f"In flight: {alert.pending}\nRemaining: {max(alert.remaining, 0)}\n")
    try:
        EmailMessage(subject, body, to=recipients).send()
    except Exception:  # noqa: BLE001 - a mail server outage must not undo a fired alert
        log.exception("could not mail the %s alert to the owners of %s", alert.window,
                      alert.tenant)
        return ()
    return tuple(recipients)


def _fire(item: _Watched, window: str, threshold: int, used: int, pending: int, credit: int,
          remaining: int) -> Alert | None:
    tenant = item.tenant
    alert = Alert(tenant_id=tenant.pk, tenant=tenant.slug, scope=item.scope, label=item.label,
                  window=window, threshold=threshold, limit=item.limit, used=used,
                  pending=pending, credit=credit, remaining=remaining)
    with transaction.atomic():
        if not _insert_state(tenant.pk, item.scope, window, threshold):
            return None
        payload = webhooks.event_payload(
            alert.event_type, tenant, scope=item.label, window=window, limit=item.limit,
            used=used, pending=pending, remaining=max(remaining, 0), threshold=threshold)
        deliveries = webhooks.create_deliveries(tenant, alert.event_type, payload)
    log.info("alert: %s (%s)", _describe(alert, item.kind), window)
    emailed = _email(alert, item.kind, _owner_emails(tenant))
    return dataclasses.replace(alert, delivery_ids=tuple(d.pk for d in deliveries),
                               emailed=emailed)


def check_thresholds(tenant_ids: Iterable[int], *, engine: Any = None) -> list[Alert]:
    """Fire every alert due for these tenants' current windows; returns the ones this call
    fired (deliveries created, not yet dispatched: see billing.tasks.dispatch_deliveries)."""
    engine = engine or get_engine()
    ids = list(dict.fromkeys(int(i) for i in tenant_ids))
    calendar = Calendar(0)  # the gateway's windows are UTC (quotas.limits passes no offset)
    fired: list[Alert] = []
    for chunk in _chunks(ids):
        watched = _watched(Tenant.objects.select_related("plan").filter(pk__in=chunk)
                           .order_by("pk"))
        if not watched:
            continue
        now_ms = engine.clock.now_ms()
        windows = {kind: calendar.window(kind, now_ms).id
                   for kind in (WindowKind.DAY, WindowKind.MONTH)}
        rows = _read_counters(engine.client, [
            keys.counter_key(tenant_tag(w.tenant.pk), w.scope, windows[w.kind]) for w in watched])
        candidates = []
        for item, row in zip(watched, rows, strict=True):
            stored_limit, used, pending, credit = row
            if stored_limit is None:
                continue  # nothing reserved in this window yet
            used, pending, credit = _as_int(used), _as_int(pending), _as_int(credit)
            remaining = item.limit + credit - used - pending
            crossed = [t for t in item.thresholds if remaining * 100 <= t * item.limit]
            if remaining <= 0:
                crossed.append(AlertState.EXHAUSTED)
            for threshold in crossed:
                candidates.append((item, windows[item.kind], threshold, used, pending, credit,
                                   remaining))
        if not candidates:
            continue
        # Skip the alerts fired already with one query; the insert decides the races.
        done = set(AlertState.objects.filter(
            tenant_id__in={c[0].tenant.pk for c in candidates},
            window__in={c[1] for c in candidates},
        ).values_list("tenant_id", "scope", "window", "threshold"))
        for item, window, threshold, *numbers in candidates:
            if (item.tenant.pk, item.scope, window, threshold) in done:
                continue
            alert = _fire(item, window, threshold, *numbers)
            if alert is not None:
                fired.append(alert)
    return fired


def all_tenant_ids() -> list[int]:
    return list(Tenant.objects.order_by("pk").values_list("pk", flat=True))


def tenants_with_usage_events(client: Any, tenant_ids: Sequence[int] | None = None) -> list[int]:
    """The tenants whose usage stream holds events (pipelined XLEN, one round trip per chunk):
    the ones the ledger drain is about to move, hence the ones whose counters just moved."""
    ids = list(tenant_ids) if tenant_ids is not None else all_tenant_ids()
    active: list[int] = []
    for chunk in _chunks(ids, 1000):
        pipe = client.pipeline(transaction=False)
        for tenant_id in chunk:
            pipe.xlen(keys.usage_stream_key(tenant_tag(tenant_id)))
        active += [t for t, n in zip(chunk, pipe.execute(), strict=True) if n]
    return active


# -- health: pending holds that stay high (a leak sign) -----------------------------------------


def pending_high_key(tenant_id: int) -> str:
    """When this tenant's pending was first seen above the alert level (unix seconds), with
    `:alerted` appended once operators were told; same hash tag as the tenant's other keys."""
    return f"tg:{{t{tenant_tag(tenant_id)}}}:pending-high"


@dataclass(frozen=True)
class PendingAlert:
    tenant_id: int
    tenant: str
    limit: int
    pending: int
    high_since: int  # unix seconds


def check_pending_health(*, now: float | None = None, engine: Any = None) -> list[PendingAlert]:
    """Alert operators (log ERROR and mail_admins) when a tenant's pending tokens in its
    tenant-day counter stay above TOLLGATE_PENDING_ALERT_PERCENT (20) % of its daily limit for
    TOLLGATE_PENDING_ALERT_SECONDS (600) or longer: once per episode, whichever worker sees it
    first. Returns the alerts this call raised."""
    engine = engine or get_engine()
    client = engine.client
    now_s = int(time.time() if now is None else now)
    alert_after = int(getattr(settings, "TOLLGATE_PENDING_ALERT_SECONDS", 600))
    percent = int(getattr(settings, "TOLLGATE_PENDING_ALERT_PERCENT", 20))
    # Refreshed on every check while high; lapses only when no check runs for this long.
    ttl = alert_after + 1800
    calendar = Calendar(0)
    raised: list[PendingAlert] = []
    for chunk in _chunks(all_tenant_ids()):
        tenants = list(Tenant.objects.select_related("plan").filter(pk__in=chunk).order_by("pk"))
        day = calendar.window(WindowKind.DAY, engine.clock.now_ms()).id
        limited = [(t, effective_limits(t).tokens_per_day) for t in tenants]
        limited = [(t, limit) for t, limit in limited if limit > 0]
        rows = _read_counters(client, [
            keys.counter_key(tenant_tag(t.pk), keys.tenant_scope(), day) for t, _ in limited])
        high, low = [], []
        for (tenant, limit), row in zip(limited, rows, strict=True):
            pending = _as_int(row[2])
            (high if pending * 100 > percent * limit else low).append((tenant, limit, pending))
        pipe = client.pipeline(transaction=False)
        for tenant, _limit, _pending in low:
            pipe.delete(pending_high_key(tenant.pk))
        for tenant, _limit, _pending in high:
            key = pending_high_key(tenant.pk)
            pipe.set(key, str(now_s), nx=True, ex=ttl)
            pipe.expire(key, ttl)
            pipe.get(key)
        replies = pipe.execute() if (low or high) else []
        seen = replies[len(low):]
        for i, (tenant, limit, pending) in enumerate(high):
            value = seen[3 * i + 2]
            if value is None or str(value).endswith(":alerted"):
                continue
            since = int(value)
            if now_s - since < alert_after:
                continue
            # Atomically mark the episode alerted; only the worker that saw it unmarked alerts.
            previous = client.set(pending_high_key(tenant.pk), f"{since}:alerted", xx=True,
                                  keepttl=True, get=True)
            if previous is None or str(previous).endswith(":alerted"):
                continue
            alert = PendingAlert(tenant.pk, tenant.slug, limit, pending, since)
            _alert_operators(alert, now_s)
            raised.append(alert)
    return raised


def _alert_operators(alert: PendingAlert, now_s: int) -> None:
    minutes = (now_s - alert.high_since) // 60
    message = (f"tenant {alert.tenant}: {alert.pending} tokens pending in holds, above the alert "
               f"level of its daily limit {alert.limit}, for {minutes} minutes (a leak sign: "
               "gateway processes not ending their holds, or the sweep not running)")
    log.error("pending holds high: %s", message)
    try:
        mail_admins(f"Pending holds high for tenant {alert.tenant}", message)
    except Exception:  # noqa: BLE001 - the ERROR log line is the alert of record
        log.exception("could not mail the admins about tenant %s", alert.tenant)
