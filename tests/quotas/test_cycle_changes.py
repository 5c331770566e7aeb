"""Changing a tenant's cycle (quotas.cycles.change_cycle, and a change of plan): what is refused,
when the change takes effect (the current window finishes on the old cycle; at once for a tenant
that counted nothing in it), a second change before the switch, the fold after it, the windows
on either side of the switch, the spans kept for reports, and the surfaces (CLI, API, admin)."""
from __future__ import annotations

import json
import time
from datetime import UTC, date, datetime
from io import StringIO
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.urls import reverse

from gateway.auth import load_key_context
from quotas.cycles import (
    CycleSpec,
    PlanTraits,
    Timeline,
    calendar_for,
    change_cycle,
    recent_cycle_windows,
    report_span,
    reschedule,
    schedule_for,
)
from quotas.engine import UNLIMITED, ReserveRequest, ScopeLimit
from quotas import keys
from quotas.keys import tenant_tag
from quotas.models import CyclePeriod
from quotas.runtime import get_engine
from quotas.windows import Cycle, CycleKind, WindowKind
from tenants.api_key_format import parse_key
from tenants.models import AuditEvent, Tenant
from tenants.services import change_plan, create_project, create_tenant, issue_key
from tests.world import World

pytestmark = pytest.mark.django_db
DAY, MONTH = WindowKind.DAY, WindowKind.MONTH


def redis_ms() -> int:
    seconds, micros = get_engine().client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_past(ms: int) -> None:
    while redis_ms() <= ms:
        time.sleep(0.02)


def tenant(plan: str = "enterprise", slug: str = "acme") -> Tenant:
    created = create_tenant(slug, plan_name=plan, actor="test")
    return Tenant.objects.select_related("plan").get(pk=created.pk)


def reload(t: Tenant) -> Tenant:
    return Tenant.objects.select_related("plan").get(pk=t.pk)


def use(t: Tenant, rid: str = "r1", tokens: int = 10) -> None:
    """A call counted in the tenant's current windows, as the gateway reserves it."""
    limits = (ScopeLimit("tenant", DAY, UNLIMITED), ScopeLimit("tenant", MONTH, UNLIMITED))
    engine = get_engine()
    hold = engine.reserve(ReserveRequest(tenant_tag(t.pk), f"{rid}-{t.pk}", tokens, limits,
                                         schedule=schedule_for(t))).hold
    assert hold is not None
    engine.settle(hold, tokens)


def current(t: Tenant, kind: WindowKind = MONTH) -> str:
    return calendar_for(t).window(kind, redis_ms()).id


# -- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(("plan", "fields", "field", "words"), [
    ("free", {"cycle": "monthly", "anchor": date(2026, 1, 15)}, "cycle", "no cycles of a"),
    ("standard", {"cycle": "weekly", "anchor": date(2026, 1, 5)}, "cycle", "enterprise"),
    ("enterprise", {"cycle": "monthly"}, "anchor", "billing day"),
    ("enterprise", {"cycle": "weekly"}, "anchor", "weekday"),
    ("enterprise", {"cycle": "days", "anchor": date(2026, 1, 5)}, "every_days", "1 to 366"),
    ("enterprise", {"cycle": "days", "anchor": date(2026, 1, 5), "every_days": 400},
     "every_days", "1 to 366"),
    ("enterprise", {"cycle": "weekly", "anchor": date(2026, 1, 5), "every_days": 7},
     "every_days", "Only an every-N-days"),
    ("enterprise", {"cycle": "", "anchor": date(2026, 1, 5)}, "anchor", "no anchor"),
    ("enterprise", {"cycle": "yearly"}, "cycle", "Unknown cycle"),
    ("enterprise", {"cycle": "", "time_zone": "Mars/Olympus"}, "time_zone", "time zone"),
])
def test_a_cycle_the_plan_does_not_allow_or_that_lacks_its_anchor_is_refused(
        plan: str, fields: dict, field: str, words: str) -> None:
    t = tenant(plan)
    audits = AuditEvent.objects.count()
    with pytest.raises(ValidationError) as refused:
        change_cycle(t, actor="test", **fields)
    assert words in " ".join(refused.value.message_dict[field])
    t = reload(t)
    assert (t.cycle, t.next_cycle, t.cycle_changes_at, t.time_zone) == ("", None, None, "UTC")
    assert AuditEvent.objects.count() == audits


# -- when the change takes effect -----------------------------------------------------------------


