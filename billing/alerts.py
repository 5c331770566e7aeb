"""Threshold alerts (remaining quota crossing the tenant's percentages, and exhaustion), and the
operators' health checks: pending holds that stay high, and a ledger backlog that grows old.

Detection reads day and month counters from Redis (tenant scope, and every project with a limit
of its own), off the gateway's hot path: the ledger drain calls it for the tenants whose usage
events it just moved (within seconds of the settle), for the windows those events were charged
to, and a beat job calls it for every tenant each minute, for the current and the previous
windows, to catch anything missed. Both look at ended windows too, so a threshold crossed in the
last seconds before midnight or the month's end alerts for the window it belongs to.
`quota.exhausted` fires when nothing is left or when the gateway starts refusing calls for
tenant or project quota (its refused-requests counts), whichever comes first.

Exactly once per threshold per window: an alert fires when its AlertState row is inserted
(INSERT ... ON CONFLICT DO NOTHING on the unique (tenant, scope, window, threshold)); only the
detector whose insert returned the row creates the webhook deliveries (in the same transaction)
and mails the tenant's owners. Any number of detectors may race.

The same detectors announce the burn-rate breaker's trips (quotas/pace.py): they read the
tenants' trip records from Redis and fire `breaker.tripped` (webhook and owners' email) once per
trip, by inserting its PaceTrip row the same way (`check_pace_trips`). The gateway, which trips
the breaker, cannot import billing; the drain runs within seconds of the tripping calls' settles,
the beat within a minute.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage, mail_admins
from django.db import connection, transaction
from django.db.models import Q

from billing import webhooks
from billing.ledger import usage_backlog
from billing.models import AlertState, PaceTrip, WebhookEvent
from quotas import keys
from quotas.cycles import Span, calendar_for
from quotas.keys import tenant_tag
from quotas.limits import (
    QUOTA_PROJECT,
    QUOTA_TENANT,
    TENANT,
    Counter,
    project_counters,
    tenant_counter,
)
from quotas.pace import Trip, parse_trip
from quotas.runtime import get_engine
from quotas.windows import Calendar, Window, WindowKind
from tenants.models import Membership, Project, Tenant
from tenants.selectors import effective_limits

log = logging.getLogger(__name__)

_CHUNK = 200
# The counter hash layout documented in quotas/keys.py.
_FIELDS = ("limit", "used", "pending", "credit")
# The 'month' counters are the tenant's cycle's (quotas/cycles.py: a day, a week, a month from
# its billing day...); the email says which window in dates.
_KIND_NAMES = {WindowKind.DAY: "daily", WindowKind.MONTH: "cycle"}
# The refusal reasons (quotas.limits) of the counters watched here: the tenant's and projects'.
_QUOTA_REFUSALS = (QUOTA_TENANT, QUOTA_PROJECT)
# A tenant without thresholds: a project counts as refusing when this little is left.
_REFUSAL_FLOOR_PERCENT = 5


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
    reason: str  # the refusal reason of its counter (quotas.limits)


def _watch(tenant: Tenant, counter: Counter, thresholds: tuple[int, ...]) -> list[_Watched]:
    """The counter, if it has a limit to alert on (-1 unlimited or 0 refuse-all have none)."""
    if counter.limit <= 0:
        return []
    label = "tenant" if counter.kind == TENANT else f"{counter.kind}:{counter.label}"
    return [_Watched(tenant, counter.scope, label, counter.window, counter.limit, thresholds,
                     counter.reason)]


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
    """The limited counters of these tenants: tenant day and month, and projects' own limits,
    as quotas.limits defines them. Limits come from PostgreSQL (what the gateway passes to the
    reserve script)."""
    tenants = list(tenants)
    by_id = {t.pk: t for t in tenants}
    watched = []
    for tenant in tenants:
        thresholds = _thresholds(tenant)
        limits = effective_limits(tenant)
        for kind in (WindowKind.DAY, WindowKind.MONTH):
            watched += _watch(tenant, tenant_counter(tenant, limits, kind), thresholds)
    projects = Project.objects.filter(tenant_id__in=by_id).filter(
        Q(tokens_per_day__isnull=False) | Q(tokens_per_month__isnull=False)).order_by("pk")
    for project in projects:
        tenant = by_id[project.tenant_id]
        thresholds = _thresholds(tenant)
        for counter in project_counters(project):
            watched += _watch(tenant, counter, thresholds)
    return watched


def _read_counters(client: Any, counter_keys: list[str]) -> list[list[Any]]:
    """HMGET of these counters in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for key in counter_keys:
        pipe.hmget(key, _FIELDS)
    return pipe.execute() if counter_keys else []


