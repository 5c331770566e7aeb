"""The live picture of a tenant's allotments: per window (day, cycle), each project's and key's
allotment, what it used of it and what it borrowed beyond it, and what is left in the shared
pool. Read from Redis in one round trip (lua/lib/tiers.lua keeps the figures; the rules of who
may allot what are tenants/allotments.py and tenants/services/allotments.py).

A tier's `taken` counts calls in flight too (their holds), as the quota counters' used + pending
do: "used" here is what the scope has taken, not only what settled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from quotas import keys
from quotas.cycles import calendar_for
from quotas.engine import QuotaStoreUnavailable
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.allotments import tenant_allotments
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits

_WINDOWS = {"day": WindowKind.DAY, "month": WindowKind.MONTH}


@dataclass(frozen=True)
class AllotmentFigures:
    """One project's or key's allotment in one window."""

    kind: str  # project / key
    ref: str  # its public id
    label: str  # slug or key name
    window: str  # day / month (the tenant's cycle)
    allotment: int  # tokens reserved for it alone
    used: int  # taken from its own allotment (a project's: its keys' included)
    borrowed: int  # taken beyond it (from its project's part or the pool)

    @property
    def left(self) -> int:
        return max(0, self.allotment - self.used)

    def as_dict(self) -> dict[str, Any]:
        return {"scope": self.kind, "id": self.ref, "label": self.label, "window": self.window,
                "allotment": self.allotment, "used_from_allotment": self.used,
                "borrowed": self.borrowed, "left": self.left}


@dataclass(frozen=True)
class PoolFigures:
    """The tenant's shared pool in one window: its quota minus the top-level allotments."""

    window: str
    window_start_ms: int
    window_end_ms: int
    quota: int
    allotted: int  # the top-level allotments' total
    size: int  # max(0, quota - allotted)
    credit: int  # recharged on top (quota_recharge)
    borrowed: int  # what the scopes took from it

    @property
    def left(self) -> int:
        return max(0, self.size + self.credit - self.borrowed)

    @property
    def over(self) -> int:
        """Allotments above the quota (a quota lowered after they were made)."""
        return max(0, self.allotted - self.quota)

    def as_dict(self) -> dict[str, Any]:
        return {"window": self.window, "quota": self.quota, "allotted": self.allotted,
                "pool": self.size, "credit": self.credit, "borrowed": self.borrowed,
                "left": self.left, "over": self.over}


@dataclass(frozen=True)
class AllotmentStanding:
    pools: tuple[PoolFigures, ...]  # windows where the tenant has allotments
    scopes: tuple[AllotmentFigures, ...]

    def for_window(self, window: str) -> tuple[AllotmentFigures, ...]:
        return tuple(s for s in self.scopes if s.window == window)

    def as_dict(self) -> dict[str, Any]:
        return {"pools": [p.as_dict() for p in self.pools],
                "allotments": [s.as_dict() for s in self.scopes]}


def apply_allotments(tenant_id: int, *, engine: Any = None) -> dict[str, int]:
    """After a change of the tenant's allotments (installed by quotas.apps into
    tenants.services.allotments, run after the change commits): every tier of the current day
    and cycle windows takes its allotment now, so what a scope took above a lowered, removed or
    revoked allotment is in the pool at once rather than lent again until its next call
    (lua/allotments_set.lua). A window left without allotments drops its pool. Returns the
    tokens moved into each window's pool. QuotaStoreUnavailable without Redis."""
    tenant = Tenant.objects.select_related("plan").get(pk=tenant_id)
    limits = effective_limits(tenant)
    by_window = tenant_allotments(tenant, limits=limits)
    engine = engine or get_engine()
    tag = tenant_tag(tenant.pk)
    calendar = calendar_for(tenant)
    now_ms = engine.clock.now_ms()
    fields = [w.field for w in (a.window for a in by_window.values())]
    projects = list(Project.objects.filter(tenant=tenant).values_list("pk", *fields))
    api_keys = list(ApiKey.objects.filter(project__tenant=tenant)
                    .values_list("pk", "project_id", "revoked_at", *fields))
    moved = {}
    for position, (name, allotments) in enumerate(by_window.items()):
        live = allotments.limited and bool(allotments.allotted or allotments.keys_allotted)
        nested = {pk for pk, *values in projects if values[position] is not None}
        project_index = {pk: len(api_keys) + i + 1 for i, (pk, *_) in enumerate(projects)}
        tiers: list[tuple[str, int, int]] = []
        for pk, project_id, revoked_at, *values in api_keys:
            allotment = values[position] if live and revoked_at is None else None
            parent = project_index[project_id] if project_id in nested else 0
            tiers.append((keys.api_key_scope(pk), allotment or 0, parent))
        for pk, *values in projects:
            own = values[position] if live else None
            part = max(0, own - allotments.keys_allotted.get(pk, 0)) if own is not None else 0
            tiers.append((keys.project_scope(pk), part, 0))
        window = calendar.window(_WINDOWS[name], now_ms)
        moved[name] = engine.set_allotments(tag, window, tiers, drop_pool=not live)
    return moved


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


