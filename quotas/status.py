"""A tenant's live quota picture: every counter it is checked against, with its limit, what is
used and held right now, and what remains. Read from Redis in one round trip."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from redis.exceptions import RedisError

from quotas import keys
from quotas.cycles import calendar_for, calendar_of, schedule_for
from quotas.engine import UNLIMITED, QuotaStoreUnavailable
from quotas.keys import tenant_tag
from quotas.limits import REFUSAL_REASONS, standing_counters
from quotas.runtime import get_engine
from quotas.windows import UTC_MONTHLY, CycleSchedule, WindowKind
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits


@dataclass(frozen=True)
class ScopeStatus:
    kind: str  # tenant / project / key / model
    ref: str  # the tenant's, a project's or a key's public id, or a model name
    label: str  # what a person reads: slug, key name, model
    window: str  # "day" or "month"
    limit: int  # UNLIMITED (-1): no limit
    used: int
    pending: int  # held by requests in flight
    credit: int  # recharged on top of the limit
    remaining: int  # UNLIMITED when there is no limit; never negative
    redis_scope: str = ""  # the counter's scope in Redis (tenant, project:<pk>, ...)

    @property
    def limited(self) -> bool:
        return self.limit != UNLIMITED

    @property
    def percent_used(self) -> float | None:
        """(used + pending) as a percentage of limit + credit; None when unlimited."""
        if not self.limited:
            return None
        capacity = self.limit + self.credit
        if capacity <= 0:
            return 100.0
        return min(100.0, 100.0 * (self.used + self.pending) / capacity)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scope": self.kind, "id": self.ref, "label": self.label, "window": self.window,
            "limit": None if not self.limited else self.limit, "used": self.used,
            "pending": self.pending, "credit": self.credit,
            "remaining": None if not self.limited else self.remaining,
        }


@dataclass(frozen=True)
class QuotaStatus:
    scopes: list[ScopeStatus]
    open_holds: int

    def of(self, kind: str, window: str) -> list[ScopeStatus]:
        return [s for s in self.scopes if s.kind == kind and s.window == window]


def live_keys(tenant: Tenant) -> QuerySet[ApiKey]:
    """The tenant's unrevoked keys, each with a day counter, in the order their scopes are
    listed (a total order, so a caller may read them a page at a time)."""
    return ApiKey.objects.filter(project__tenant=tenant, revoked_at__isnull=True).order_by(
        "project__slug", "name", "public_id")


def quota_status(tenant: Tenant, *, engine: Any = None,
                 keys: Iterable[ApiKey] | None = None) -> QuotaStatus:
    """Today's and this month's counters of the tenant, today's of each project, live key and
    model with a daily limit, and this month's of each project and key with a monthly limit
    (quotas.limits.standing_counters). Raises quotas.engine.QuotaStoreUnavailable when Redis is
    down.

    `keys`: only these keys' counters (a page of live_keys(), one key, or none), in the order
    given; None: every live key's. Every unrevoked key has a day counter, so a tenant with
    20,000 keys had 20,000 read (and listed) for a dashboard that draws none of them."""
    limits = effective_limits(tenant)
    # Project and key month counters exist only while they have a monthly limit: without one
    # there is no live figure to show, only the ledger's.
    projects = Project.objects.filter(tenant=tenant).order_by("slug")
    chosen: Iterable[ApiKey] = live_keys(tenant) if keys is None else keys
    wanted = standing_counters(tenant, limits, projects, chosen)

    engine = engine or get_engine()
    tag = tenant_tag(tenant.pk)
    # In the tenant's windows (its day and cycle, quotas/cycles.py), as the gateway counts.
    snaps = engine.counters(tag, [(c.scope, c.window) for c in wanted],
                            schedule=schedule_for(tenant))
    statuses = []
    for c, snap in zip(wanted, snaps, strict=True):
        remaining = (UNLIMITED if c.limit == UNLIMITED
                     else max(0, c.limit + snap.credit - snap.used - snap.pending))
        statuses.append(ScopeStatus(c.kind, c.ref, c.label, c.window.value, c.limit, snap.used,
                                    snap.pending, snap.credit, remaining, c.scope))
    return QuotaStatus(scopes=statuses, open_holds=len(engine.open_hold_ids(tag)))


# -- requests refused today, by reason (written by gateway/refusals.py) -------------------------

# The reasons and what the console shows for each: quotas.limits.REFUSAL_REASONS, beside the
# counters whose refusals they name.

# Refused-request counts are kept this long after their day (long enough to read yesterday's).
REFUSED_TTL_SECONDS = 3 * 86400


def day_id(schedule: CycleSchedule = UTC_MONTHLY, now_s: float | None = None) -> str:
    """The id of the day window (d2026-11-30) at `now_s` (default: this host's clock) under a
    tenant's schedule (quotas.cycles.schedule_for), as its quota counters name their day."""
    moment = time.time() if now_s is None else now_s
    return calendar_of(schedule).window(WindowKind.DAY, int(moment * 1000)).id


def utc_day_id(now_s: float | None = None) -> str:
    """The UTC day's window id: the day of a tenant whose time zone is UTC."""
    return day_id(UTC_MONTHLY, now_s)


@dataclass(frozen=True)
class RefusedCount:
    reason: str
    label: str
    count: int


def refused_today(tenant: Tenant, *, engine: Any = None,
                  now_s: float | None = None) -> list[RefusedCount]:
    """The tenant's requests refused today (its day, in its time zone) per reason, most frequent
    first. Raises QuotaStoreUnavailable when Redis is down."""
    engine = engine or get_engine()
    try:
        # Today on the Redis clock, as the gateway counts it (one clock: DESIGN.md invariant 6).
        day = (calendar_for(tenant).window(WindowKind.DAY, int(now_s * 1000)).id
               if now_s is not None
               else engine.current_window(WindowKind.DAY, schedule_for(tenant)).id)
        raw = engine.client.hgetall(keys.refused_key(tenant_tag(tenant.pk), day))
    except RedisError as exc:
        raise QuotaStoreUnavailable(f"quota store unreachable: {exc}") from exc
    counts = []
    for field, value in raw.items():
        reason = field.decode() if isinstance(field, bytes) else str(field)
        counts.append(RefusedCount(reason, REFUSAL_REASONS.get(reason, reason), int(value)))
    return sorted(counts, key=lambda c: (-c.count, c.reason))