def _read(client: Any, counter_keys: list[str], refusal_days: list[tuple[int, str]],
          ) -> tuple[list[list[Any]], list[dict[str, int]]]:
    """The counters, and the tenants' quota refusals per day, in one pipelined round trip."""
    if not counter_keys and not refusal_days:
        return [], []
    pipe = client.pipeline(transaction=False)
    for key in counter_keys:
        pipe.hmget(key, _FIELDS)
    for tenant_id, day_id in refusal_days:
        pipe.hmget(keys.refused_key(tenant_tag(tenant_id), day_id), _QUOTA_REFUSALS)
    replies = pipe.execute()
    refusals = [dict(zip(_QUOTA_REFUSALS, (_as_int(v) for v in reply), strict=True))
                for reply in replies[len(counter_keys):]]
    return replies[:len(counter_keys)], refusals


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


def owner_emails(tenant: Tenant) -> list[str]:
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


def mail_owners(subject: str, body: str, recipients: list[str], what: str) -> tuple[str, ...]:
    """Mail the owners; the addresses mailed, or () when there are none or the mail failed."""
    if not recipients:
        return ()
    try:
        EmailMessage(subject, body, to=recipients).send()
    except Exception:  # noqa: BLE001 - a mail server outage must not undo a fired alert
        log.exception("could not mail %s to the owners", what)
        return ()
    return tuple(recipients)


def _email(alert: Alert, kind: WindowKind, span: Span, recipients: list[str]
           ) -> tuple[str, ...]:
    subject = f"[Tollgate] {_describe(alert, kind)}"
    body = (f"{_describe(alert, kind)}.\n\n"
            f"Window: {span.label} [{alert.window}]\nLimit: {alert.limit} tokens\n"
            f"Used: {alert.used}\n"
            f"In flight: {alert.pending}\nRemaining: {max(alert.remaining, 0)}\n")
    return mail_owners(subject, body, recipients,
                        f"the {alert.window} alert of {alert.tenant}")


def _fire(item: _Watched, span: Span, threshold: int, limit: int, used: int, pending: int,
          credit: int, remaining: int) -> Alert | None:
    window = span.id
    tenant = item.tenant
    alert = Alert(tenant_id=tenant.pk, tenant=tenant.slug, scope=item.scope, label=item.label,
                  window=window, threshold=threshold, limit=limit, used=used,
                  pending=pending, credit=credit, remaining=remaining)
    with transaction.atomic():
        if not _insert_state(tenant.pk, item.scope, window, threshold):
            return None
        payload = webhooks.event_payload(
            alert.event_type, tenant, scope=item.label, window=window, limit=limit,
            used=used, pending=pending, remaining=max(remaining, 0), threshold=threshold)
        deliveries = webhooks.create_deliveries(tenant, alert.event_type, payload)
    log.info("alert: %s (%s)", _describe(alert, item.kind), window)
    emailed = _email(alert, item.kind, span, owner_emails(tenant))
    return dataclasses.replace(alert, delivery_ids=tuple(d.pk for d in deliveries),
                               emailed=emailed)


def _limit_of(item: _Watched, window: Window, stored: Any, now_ms: int) -> int:
    """The limit a counter is judged by: PostgreSQL's for the current window (what the next
    reserve passes), the counter's own for an ended one (the last limit reserved under in it;
    -1 unlimited or 0 refuse-all: no threshold applies)."""
    if window.contains(now_ms):
        return item.limit
    return _as_int(stored)


