"""tenants 0011 makes the free plan reset daily; quotas 0002 applies the change rule to the free
plan's existing tenants: their calendar month finishes first (in their time zone), then the daily
cycle takes over, and the calendar months before stay recorded for reports.

The test takes the database back to tenants 0010 with Django's migration executor (unapplying
0011 and what depends on it: quotas 0001-0002, billing 0010), creates tenants as 0010 knew them
(historical models), and migrates forward again, all inside the test's transaction (PostgreSQL's
DDL is transactional), so nothing of it outlives the test. Then the application's own code reads
the tenants: their schedule, their windows, the reports' spans and a later change of cycle
(real Redis for the change's clock)."""
from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.recorder import MigrationRecorder

from quotas.cycles import (
    calendar_for,
    change_cycle,
    recent_cycle_windows,
    report_span,
    schedule_for,
)
from quotas.models import CyclePeriod
from quotas.windows import DAILY, Calendar, Cycle, CycleKind, CycleSchedule, WindowKind
from tenants.models import AuditEvent, Plan, Tenant
from tests.quotas.test_cycle_changes import wait_past

pytestmark = pytest.mark.django_db
BEFORE = [("tenants", "0010_audit_target_length")]
SEEDED = [("tenants", "0011_cycles_allotments_forecast"), ("quotas", "0001_cycle_periods")]
MONTH = WindowKind.MONTH
CALENDAR_MONTH_UTC = Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone="UTC")


def _migrate(targets: list[tuple[str, str]] | None = None) -> Any:
    """Migrate to `targets` (every app's latest when None); the historical apps there."""
    # Rows written since the last schema change: check their deferred constraints now
    # (PostgreSQL refuses to ALTER a table with pending trigger events).
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    targets = targets or executor.loader.graph.leaf_nodes()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _seeded_at() -> datetime:
    """When tenants 0011 was applied (django_migrations): the instant the free plan changed."""
    return MigrationRecorder.Migration.objects.get(app=SEEDED[0][0], name=SEEDED[0][1]).applied


def _reload(pk: int) -> Tenant:
    return Tenant.objects.select_related("plan").get(pk=pk)


def _old_tenants(*slugs_plans: tuple[str, str]) -> list[int]:
    """Back to tenants 0010 (before reset cycles): tenants created there months ago, so that
    their past calendar months are reports' windows."""
    apps = _migrate(BEFORE)
    plans = apps.get_model("tenants", "Plan").objects
    tenants = apps.get_model("tenants", "Tenant").objects
    pks = []
    for slug, plan in slugs_plans:
        pk = tenants.create(slug=slug, name=slug.title(), plan=plans.get(name=plan)).pk
        tenants.filter(pk=pk).update(created_at=datetime(2025, 10, 3, 9, 0, tzinfo=UTC))
        pks.append(pk)
    return pks


def _assert_pinned(t: Tenant, changed_ms: int) -> tuple[int, int]:
    """The tenant keeps the calendar month current at `changed_ms` (in its zone) until it ends,
    then resets daily, recorded as the change rule records a plan change. (month end, switch)"""
    zone = t.time_zone
    calendar_month = Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone=zone)
    daily = Cycle(CycleKind.DAYS, DAILY.anchor, 1, zone)
    # The calendar month current when 0011 changed the plan, by the application's windows.
    month = Calendar(CycleSchedule(calendar_month)).window(MONTH, changed_ms)
    assert month.id == f"m{datetime.fromtimestamp(changed_ms / 1000, ZoneInfo(zone)):%Y-%m}"
    schedule = schedule_for(t)
    assert schedule.current == calendar_month and schedule.next == daily
    assert schedule.switch_ms == month.end_ms == _ms(t.cycle_changes_at)
    # The tenant's own columns are untouched (the plan's cycle, its zone).
    assert (t.cycle, t.cycle_anchor, t.cycle_every_days) == ("", None, None)
    cal = calendar_for(t)
    # Its counters stay in the month they were counting in until the month's end...
    assert cal.window(MONTH, changed_ms) == month
    assert cal.window(MONTH, month.end_ms - 1).id == month.id
    # ...then reset daily, from the first local midnight of the next month.
    first_day = datetime.fromtimestamp(month.end_ms / 1000, ZoneInfo(zone))
    assert (first_day.day, first_day.hour, first_day.minute) == (1, 0, 0)
    after = cal.window(MONTH, month.end_ms)
    assert (after.id, after.start_ms) == (f"c{first_day:%Y-%m-%d}", month.end_ms)
    assert cal.window(MONTH, after.end_ms).id == f"c{first_day.replace(day=2):%Y-%m-%d}"
    # The span of the calendar month is recorded, as the change rule records it.
    period = CyclePeriod.objects.get(tenant=t)
    assert (period.kind, period.anchor, period.time_zone, period.starts_at, period.ends_at) \
        == ("monthly", date(2000, 1, 1), zone, None, t.cycle_changes_at)
    event = AuditEvent.objects.get(tenant=t, action="tenant.cycle_changed")
    assert event.actor == "migration:quotas.0002" and event.target == t.public_id
    assert event.data["to"] == {"cycle": "daily", "time_zone": zone}
    return month.end_ms, _ms(t.cycle_changes_at)


