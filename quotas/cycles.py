"""A tenant's windows: its time zone and cycle, as the quota engine and every reader use them.

One home: `schedule_for(tenant)` is the only place the tenant's and plan's cycle fields are read
(tenants.models: Plan.reset_cycle, Tenant.time_zone / cycle / cycle_anchor / cycle_every_days,
and a pending change in next_cycle / cycle_changes_at). The gateway, the ledger drain, alerts,
the rebuild, the dashboard, reports and reconciliation all take their windows from
`calendar_for(tenant)`, so a counter, an alert and a report line agree on where a window starts.
"""
from __future__ import annotations

from datetime import date
from typing import TYPE_CHECKING, Any

from quotas.windows import DAILY, Calendar, Cycle, CycleKind, CycleSchedule

if TYPE_CHECKING:
    from tenants.models import Tenant

_CALENDARS: dict[CycleSchedule, Calendar] = {}


def cycle_of(*, plan_reset: str, allows_custom: bool, cycle: str, anchor: date | None,
             every_days: int | None, zone: str) -> Cycle:
    """The cycle that these field values describe (tenants.models field meanings)."""
    if allows_custom and cycle == "monthly":
        return Cycle(CycleKind.MONTHLY, anchor or date(2000, 1, 1), zone=zone)
    if allows_custom and cycle == "weekly":
        return Cycle(CycleKind.DAYS, anchor or date(2000, 1, 3), 7, zone)  # 2000-01-03: Monday
    if allows_custom and cycle == "days":
        return Cycle(CycleKind.DAYS, anchor or date(2000, 1, 1), every_days or 1, zone)
    if plan_reset == "daily":
        return Cycle(CycleKind.DAYS, DAILY.anchor, 1, zone)
    return Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone=zone)


def _spec_cycle(tenant: Tenant, spec: dict[str, Any]) -> Cycle:
    anchor = spec.get("anchor")
    return cycle_of(plan_reset=spec.get("plan_reset", tenant.plan.reset_cycle),
                    allows_custom=spec.get("allows_custom", tenant.plan.allows_custom_cycle),
                    cycle=spec.get("cycle", ""),
                    anchor=date.fromisoformat(anchor) if anchor else None,
                    every_days=spec.get("every_days"), zone=spec.get("time_zone", "UTC"))


def schedule_for(tenant: Tenant) -> CycleSchedule:
    """The tenant's schedule: its cycle now, and the pending change if one was asked for."""
    plan = tenant.plan
    current = cycle_of(plan_reset=plan.reset_cycle, allows_custom=plan.allows_custom_cycle,
                       cycle=tenant.cycle, anchor=tenant.cycle_anchor,
                       every_days=tenant.cycle_every_days, zone=tenant.time_zone)
    if tenant.next_cycle and tenant.cycle_changes_at is not None:
        switch_ms = int(tenant.cycle_changes_at.timestamp() * 1000)
        return CycleSchedule(current, _spec_cycle(tenant, tenant.next_cycle), switch_ms)
    return CycleSchedule(current)


def calendar_for(tenant: Tenant) -> Calendar:
    """The tenant's Calendar (shared per schedule, so its window cache serves every caller)."""
    schedule = schedule_for(tenant)
    found = _CALENDARS.get(schedule)
    if found is None:
        if len(_CALENDARS) > 4096:
            _CALENDARS.clear()
        found = _CALENDARS[schedule] = Calendar(schedule)
    return found