def _moments(calendar: Calendar, now_ms: int, windows: Collection[Window] | None) -> set[int]:
    """The instants whose day and month windows to check. Default: now and the last instant of
    the previous day (its counter lives on for two days after its end, and on the first of a
    month that instant is in the previous month). For windows given (by the drain): the last
    instant of each, or now for a window that has not ended."""
    if windows is None:
        today = calendar.window(WindowKind.DAY, now_ms)
        return {now_ms, today.start_ms - 1}
    return {min(w.end_ms - 1, now_ms) for w in windows}


@dataclass(frozen=True)
class _Reading:
    item: _Watched
    window: Window
    moment: int  # the instant it was read for (several windows may share one)
    limit: int
    used: int
    pending: int
    credit: int

    @property
    def remaining(self) -> int:
        return self.limit + self.credit - self.used - self.pending


def _refusal_exhausted(readings: list[_Reading], refused: dict[str, int]) -> list[_Reading]:
    """The counters that were refusing calls, from the refusal counts of the day (tenant and
    project quota reasons, gateway/refusals.py) and the counters live at one instant.

    A reservation is refused when its amount exceeds the smallest headroom of the counters it
    touches, so of a tenant's day and month counters the one with the least remaining is the one
    that refused. Project refusals are counted without the project: the refuser is the tenant's
    only limited project, or else each project whose tightest counter is within the tenant's
    lowest threshold (5% when it has none)."""
    out: list[_Reading] = []
    tenant_level = [r for r in readings if r.item.reason == QUOTA_TENANT]
    if refused.get(QUOTA_TENANT, 0) > 0 and tenant_level:
        out.append(min(tenant_level, key=lambda r: (r.remaining, r.window.kind != WindowKind.DAY)))
    projects: dict[str, list[_Reading]] = {}
    for reading in readings:
        if reading.item.reason == QUOTA_PROJECT:
            projects.setdefault(reading.item.scope, []).append(reading)
    if refused.get(QUOTA_PROJECT, 0) > 0 and projects:
        for group in projects.values():
            tightest = min(group, key=lambda r: (r.remaining, r.window.kind != WindowKind.DAY))
            floor = min(tightest.item.thresholds, default=_REFUSAL_FLOOR_PERCENT)
            if len(projects) == 1 or tightest.remaining * 100 <= floor * tightest.limit:
                out.append(tightest)
    return out


# -- the burn-rate breaker's trips ----------------------------------------------------------------


@dataclass(frozen=True)
class TripAlert:
    """A trip this call announced (inserted its PaceTrip)."""

    tenant_id: int
    tenant: str  # slug
    trip: Trip
    delivery_ids: tuple[int, ...] = ()
    emailed: tuple[str, ...] = ()

    @property
    def event_type(self) -> str:
        return WebhookEvent.BREAKER_TRIPPED

    @property
    def who(self) -> str:
        """The payload's scope: "tenant", "project:<slug>" or "key:<name>"."""
        kind = self.trip.kind
        return "tenant" if kind == "tenant" else f"{kind}:{self.trip.label}"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _insert_trip(tenant_id: int, trip: Trip) -> bool:
    """True when this call inserted the trip's row (so it, and only it, announces it)."""
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {q(PaceTrip._meta.db_table)} ({q('tenant_id')}, {q('scope')}, "
            f"{q('tripped_ms')}, {q('until_ms')}, {q('owner')}, {q('label')}, {q('rules')}, "
            f"{q('fired_at')}) VALUES (%s, %s, %s, %s, %s, %s, %s, now()) "
            f"ON CONFLICT ({q('tenant_id')}, {q('scope')}, {q('tripped_ms')}) DO NOTHING "
            "RETURNING id",
            [tenant_id, trip.scope, trip.tripped_ms, trip.until_ms, trip.owner[:100],
             trip.label[:200], json.dumps(list(trip.rules))])
        return cursor.fetchone() is not None