def test_a_tenant_that_counted_nothing_switches_at_once() -> None:
    t = tenant()
    before = redis_ms()
    done = change_cycle(t, cycle="monthly", anchor=date(2026, 1, 15), time_zone="Europe/Paris",
                        actor="user:ops")
    assert done.at_once and done.changes_at is not None
    # At the next whole second: window ids name seconds.
    assert before < done.changes_at <= before + 1000 and done.changes_at % 1000 == 0
    t = reload(t)
    [event] = AuditEvent.objects.filter(action="tenant.cycle_changed", tenant=t)
    assert event.actor == "user:ops" and event.data["at_once"] is True
    assert event.data["to"] == {"cycle": "monthly from the 15th", "time_zone": "Europe/Paris"}
    # The first window on the new cycle starts at the switch, with an id of its own.
    first = calendar_for(t).window(MONTH, done.changes_at + 1)
    assert first.start_ms == done.changes_at and first.id.endswith(f"@{done.changes_at // 1000}")
    assert first.end_ms == _paris_midnight_of_next_15th(done.changes_at)


def _paris_midnight_of_next_15th(after_ms: int) -> int:
    local = datetime.fromtimestamp(after_ms / 1000, ZoneInfo("Europe/Paris")).date()
    year, month = (local.year, local.month) if local.day < 15 else (
        (local.year + local.month // 12, local.month % 12 + 1))
    return int(datetime(year, month, 15, tzinfo=ZoneInfo("Europe/Paris")).timestamp() * 1000)


def test_the_current_window_finishes_on_the_old_cycle_then_a_short_window_starts() -> None:
    t = tenant()
    use(t)
    running = calendar_for(t).window(MONTH, redis_ms())  # the calendar month, UTC
    done = change_cycle(t, cycle="weekly", anchor=date(2026, 1, 7), actor="test")
    assert not done.at_once and done.changes_at == running.end_ms
    t = reload(t)
    assert t.cycle == "" and t.next_cycle["cycle"] == "weekly"  # pending: fields unchanged
    assert int(t.cycle_changes_at.timestamp() * 1000) == running.end_ms
    cal = calendar_for(t)
    # Until the switch: the same window, same id, same end (no counter is cut short).
    assert cal.window(MONTH, redis_ms()) == running
    # After it: the week that began on the Wednesday before the switch, cut at the switch.
    first = cal.window(MONTH, running.end_ms)
    assert first.id.startswith("c") and first.id.endswith(f"@{running.end_ms // 1000}")
    assert first.start_ms == running.end_ms
    assert datetime.fromtimestamp(first.end_ms / 1000, UTC).weekday() == 2  # a Wednesday
    assert first.end_ms - first.start_ms <= 7 * 86_400_000
    # The gateway's next lookup of a key carries the new schedule.
    project = create_project(t, "web", actor="test")
    issued = issue_key(project, actor="test")
    ctx = load_key_context(parse_key(issued.plaintext) or "")
    assert ctx is not None and ctx.schedule == schedule_for(t)
    assert ctx.schedule.next == Cycle(CycleKind.DAYS, date(2026, 1, 7), 7, "UTC")


def test_a_second_change_replaces_the_pending_one_and_asking_for_the_current_cancels() -> None:
    t = tenant()
    use(t)
    first = change_cycle(t, cycle="days", anchor=date(2026, 1, 1), every_days=10, actor="test")
    second = change_cycle(reload(t), cycle="monthly", anchor=date(2026, 1, 31),
                          time_zone="America/New_York", actor="test")
    assert second.changes_at == first.changes_at and second.had_pending
    t = reload(t)
    assert schedule_for(t).next == Cycle(CycleKind.MONTHLY, date(2026, 1, 31),
                                         zone="America/New_York")
    assert CyclePeriod.objects.filter(tenant=t).count() == 1  # rewritten, not added
    cancelled = change_cycle(t, cycle="", actor="test")
    assert cancelled.writes and cancelled.changes_at is None
    t = reload(t)
    assert (t.next_cycle, t.cycle_changes_at) == (None, None)
    assert schedule_for(t).next is None
    assert not CyclePeriod.objects.filter(tenant=t).exists()
    # Asking for the cycle in force with nothing pending writes nothing.
    audits = AuditEvent.objects.count()
    assert not change_cycle(t, cycle="", actor="test").writes
    assert AuditEvent.objects.count() == audits


def test_after_the_switch_the_pending_change_is_folded_and_its_first_window_keeps_its_id() -> None:
    t = tenant()
    use(t)
    done = change_cycle(t, cycle="weekly", anchor=date(2026, 1, 5), actor="test")
    t = reload(t)
    switch = done.changes_at
    assert switch is not None
    pending = calendar_for(t)
    later = switch + 3_600_000  # an hour into the first window after the switch
    # Calls counted in that first window by then (the Redis clock cannot be moved forward, so
    # its counter is written as the reserve script writes it).
    counted = keys.counter_key(tenant_tag(t.pk), "tenant", pending.window(MONTH, later).id)
    get_engine().client.hset(counted, mapping={"limit": -1, "used": 5, "pending": 0,
                                               "credit": 0})
    get_engine().client.expire(counted, 3 * 86400)
    # A change asked then (as of `later`): the weekly cycle is folded into the tenant's fields,
    # and its first window keeps its "@" id until it ends, when the new change takes over.
    again = reschedule(t, CycleSpec("days", date(2026, 1, 1), 3, "UTC"),
                       PlanTraits.of(t.plan), later)
    assert again.fields["cycle"] == "weekly" and again.fields["cycle_anchor"] == date(2026, 1, 5)
    assert again.since == switch
    assert again.changes_at == pending.window(MONTH, later).end_ms
    Tenant.objects.filter(pk=t.pk).update(**again.fields)
    folded = calendar_for(reload(t))
    for at in (switch, later, switch + 86_400_000):
        if at < again.changes_at:
            assert folded.window(MONTH, at) == pending.window(MONTH, at)
            assert folded.window(DAY, at) == pending.window(DAY, at)


def test_a_time_zone_change_moves_the_days_at_the_switch() -> None:
    t = tenant("standard")
    use(t)
    day_before = current(t, DAY)
    done = change_cycle(t, cycle="", time_zone="Asia/Tokyo", actor="test")
    t = reload(t)
    assert current(t, DAY) == day_before  # today stays the UTC day until the month ends
    cal = calendar_for(t)
    assert done.changes_at is not None
    day = cal.window(DAY, done.changes_at)
    # The month ends at UTC midnight, 09:00 in Tokyo: the first Tokyo day is 15 hours long.
    assert day.start_ms == done.changes_at and day.end_ms - day.start_ms == 15 * 3_600_000
    assert cal.window(MONTH, done.changes_at).id.startswith("m")


# -- a change of plan -----------------------------------------------------------------------------


def test_a_plan_change_that_changes_the_cycle_waits_for_the_current_window() -> None:
    t = tenant("free")
    use(t)
    today = calendar_for(t).window(MONTH, redis_ms())  # the free plan's cycle: the day
    assert today.id.startswith("c")
    change_plan(t, "standard", actor="test")
    t = reload(t)
    assert t.plan.name == "standard"  # its limits apply at once
    schedule = schedule_for(t)
    assert schedule.current == Cycle(CycleKind.DAYS, date(2000, 1, 1), 1, "UTC")  # pinned
    assert schedule.switch_ms == today.end_ms
    assert calendar_for(t).window(MONTH, redis_ms()) == today
    after = calendar_for(t).window(MONTH, today.end_ms)
    assert after.id == f"m{datetime.fromtimestamp(today.end_ms / 1000, UTC):%Y-%m}" + (
        "" if after.start_ms == today.end_ms and _first_of_month(today.end_ms)
        else f"@{today.end_ms // 1000}")
    event = AuditEvent.objects.filter(action="tenant.plan_changed", tenant=t).get()
    assert event.data["cycle_changes_at"] == t.cycle_changes_at.isoformat(timespec="seconds")


def _first_of_month(ms: int) -> bool:
    return datetime.fromtimestamp(ms / 1000, UTC).day == 1


def test_a_plan_without_custom_cycles_drops_the_tenants_own() -> None:
    t = tenant("enterprise")
    done = change_cycle(t, cycle="weekly", anchor=date(2026, 1, 5), actor="test")  # at once
    assert done.at_once and done.changes_at is not None
    wait_past(done.changes_at)
    t = reload(t)
    use(t)  # counted in the first weekly window
    change_plan(t, "standard", actor="test")
    t = reload(t)
    record = t.next_cycle
    assert record["cycle"] == "" and schedule_for(t).next == Cycle(CycleKind.MONTHLY,
                                                                   date(2000, 1, 1))


# -- past windows for reports ---------------------------------------------------------------------


def test_reports_find_the_windows_of_a_past_cycle_and_the_first_one_after_a_change() -> None:
    t = tenant()
    use(t)
    old = calendar_for(t).window(MONTH, redis_ms())
    done = change_cycle(t, cycle="monthly", anchor=date(2026, 1, 15), actor="test")
    t = reload(t)
    assert done.changes_at == old.end_ms
    [span] = CyclePeriod.objects.filter(tenant=t)
    assert span.ends_at == datetime.fromtimestamp(old.end_ms / 1000, UTC)
    line = Timeline(t)
    assert report_span(t, old.id, line).id == old.id
    first = line.window(MONTH, old.end_ms)
    found = report_span(t, first.id, line)
    assert (found.id, int(found.start.timestamp() * 1000)) == (first.id, old.end_ms)
    with pytest.raises(ValueError, match="not one of this tenant's cycle windows"):
        report_span(t, "c2026-12-16", line)
    with pytest.raises(ValueError, match="YYYY-MM"):
        report_span(t, "2026-13", line)
    month = report_span(t, "2026-02", line)
    assert (month.start.isoformat(), month.end.isoformat()) == (
        "2026-02-01T00:00:00+00:00", "2026-03-01T00:00:00+00:00")
    assert [w.id for w in recent_cycle_windows(t, at_ms=old.end_ms + 1)] == [first.id, old.id]


# -- the surfaces ---------------------------------------------------------------------------------


def test_the_tenant_cycle_command_shows_and_changes() -> None:
    t = tenant()
    out = StringIO()
    call_command("tenant_cycle", "acme", "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert shown["cycle"]["cycle"] == "monthly (calendar month)"
    out = StringIO()
    call_command("tenant_cycle", "acme", "--cycle", "monthly", "--anchor", "2026-01-31",
                 "--time-zone", "Europe/Paris", stdout=out)
    assert "monthly from the 31st" in out.getvalue() and "at once" in out.getvalue()
    t = reload(t)
    assert (t.cycle, t.cycle_anchor, t.time_zone) == ("", None, "UTC")  # pending, at once
    assert t.next_cycle["anchor"] == "2026-01-31"
    out = StringIO()
    call_command("tenant_cycle", "acme", "--time-zone", "Asia/Tokyo", stdout=out)  # keeps 31st
    assert reload(t).next_cycle["anchor"] == "2026-01-31"
    with pytest.raises(CommandError, match="every_days"):
        call_command("tenant_cycle", "acme", "--cycle", "days", "--anchor", "2026-01-01",
                     stdout=StringIO())
    with pytest.raises(CommandError, match="YYYY-MM-DD"):
        call_command("tenant_cycle", "acme", "--cycle", "weekly", "--anchor", "monday",
                     stdout=StringIO())


def test_the_api_shows_the_cycle_and_operators_change_it(world: World) -> None:
    url = f"/api/tenants/{world.acme.public_id}/limits"
    owner, operator = world.client(world.owner), world.client(world.operator)
    document = owner.get(url).json()["cycle"]
    assert document["cycle"] == "monthly (calendar month)" and document["time_zone"] == "UTC"
    assert document["window"]["id"] == current(world.acme) and document["pending"] is None
    assert document["windows"][0]["id"] == document["window"]["id"]
    refused = owner.patch(url, {"time_zone": "Europe/Paris"}, format="json")
    assert refused.status_code == 403
    bad = operator.patch(url, {"cycle": "weekly", "cycle_anchor": "2026-01-05"}, format="json")
    assert bad.status_code == 400 and "cycle" in bad.json()  # standard: no custom cycles
    use(world.acme)
    done = operator.patch(url, {"time_zone": "Europe/Paris"}, format="json")
    assert done.status_code in (200, 503)
    cycle = done.json()["cycle"]
    assert "when the current window" in cycle["change"]
    assert cycle["pending"]["time_zone"] == "Europe/Paris"
    assert cycle["asked"]["time_zone"] == "Europe/Paris"


def test_the_admin_changes_the_cycle_through_the_service(admin_client) -> None:
    t = tenant()
    page = admin_client.get(reverse("admin:tenants_tenant_change", args=[t.pk]))
    assert page.status_code == 200 and "monthly (calendar month)" in page.content.decode()
    form = {"slug": t.slug, "name": t.name, "plan": t.plan_id, "alert_thresholds": "[10, 5]",
            "status": "active", "forecast_threshold_percent": "80", "cycle": "days",
            "cycle_anchor": "2026-01-01", "cycle_every_days": "", "time_zone": "",
            "projects-TOTAL_FORMS": "0", "projects-INITIAL_FORMS": "0",
            "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"}
    refused = admin_client.post(reverse("admin:tenants_tenant_change", args=[t.pk]), form)
    assert refused.status_code == 200 and "1 to 366" in refused.content.decode()
    assert reload(t).next_cycle is None
    form["cycle_every_days"] = "14"
    saved = admin_client.post(reverse("admin:tenants_tenant_change", args=[t.pk]), form)
    assert saved.status_code == 302, saved.content.decode()[:3000]
    t = reload(t)
    assert schedule_for(t).next == Cycle(CycleKind.DAYS, date(2026, 1, 1), 14, "UTC")
    assert AuditEvent.objects.filter(action="tenant.cycle_changed", tenant=t,
                                     actor__startswith="user:").exists()


def test_tenant_set_plan_says_when_the_new_plans_cycle_takes_over() -> None:
    t = tenant("free")
    use(t)
    out = StringIO()
    call_command("tenant_set_plan", "acme", "standard", stdout=out)
    t = reload(t)
    assert t.cycle_changes_at is not None
    assert (f"reset cycle from {t.cycle_changes_at:%Y-%m-%d %H:%M}" in out.getvalue()
            and "current window finishes first" in out.getvalue())