def allotment_standing(tenant: Tenant, *, engine: Any = None) -> AllotmentStanding:
    """Every allotment of the tenant with its figures now (QuotaStoreUnavailable without Redis).
    Three queries (projects, keys, their allotments) and one Redis round trip."""
    limits = effective_limits(tenant)
    by_window = {name: a for name, a in tenant_allotments(tenant, limits=limits).items()
                 if a.limited and (a.allotted or a.keys_allotted)}
    if not by_window:
        return AllotmentStanding((), ())
    engine = engine or get_engine()
    tag = tenant_tag(tenant.pk)
    calendar = calendar_for(tenant)
    now_ms = engine.clock.now_ms()
    projects = list(Project.objects.filter(tenant=tenant).order_by("slug"))
    api_keys = list(ApiKey.objects.filter(project__tenant=tenant, revoked_at__isnull=True)
                    .select_related("project").order_by("project__slug", "name", "pk"))
    reads: list[tuple[str, str, Any, str]] = []  # (window, role, row, redis key)
    for name, allotments in by_window.items():
        window = calendar.window(_WINDOWS[name], now_ms)
        reads.append((name, "pool", window, keys.pool_key(tag, window.id)))
        # A pool not made yet starts from the tenant counter (lua/reserve.lua): read it too.
        reads.append((name, "seed", window, keys.counter_key(tag, keys.tenant_scope(), window.id)))
        for project in projects:
            if getattr(project, allotments.window.field) is not None:
                reads.append((name, "project", project,
                              keys.allotment_key(tag, keys.project_scope(project.pk), window.id)))
        for api_key in api_keys:
            if getattr(api_key, allotments.window.field) is not None:
                reads.append((name, "key", api_key,
                              keys.allotment_key(tag, keys.api_key_scope(api_key.pk), window.id)))
    try:
        pipe = engine.client.pipeline(transaction=False)
        for _, role, _, key in reads:
            pipe.hmget(key, *(("used", "pending") if role == "seed" else ("taken", "credit")))
        replies = pipe.execute()
    except RedisError as exc:
        raise QuotaStoreUnavailable(str(exc)) from exc
    taken = {key: _int(reply[0]) for (_, _, _, key), reply in zip(reads, replies, strict=True)}
    seeds = {name: _int(reply[0]) + _int(reply[1])
             for (name, role, _, _), reply in zip(reads, replies, strict=True) if role == "seed"}
    pools, scopes = [], []
    key_used: dict[tuple[str, int], int] = {}  # (window, project pk) -> its keys' own use
    for (name, role, row, key), reply in zip(reads, replies, strict=True):
        allotments = by_window[name]
        if role == "pool":
            borrowed = taken[key] if reply[0] is not None else seeds[name]
            pools.append(PoolFigures(name, row.start_ms, row.end_ms, allotments.quota,
                                     allotments.allotted, allotments.pool, _int(reply[1]),
                                     borrowed))
        elif role == "key":
            allot = getattr(row, allotments.window.field)
            used = min(taken[key], allot)
            key_used[(name, row.project_id)] = key_used.get((name, row.project_id), 0) + used
            scopes.append(AllotmentFigures("key", row.public_id, row.name or row.public_id, name,
                                           allot, used, taken[key] - used))
    for (name, role, row, key), _reply in zip(reads, replies, strict=True):
        if role != "project":
            continue
        allotments = by_window[name]
        allot = getattr(row, allotments.window.field)
        own_part = max(0, allot - allotments.keys_allotted.get(row.pk, 0))
        own_used = min(taken[key], own_part)
        scopes.append(AllotmentFigures("project", row.public_id, row.slug, name, allot,
                                       own_used + key_used.get((name, row.pk), 0),
                                       taken[key] - own_used))
    order = {"project": 0, "key": 1}
    scopes.sort(key=lambda s: (s.window, order[s.kind], s.label))
    return AllotmentStanding(tuple(pools), tuple(scopes))