def test_at_the_deploy_existing_free_tenants_finish_their_calendar_month_first() -> None:
    free_utc, free_auckland, standard, enterprise = _old_tenants(
        ("acme", "free"), ("kiwi", "free"), ("bigco", "standard"), ("huge", "enterprise"))
    apps = _migrate(SEEDED)
    historical = apps.get_model("tenants", "Tenant").objects
    assert apps.get_model("tenants", "Plan").objects.get(name="free").reset_cycle == "daily"
    # A tenant's time zone set between 0011 and quotas 0002: its month ends at its midnight.
    historical.filter(pk=free_auckland).update(time_zone="Pacific/Auckland")
    # Created on the daily plan: nothing to finish.
    newcomer = historical.create(slug="newco", name="Newco", plan=apps.get_model(
        "tenants", "Plan").objects.get(name="free")).pk
    _migrate()

    changed_ms = _ms(_seeded_at())
    assert Plan.objects.get(name="free").reset_cycle == "daily"
    _assert_pinned(_reload(free_utc), changed_ms)
    _assert_pinned(_reload(free_auckland), changed_ms)
    assert _reload(free_auckland).time_zone == "Pacific/Auckland"
    # At the deploy: the month's end is ahead (the rule's pending change).
    assert _ms(_reload(free_utc).cycle_changes_at) > changed_ms

    # Untouched: plans that still reset monthly, and a tenant created on the daily plan.
    for pk in (standard, enterprise, newcomer):
        t = _reload(pk)
        assert t.next_cycle is None and t.cycle_changes_at is None
        assert not CyclePeriod.objects.filter(tenant=t).exists()
    assert schedule_for(_reload(standard)).current == CALENDAR_MONTH_UTC
    assert schedule_for(_reload(newcomer)) == CycleSchedule(Cycle(CycleKind.DAYS, DAILY.anchor))

    # Reports: the current month and the ones before resolve as calendar months, and the
    # console's list offers them.
    t = _reload(free_utc)
    month = Calendar().window(MONTH, changed_ms)
    earlier = Calendar().window(MONTH, month.start_ms - 1)
    listed = [span.id for span in recent_cycle_windows(t, count=3, at_ms=changed_ms)]
    assert listed[:2] == [month.id, earlier.id] and len(listed) == 3
    past = report_span(t, earlier.id)
    assert (_ms(past.start), _ms(past.end), past.zone) == (earlier.start_ms, earlier.end_ms, "UTC")
    assert report_span(t, "m2026-01").start == datetime(2026, 1, 1, tzinfo=UTC)

    # A change before the month's end replaces the pending one, the switch and the pin staying.
    done = change_cycle(t, cycle="", time_zone="Europe/Paris", actor="test")
    assert done.in_force == CALENDAR_MONTH_UTC and done.changes_at == month.end_ms
    schedule = schedule_for(_reload(free_utc))
    assert schedule.current == CALENDAR_MONTH_UTC
    assert schedule.next == Cycle(CycleKind.DAYS, DAILY.anchor, 1, "Europe/Paris")
    assert CyclePeriod.objects.get(tenant=t).ends_at == _reload(free_utc).cycle_changes_at


def test_a_database_that_applied_0011_in_an_earlier_month_switched_at_that_months_end() -> None:
    """tenants 0011 applied before quotas 0002 existed (its tenants have counted daily windows
    since that month's end): the rule is applied as of 0011's moment, so they are not moved back
    to a calendar month; the months before still resolve, also once a later change folds the
    record into the tenant's fields."""
    (acme,) = _old_tenants(("acme", "free"))
    _migrate(SEEDED)
    seeded_at = datetime(2026, 10, 20, 8, 30, tzinfo=UTC)
    MigrationRecorder.Migration.objects.filter(app=SEEDED[0][0], name=SEEDED[0][1]).update(
        applied=seeded_at)
    _migrate()

    now = _ms(datetime.now(UTC))
    month_end, switch = _assert_pinned(_reload(acme), _ms(seeded_at))
    assert switch == month_end == _ms(datetime(2026, 11, 1, tzinfo=UTC)) < now
    t = _reload(acme)
    assert calendar_for(t).window(MONTH, now).id == f"c{datetime.now(UTC):%Y-%m-%d}"
    assert report_span(t, "m2026-10").end == datetime(2026, 11, 1, tzinfo=UTC)

    # A later change folds the record (the daily cycle in force becomes the tenant's fields):
    # the calendar months before it are read from the recorded span.
    done = change_cycle(t, cycle="", time_zone="Europe/Paris", actor="test")
    assert done.in_force == Cycle(CycleKind.DAYS, DAILY.anchor, 1, "UTC")
    assert done.changes_at is not None
    wait_past(done.changes_at)  # nothing counted: at once
    t = _reload(acme)
    assert "before" not in (t.next_cycle or {})
    for period, start, end in (("m2026-10", datetime(2026, 10, 1, tzinfo=UTC),
                                datetime(2026, 11, 1, tzinfo=UTC)),
                               ("m2026-01", datetime(2026, 1, 1, tzinfo=UTC),
                                datetime(2026, 2, 1, tzinfo=UTC))):
        span = report_span(t, period)
        assert (span.start, span.end, span.zone) == (start, end, "UTC")
    listed = [span.id for span in recent_cycle_windows(t, count=60)]
    assert "m2026-10" in listed and "m2026-01" in listed and "m2025-10" in listed