def _trip_email(alert: TripAlert, recipients: list[str]) -> tuple[str, ...]:
    trip = alert.trip
    subject = f"[Tollgate] {alert.tenant}: {alert.who} paused, spending far above its pace"
    body = (f"The burn-rate breaker of {alert.who} (tenant {alert.tenant}) tripped at "
            f"{_iso(trip.tripped_ms)}: it spent more than its pace allows "
            f"({'; '.join(trip.rules)}).\n\n"
            f"Its calls are refused (429 spend_rate_exceeded) until {_iso(trip.until_ms)}; then "
            "it admits one period's share again, and trips again if the spending goes on.\n"
            "If the spending is expected, an owner or admin can resume it early on the console's "
            "Limits page.\n")
    return mail_owners(subject, body, recipients,
                        f"the trip of {alert.who} of {alert.tenant}")


def _announce(tenant: Tenant, trip: Trip) -> TripAlert | None:
    alert = TripAlert(tenant.pk, tenant.slug, trip)
    with transaction.atomic():
        if not _insert_trip(tenant.pk, trip):
            return None
        payload = webhooks.event_payload(
            WebhookEvent.BREAKER_TRIPPED, tenant, scope=alert.who, owner=trip.owner,
            rules=list(trip.rules), tripped_at=_iso(trip.tripped_ms), until=_iso(trip.until_ms))
        deliveries = webhooks.create_deliveries(tenant, WebhookEvent.BREAKER_TRIPPED, payload)
    log.warning("pace breaker tripped: %s %s (%s) until %s", tenant.slug, alert.who,
                "; ".join(trip.rules), _iso(trip.until_ms))
    emailed = _trip_email(alert, owner_emails(tenant))
    return dataclasses.replace(alert, delivery_ids=tuple(d.pk for d in deliveries),
                               emailed=emailed)


