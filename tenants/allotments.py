"""Guaranteed allotments: the arithmetic of who has reserved what out of a tenant's quota.

A project, or a key, may have an allotment per window: tokens reserved for it alone out of the
tenant's quota of that window (day: the tenant's tokens per day; "month": its cycle token
budget, monthly_token_budget). The allotments are nested:

- top-level allotments: every project's, and the allotments of keys whose project has none of
  that window; they are carved out of the tenant's quota, and what is left is the shared pool;
- a key in a project that has an allotment of that window is carved out of its project's
  allotment; the project's unallotted part (its allotment minus its keys') is the project's
  own reserve.

Only keys that are not revoked hold an allotment (revoking one frees it). A tenant window
without a limit has no allotments: there is nothing to carve. The quota may be lowered below the
allotments later (a plan change, an override): that is allowed, the pool is then 0 and
`WindowAllotments.over` says so; tenants.services.allotments refuses any change that would add to
such an excess.

Read-only here; the rules a change must respect are in tenants/services/allotments.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from django.db.models import Q

from tenants.models import UNLIMITED, ApiKey, Project, Tenant
from tenants.selectors import EffectiveLimits, effective_limits


@dataclass(frozen=True)
class AllotmentWindow:
    """One window allotments are made in, and the names of its fields."""

    name: str  # the quota window's name (quotas.windows.WindowKind value): "day" or "month"
    field: str  # a project's or key's allotment of the window
    own_limit: str  # a project's or key's own limit of the window
    quota: str  # the tenant's limit of the window (an EffectiveLimits attribute)
    per: str  # how messages name the window: "per day", "per cycle"
    quota_name: str  # how messages name the tenant's limit of the window


DAY = AllotmentWindow("day", "allotment_tokens_per_day", "tokens_per_day", "tokens_per_day",
                      "per day", "daily quota")
CYCLE = AllotmentWindow("month", "allotment_tokens_per_month", "tokens_per_month",
                        "monthly_token_budget", "per cycle", "cycle token budget")
WINDOWS: tuple[AllotmentWindow, ...] = (DAY, CYCLE)
ALLOTMENT_FIELDS: tuple[str, ...] = tuple(w.field for w in WINDOWS)


@dataclass(frozen=True)
class Holder:
    """A project's or a key's allotments (None: none of that window)."""

    pk: int | None  # None: not saved yet
    project_pk: int | None  # a key's project; a project's own pk (None while unsaved)
    day: int | None
    month: int | None

    def of(self, window: AllotmentWindow) -> int | None:
        return self.day if window is DAY else self.month


def holder_of(row: Project | ApiKey) -> Holder:
    if isinstance(row, Project):
        return Holder(row.pk, row.pk, row.allotment_tokens_per_day, row.allotment_tokens_per_month)
    return Holder(row.pk, row.project_id, row.allotment_tokens_per_day,
                  row.allotment_tokens_per_month)


@dataclass(frozen=True)
class WindowAllotments:
    """A tenant's allotments of one window."""

    window: AllotmentWindow
    quota: int  # the tenant's limit of the window; UNLIMITED: none (no allotments then)
    allotted: int  # the top-level allotments' total
    # Per project with an allotment of the window: the total of its keys' allotments.
    keys_allotted: Mapping[int, int] = field(default_factory=dict)

    @property
    def limited(self) -> bool:
        return self.quota != UNLIMITED

    @property
    def pool(self) -> int:
        """The shared pool: the quota minus the top-level allotments, never below 0
        (UNLIMITED when the window has no quota)."""
        return max(0, self.quota - self.allotted) if self.limited else UNLIMITED

    @property
    def over(self) -> int:
        """By how many tokens the allotments exceed the quota (0: they fit). Only a lowered
        quota can make it positive; the services refuse to add to it."""
        return max(0, self.allotted - self.quota) if self.limited else 0

    def as_dict(self) -> dict[str, object]:
        """The management API's form (null: no quota in the window)."""
        return {"window": self.window.name,
                "quota": self.quota if self.limited else None,
                "allotted": self.allotted,
                "pool": self.pool if self.limited else None,
                "over": self.over, "warning": self.warning()}

    def warning(self) -> str:
        """What the console and the API say when the allotments exceed the quota ("" if not)."""
        if not self.over:
            return ""
        return (f"Allotments total {self.allotted:,} tokens {self.window.per}, more than the "
                f"tenant's {self.window.quota_name} of {self.quota:,}: the shared pool is empty "
                f"and the allotments cannot all be honoured. Lower them by {self.over:,} tokens.")


def window_allotments(
    window: AllotmentWindow, quota: int, projects: Iterable[Holder], keys: Iterable[Holder]
) -> WindowAllotments:
    """The totals of one window, from every project of the tenant and its unrevoked keys."""
    allotted = 0
    with_allotment: set[int | None] = set()
    for project in projects:
        value = project.of(window)
        if value is not None:
            allotted += value
            with_allotment.add(project.project_pk)
    keys_allotted: dict[int, int] = {}
    for key in keys:
        value = key.of(window)
        if value is None:
            continue
        if key.project_pk in with_allotment and key.project_pk is not None:
            keys_allotted[key.project_pk] = keys_allotted.get(key.project_pk, 0) + value
        else:
            allotted += value
    return WindowAllotments(window, quota, allotted, keys_allotted)


def stored_holders(tenant: Tenant) -> tuple[list[Holder], list[Holder]]:
    """The allotments of the tenant's projects and of its unrevoked keys, as stored (two
    queries). Keys without an allotment are left out: they add nothing to any total, and a
    tenant with 20,000 keys had every one read for the limits page and each key's save (a key
    left out reads as one without a stored allotment, which it is)."""
    projects = [
        Holder(pk, pk, day, month)
        for pk, day, month in Project.objects.filter(tenant=tenant).values_list(
            "pk", *ALLOTMENT_FIELDS)
    ]
    keys = [
        Holder(pk, project_pk, day, month)
        for pk, project_pk, day, month in ApiKey.objects.filter(
            Q(allotment_tokens_per_day__isnull=False) | Q(allotment_tokens_per_month__isnull=False),
            project__tenant=tenant, revoked_at__isnull=True,
        ).values_list("pk", "project_id", *ALLOTMENT_FIELDS)
    ]
    return projects, keys


def tenant_allotments(
    tenant: Tenant, *, limits: EffectiveLimits | None = None
) -> dict[str, WindowAllotments]:
    """The tenant's allotments per window name ("day", "month"), as stored."""
    limits = limits or effective_limits(tenant)
    projects, keys = stored_holders(tenant)
    return {w.name: window_allotments(w, getattr(limits, w.quota), projects, keys)
            for w in WINDOWS}


def over_quota_warnings(tenant: Tenant, *, limits: EffectiveLimits | None = None) -> list[str]:
    """One sentence per window whose allotments exceed the tenant's quota (empty: none)."""
    return [a.warning() for a in tenant_allotments(tenant, limits=limits).values() if a.over]
