"""Existing tenants of a plan that tenants 0011 moved to a daily reset cycle (the free plan) keep
their calendar month until it ends, by the change rule of quotas/cycles.py.

Before tenants 0011 every tenant's 'month' counters ran on the calendar month (UTC; 0011 gives
every tenant the time zone UTC). 0011 seeds the free plan's reset cycle as daily, which, read
alone, switched its tenants to daily windows at the deploy, mid-month: their counters left
m2026-12 for c<day> at once, and the calendar months before had no recorded span, so the report
of a past month (m2026-01) of such a tenant found no window. A plan change is a change of cycle
(quotas.cycles.plan_cycle_rule): the window current when it happens finishes on the old cycle,
the new one takes over at its end. This applies that rule to the change 0011 made, exactly as
plan_cycle_rule records it (quotas.cycles.reschedule and _record_spans):

- Tenant.next_cycle: the tenant's own fields after the switch (its plan's cycle; a plan without
  cycles of a tenant's own drops one), with "before" pinning the plan traits the cycle in force
  is read with until the switch (reset "monthly", the plan's own allows_custom);
- Tenant.cycle_changes_at: the end of the calendar month, in the tenant's time zone, that was
  current when 0011 changed the plan (the instant 0011 was applied, as django_migrations
  records it: in one `migrate` run, seconds ago; on a database that applied 0011 earlier, the
  month of that moment, so a tenant already counting daily windows is not moved back);
- a CyclePeriod: the calendar month span ending at the switch (from the tenant's first window),
  so its past months still resolve in report_span and the console's report list once a later
  change folds the pending record.
The tenant's own columns are left as they are (as the rule leaves them); an audit event
(tenant.cycle_changed, actor "migration:quotas.0002") says what was scheduled.

The rule switches at once a tenant that counted nothing in its current window; a migration does
not read Redis, so every such tenant keeps the calendar month until its end (the cycle it had).

Skipped: tenants created after 0011 was applied (they never had the calendar month), tenants
with a change already recorded (next_cycle, cycle_changes_at or a CyclePeriod: the service
applied the rule itself), and tenants with a cycle of their own on a plan allowing one (the
plan's reset does not decide their cycle).

Historical models only (apps.get_model) and zoneinfo for the month's end: no application code,
which may change after this migration is written.
"""
from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any
from zoneinfo import ZoneInfo

from django.db import migrations
from django.db.migrations.recorder import MigrationRecorder

SEEDED = ("tenants", "0011_cycles_allotments_forecast")
ACTOR = "migration:quotas.0002"
# The cycle every tenant had before tenants 0011: quotas.windows.Cycle(CycleKind.MONTHLY,
# date(2000, 1, 1)), the calendar month (every_days unused by a monthly cycle, 1 as Cycle has).
CALENDAR_MONTH = {"kind": "monthly", "anchor": date(2000, 1, 1), "every_days": 1}


def _changed_at(schema_editor: Any) -> datetime:
    """When tenants 0011 changed the plans' reset cycles: when it was applied."""
    applied = (MigrationRecorder(schema_editor.connection).migration_qs
               .filter(app=SEEDED[0], name=SEEDED[1]).values_list("applied", flat=True).first())
    return applied if applied is not None else datetime.now(UTC)


def _month_end(moment: datetime, zone: str) -> datetime:
    """The end of the calendar month containing `moment` in `zone`: its next month's first
    local midnight (fold 0, as quotas.windows computes a window's start)."""
    tz = ZoneInfo(zone)
    local = moment.astimezone(tz)
    year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
    return datetime(year, month, 1, tzinfo=tz).astimezone(UTC)


def pin_calendar_month(apps: Any, schema_editor: Any) -> None:
    tenant_model = apps.get_model("tenants", "Tenant")
    period_model = apps.get_model("quotas", "CyclePeriod")
    audit_model = apps.get_model("tenants", "AuditEvent")
    changed_at = _changed_at(schema_editor)
    tenants = (tenant_model.objects.select_related("plan")
               .filter(plan__reset_cycle="daily", created_at__lt=changed_at,
                       next_cycle__isnull=True, cycle_changes_at__isnull=True)
               .exclude(cycle_periods__isnull=False).order_by("pk"))
    for tenant in tenants:
        custom = tenant.plan.allows_custom_cycle
        if custom and tenant.cycle:
            continue
        zone = tenant.time_zone
        switch = _month_end(changed_at, zone)
        tenant.next_cycle = {
            # quotas.cycles.CycleSpec.to_json of the plan's cycle (plan_cycle_rule's spec).
            "cycle": "", "anchor": None, "every_days": None, "time_zone": zone,
            # quotas.cycles.PlanTraits.to_json: the calendar month the tenant had.
            "before": {"plan_reset": "monthly", "allows_custom": custom},
        }
        tenant.cycle_changes_at = switch
        tenant.save(update_fields=["next_cycle", "cycle_changes_at"])
        period_model.objects.create(tenant=tenant, time_zone=zone, starts_at=None,
                                    ends_at=switch, **CALENDAR_MONTH)
        audit_model.objects.create(
            tenant=tenant, actor=ACTOR, action="tenant.cycle_changed", target=tenant.public_id,
            data={"from": {"cycle": "monthly (calendar month)", "time_zone": zone},
                  "to": {"cycle": "daily", "time_zone": zone},
                  "changes_at": switch.isoformat(timespec="seconds"),
                  "at_once": False, "replaces_pending": False,
                  "reason": f"plan {tenant.plan.name} resets daily (tenants 0011)"})


class Migration(migrations.Migration):

    dependencies = [
        ("quotas", "0001_cycle_periods"),
        SEEDED,
    ]

    operations = [
        # Unapplied, the pins stay: they are what the change rule asked for (and applying this
        # again skips the tenants that have them). Unapplying tenants 0011 drops the fields.
        migrations.RunPython(pin_calendar_month, migrations.RunPython.noop),
    ]