def check_pace_trips(tenants: Sequence[Tenant], client: Any) -> list[TripAlert]:
    """Announce every trip of these tenants not announced yet (one pipelined read of their
    trip records, one query for the announced ones); returns the ones this call announced."""
    if not tenants:
        return []
    pipe = client.pipeline(transaction=False)
    for tenant in tenants:
        pipe.hgetall(keys.pace_trips_key(tenant_tag(tenant.pk)))
    found = [(tenant, parse_trip(_text(scope), raw))
             for tenant, records in zip(tenants, pipe.execute(), strict=True)
             for scope, raw in records.items()]
    if not found:
        return []
    done = set(PaceTrip.objects.filter(tenant__in=[t for t, _ in found]).filter(
        tripped_ms__in={trip.tripped_ms for _, trip in found},
    ).values_list("tenant_id", "scope", "tripped_ms"))
    fired = []
    for tenant, trip in found:
        if (tenant.pk, trip.scope, trip.tripped_ms) in done:
            continue
        alert = _announce(tenant, trip)
        if alert is not None:
            fired.append(alert)
    return fired


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_thresholds(tenant_ids: Iterable[int], *, engine: Any = None,
                     windows: Mapping[int, Collection[Window]] | None = None,
                     ) -> list[Alert | TripAlert]:
    """Fire every alert due for these tenants; returns the ones this call fired (deliveries
    created, not yet dispatched: see billing.tasks.dispatch_deliveries).

    Which windows: `windows` per tenant when given (the drain passes the windows its events were
    charged to), else the current day and month and the previous day's (and, on the first of a
    month, the previous month's): a threshold crossed by a settle in the last seconds of a window
    is detected after the window ended, for the window it belongs to.

    Beside the thresholds, `quota.exhausted` fires when nothing is left, and also as soon as the
    gateway refuses calls for tenant or project quota (the refused-requests counts of the
    day), since a call is refused while a few tokens remain, fewer than it needs. And the
    burn-rate breaker's trips of these tenants are announced (`check_pace_trips`).
    """
    engine = engine or get_engine()
    ids = list(dict.fromkeys(int(i) for i in tenant_ids))
    if windows is not None:
        ids = [i for i in ids if windows.get(i)]
    fired: list[Alert | TripAlert] = []
    for chunk in _chunks(ids):
        tenants = list(Tenant.objects.select_related("plan").filter(pk__in=chunk).order_by("pk"))
        fired += check_pace_trips(tenants, engine.client)
        watched = _watched(tenants)
        if not watched:
            continue
        # Each tenant's windows: its day and cycle in its time zone (quotas/cycles.py), as the
        # gateway counted them.
        calendars = {tenant.pk: calendar_for(tenant) for tenant in tenants}
        now_ms = engine.clock.now_ms()
        moments = {tenant.pk: sorted(_moments(calendars[tenant.pk], now_ms,
                                              None if windows is None else windows[tenant.pk]),
                                     reverse=True)
                   for tenant in tenants}
        slots: list[tuple[_Watched, Window, int]] = []
        for item in watched:
            calendar = calendars[item.tenant.pk]
            for moment in moments[item.tenant.pk]:
                slots.append((item, calendar.window(item.kind, moment), moment))
        refusal_days = sorted({(tenant_id, calendars[tenant_id].window(WindowKind.DAY, moment).id)
                               for tenant_id in moments for moment in moments[tenant_id]})
        rows, refusals = _read(engine.client, [
            keys.counter_key(tenant_tag(item.tenant.pk), item.scope, window.id)
            for item, window, _ in slots], refusal_days)
        readings: list[_Reading] = []
        for (item, window, moment), row in zip(slots, rows, strict=True):
            stored_limit, used, pending, credit = row
            if stored_limit is None:
                continue  # nothing reserved in this window (or its counter has expired)
            limit = _limit_of(item, window, stored_limit, now_ms)
            if limit <= 0:
                continue
            readings.append(_Reading(item, window, moment, limit, _as_int(used),
                                     _as_int(pending), _as_int(credit)))
        candidates: list[tuple[_Reading, int]] = []
        for reading in readings:
            crossed = [t for t in reading.item.thresholds
                       if reading.remaining * 100 <= t * reading.limit]
            if reading.remaining <= 0:
                crossed.append(AlertState.EXHAUSTED)
            candidates += [(reading, threshold) for threshold in crossed]
        for (tenant_id, day_id), refused in zip(refusal_days, refusals, strict=True):
            at = [r for r in readings if r.item.tenant.pk == tenant_id
                  and calendars[tenant_id].window(WindowKind.DAY, r.moment).id == day_id]
            candidates += [(r, AlertState.EXHAUSTED) for r in _refusal_exhausted(at, refused)]
        if not candidates:
            continue
        # Skip the alerts fired already with one query; the insert decides the races.
        done = set(AlertState.objects.filter(
            tenant_id__in={r.item.tenant.pk for r, _ in candidates},
            window__in={r.window.id for r, _ in candidates},
        ).values_list("tenant_id", "scope", "window", "threshold"))
        for reading, threshold in candidates:
            state = (reading.item.tenant.pk, reading.item.scope, reading.window.id, threshold)
            if state in done:
                continue
            done.add(state)  # the same alert may be a candidate twice (exhausted, refusals)
            zone = calendars[reading.item.tenant.pk].schedule.cycle_at(reading.moment)[0].zone
            alert = _fire(reading.item, Span.of(reading.window, zone), threshold, reading.limit,
                          reading.used, reading.pending, reading.credit, reading.remaining)
            if alert is not None:
                fired.append(alert)
    return fired


def all_tenant_ids() -> list[int]:
    return list(Tenant.objects.order_by("pk").values_list("pk", flat=True))


# -- health: pending holds that stay high (a leak sign) -----------------------------------------


@dataclass(frozen=True)
class PendingAlert:
    tenant_id: int
    tenant: str
    limit: int
    pending: int
    high_since: int  # unix seconds


