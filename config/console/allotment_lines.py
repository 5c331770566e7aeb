"""The rows the console shows for a tenant's allotments: per window with a quota and some
allotment, the shared pool, then each project with an allotment followed by its keys with one,
then the keys of projects without one. The allotments are the database's (tenants/allotments.py),
so they show with Redis down; what was used, borrowed and is left comes from the live picture
(quotas.allotments.allotment_standing) and is None without it."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q

from quotas.allotments import AllotmentStanding, allotment_standing
from quotas.engine import QuotaStoreUnavailable
from tenants import selectors
from tenants.allotments import WINDOWS, WindowAllotments, tenant_allotments
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import EffectiveLimits


@dataclass(frozen=True)
class AllotmentLine:
    """One row: the shared pool of a window, or a project's or key's allotment in it."""

    kind: str  # pool / project / key
    ref: str  # the project's or key's public id ("" for the pool)
    label: str
    window: str  # "day" or "month" (the tenant's cycle)
    per: str  # "per day" / "per cycle"
    allotment: int  # a scope's allotment; the pool's size (the quota minus the allotments)
    used: int | None = None  # of the allotment (the pool: what the scopes borrowed from it)
    borrowed: int | None = None  # a scope's: what it took beyond its allotment
    left: int | None = None  # of the allotment (the pool: of the pool, recharges included)
    credit: int = 0  # the pool's: recharged on top of its size


@dataclass(frozen=True)
class Allotments:
    lines: list[AllotmentLine]
    warnings: list[str]  # allotments above a lowered quota, one per window
    live: bool  # whether used / borrowed / left could be read


def _allotted_keys(tenant: Tenant) -> list[ApiKey]:
    # Unrevoked keys with an allotment (an expired key keeps it until revoked or removed).
    return list(selectors.tenant_keys(tenant).filter(
        Q(allotment_tokens_per_day__isnull=False) | Q(allotment_tokens_per_month__isnull=False),
        revoked_at__isnull=True).order_by("project__slug", "name", "public_id"))


def _lines(totals: dict[str, WindowAllotments], projects: list[Project],
           keys: list[ApiKey], standing: AllotmentStanding | None) -> list[AllotmentLine]:
    pools = {p.window: p for p in standing.pools} if standing else {}
    figures = {(s.kind, s.ref, s.window): s for s in standing.scopes} if standing else {}
    lines: list[AllotmentLine] = []
    for window in WINDOWS:
        total = totals[window.name]
        holders = [p for p in projects if getattr(p, window.field) is not None]
        holders_keys = [k for k in keys if getattr(k, window.field) is not None]
        if not total.limited or not (holders or holders_keys):
            continue
        pool = pools.get(window.name)
        lines.append(AllotmentLine(
            "pool", "", "Shared pool", window.name, window.per, total.pool,
            used=pool.borrowed if pool else None, left=pool.left if pool else None,
            credit=pool.credit if pool else 0))

        def line(kind: str, ref: str, label: str, allotment: int) -> AllotmentLine:
            live = figures.get((kind, ref, window.name))
            return AllotmentLine(kind, ref, label, window.name, window.per, allotment,
                                 used=live.used if live else None,
                                 borrowed=live.borrowed if live else None,
                                 left=live.left if live else None)

        with_allotment = {p.pk for p in holders}
        for project in holders:
            lines.append(line("project", project.public_id, project.name,
                              getattr(project, window.field)))
            lines.extend(line("key", k.public_id, k.name or k.public_id, getattr(k, window.field))
                         for k in holders_keys if k.project_id == project.pk)
        lines.extend(line("key", k.public_id, k.name or k.public_id, getattr(k, window.field))
                     for k in holders_keys if k.project_id not in with_allotment)
    return lines


def tenant_allotment_lines(tenant: Tenant, *, limits: EffectiveLimits | None = None,
                           projects: list[Project] | None = None) -> Allotments:
    """The tenant's allotment rows, with their live figures when Redis answers."""
    limits = limits or selectors.effective_limits(tenant)
    totals = tenant_allotments(tenant, limits=limits)
    if projects is None:
        projects = list(selectors.tenant_projects(tenant))
    keys = _allotted_keys(tenant)
    standing: AllotmentStanding | None = None
    if any(t.limited and (t.allotted or t.keys_allotted) for t in totals.values()):
        try:
            standing = allotment_standing(tenant)
        except QuotaStoreUnavailable:
            standing = None
    else:
        standing = AllotmentStanding((), ())  # nothing allotted: nothing to read
    return Allotments(_lines(totals, projects, keys, standing),
                      [t.warning() for t in totals.values() if t.over], standing is not None)