def check_pending_health(*, now: float | None = None, engine: Any = None,
                         tenant_ids: Iterable[int] | None = None) -> list[PendingAlert]:
    """Alert operators (log ERROR and mail_admins) when a tenant's pending tokens in its
    tenant-day counter stay above TOLLGATE_PENDING_ALERT_PERCENT (20) % of its daily limit for
    TOLLGATE_PENDING_ALERT_SECONDS (600) or longer: once per episode, whichever worker sees it
    first. Returns the alerts this call raised. `tenant_ids`: these tenants (the beat job passes
    the index of active tenants'), default every tenant."""
    engine = engine or get_engine()
    client = engine.client
    now_s = int(time.time() if now is None else now)
    alert_after = int(getattr(settings, "TOLLGATE_PENDING_ALERT_SECONDS", 600))
    percent = int(getattr(settings, "TOLLGATE_PENDING_ALERT_PERCENT", 20))
    # Refreshed on every check while high; lapses only when no check runs for this long.
    ttl = alert_after + 1800
    raised: list[PendingAlert] = []
    ids = all_tenant_ids() if tenant_ids is None else list(dict.fromkeys(tenant_ids))
    for chunk in _chunks(ids):
        tenants = list(Tenant.objects.select_related("plan").filter(pk__in=chunk).order_by("pk"))
        now_ms = engine.clock.now_ms()
        counters = [(t, tenant_counter(t, effective_limits(t), WindowKind.DAY)) for t in tenants]
        counters = [(t, c) for t, c in counters if c.limit > 0]
        limited = [(t, c.limit) for t, c in counters]
        # Each tenant's today, in its time zone (quotas/cycles.py).
        rows = _read_counters(client, [
            keys.counter_key(tenant_tag(t.pk), c.scope,
                             calendar_for(t).window(WindowKind.DAY, now_ms).id)
            for t, c in counters])
        high, low = [], []
        for (tenant, limit), row in zip(limited, rows, strict=True):
            pending = _as_int(row[2])
            (high if pending * 100 > percent * limit else low).append((tenant, limit, pending))
        pipe = client.pipeline(transaction=False)
        for tenant, _limit, _pending in low:
            pipe.delete(keys.pending_high_key(tenant_tag(tenant.pk)))
        for tenant, _limit, _pending in high:
            key = keys.pending_high_key(tenant_tag(tenant.pk))
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
            previous = client.set(keys.pending_high_key(tenant_tag(tenant.pk)),
                                  f"{since}:alerted", xx=True, keepttl=True, get=True)
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


# -- health: usage events waiting for the ledger drain ----------------------------------------


@dataclass(frozen=True)
class BacklogAlert:
    events: int
    streams: int
    oldest_age_s: float
    oldest_stream: str


def check_ledger_backlog(*, engine: Any = None) -> BacklogAlert | None:
    """Alert operators (log ERROR and mail_admins) when the oldest usage event still waiting
    for the ledger drain is older than TOLLGATE_LEDGER_BACKLOG_ALERT_SECONDS (300): PostgreSQL
    down, or no worker draining. Nothing is lost meanwhile (the stream is trimmed only by the
    drain), but the ledger, the reports and reconciliation fall behind. Once per episode,
    whichever worker sees it first; works while PostgreSQL is down (billing.ledger finds the
    streams in Redis then). Returns the alert this call raised."""
    engine = engine or get_engine()
    client = engine.client
    alert_after = int(getattr(settings, "TOLLGATE_LEDGER_BACKLOG_ALERT_SECONDS", 300))
    backlog = usage_backlog(client)
    key = keys.ledger_backlog_alert_key()
    if backlog.oldest_age_s < alert_after:
        client.delete(key)  # the episode (if any) is over: the next one alerts again
        return None
    # Refreshed on every check while old; lapses (and would alert again) only when no check
    # has run for this long.
    ttl = alert_after + 1800
    if not client.set(key, str(int(time.time())), nx=True, ex=ttl):
        client.expire(key, ttl)
        return None
    alert = BacklogAlert(backlog.events, backlog.streams, backlog.oldest_age_s,
                         backlog.oldest_stream)
    minutes = int(alert.oldest_age_s // 60)
    message = (f"{alert.events} usage events of {alert.streams} tenants wait for the ledger "
               f"drain; the oldest ({alert.oldest_stream}) is {minutes} minutes old. PostgreSQL "
               "may be down or no worker is draining (billing.tasks.drain_usage). Nothing is "
               "lost while the events wait in Redis, but the ledger is behind and Redis memory "
               "grows.")
    log.error("ledger backlog: %s", message)
    try:
        mail_admins(f"Ledger drain behind by {minutes} minutes", message)
    except Exception:  # noqa: BLE001 - the ERROR log line is the alert of record
        log.exception("could not mail the admins about the ledger backlog")
    return alert
