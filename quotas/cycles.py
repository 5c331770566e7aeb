"""A tenant's windows: its time zone and cycle, as the quota engine and every reader use them, and
the one service that changes them.

One home: `schedule_for(tenant)` is the only place the tenant's and plan's cycle fields are read
(tenants.models: Plan.reset_cycle / allows_custom_cycle, Tenant.time_zone / cycle / cycle_anchor /
cycle_every_days, and the record in next_cycle / cycle_changes_at). The gateway, the ledger
drain, alerts, the rebuild, the dashboard, the usage API, reports and the commands all take their
windows from `calendar_for(tenant)` (or `timeline_for(tenant)` for past windows), so a counter,
an alert and a report line agree on where a window starts.

The change rule (`change_cycle`, and a plan change through `plan_cycle_rule`): the window in
force when a change is asked for finishes on the old cycle; the new cycle takes over at its end
(`cycle_changes_at`), its first window running from there to the new cycle's next boundary, with
the full limit (nothing is prorated). A time-zone change is a change of cycle like any other (the
day windows move to the new zone at the same switch). A tenant that has counted nothing in its
current cycle window switches at once (at the next whole second): no counter is cut short. A
second change before the switch replaces the pending one (the switch stays); asking again for the
cycle in force cancels it. After the switch the pending record stays as it is (the schedule
applies it by the Redis clock) and is folded into the tenant's own fields at the next change.

The record in Tenant.next_cycle (JSON; read and written only here):
  {"cycle": ""|"monthly"|"weekly"|"days", "anchor": "YYYY-MM-DD"|null, "every_days": int|null,
   "time_zone": "Europe/Paris"}   the tenant's fields after the switch (a pending change; with
                                   cycle_changes_at, the switch instant)
  "before": {"plan_reset": "daily", "allows_custom": false}   the plan traits the cycle in force
                                   is read with until the switch (a plan change pins its old plan)
  "since": 1765843200000           when the cycle in force took over (ms): its windows that
                                   began earlier start there, with the "@" ids of a first window
Each part is optional; "since" stays after the pending change is folded.

Every change also records the span of the cycle it ends (quotas.models.CyclePeriod), so the
report of a window of a past cycle is cut exactly as the gateway cut its counters.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from django.core.exceptions import ValidationError
from django.db import transaction
from redis.exceptions import RedisError

from quotas import keys
from quotas.engine import QuotaError
from quotas.models import CyclePeriod
from quotas.runtime import get_engine
from quotas.windows import (
    DAILY,
    Calendar,
    Cycle,
    CycleKind,
    CycleSchedule,
    Window,
    WindowKind,
    calendar_of,
)

if TYPE_CHECKING:
    from tenants.models import Plan, Tenant

log = logging.getLogger(__name__)

# The tenant cycle values (tenants.models.TenantCycle), repeated so that this module's rules read
# without the models: "" follows the plan.
PLAN, MONTHLY, WEEKLY, DAYS = "", "monthly", "weekly", "days"
_CYCLES = (PLAN, MONTHLY, WEEKLY, DAYS)
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


# -- what the fields mean -------------------------------------------------------------------------


def cycle_of(*, plan_reset: str, allows_custom: bool, cycle: str, anchor: date | None,
             every_days: int | None, zone: str) -> Cycle:
    """The cycle that these field values describe (tenants.models field meanings)."""
    if allows_custom and cycle == MONTHLY:
        return Cycle(CycleKind.MONTHLY, anchor or date(2000, 1, 1), zone=zone)
    if allows_custom and cycle == WEEKLY:
        return Cycle(CycleKind.DAYS, anchor or date(2000, 1, 3), 7, zone)  # 2000-01-03: Monday
    if allows_custom and cycle == DAYS:
        return Cycle(CycleKind.DAYS, anchor or date(2000, 1, 1), every_days or 1, zone)
    if plan_reset == "daily":
        return Cycle(CycleKind.DAYS, DAILY.anchor, 1, zone)
    return Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone=zone)


@dataclass(frozen=True)
class CycleSpec:
    """A tenant's cycle fields: what it asks for (resolved against a plan by `resolve`)."""

    cycle: str
    anchor: date | None
    every_days: int | None
    time_zone: str

    @classmethod
    def of(cls, tenant: Tenant) -> CycleSpec:
        return cls(tenant.cycle, tenant.cycle_anchor, tenant.cycle_every_days, tenant.time_zone)

    @classmethod
    def from_json(cls, record: dict[str, Any], default_zone: str) -> CycleSpec:
        anchor = record.get("anchor")
        return cls(record.get("cycle", PLAN), date.fromisoformat(anchor) if anchor else None,
                   record.get("every_days"), record.get("time_zone", default_zone))

    def to_json(self) -> dict[str, Any]:
        return {"cycle": self.cycle,
                "anchor": self.anchor.isoformat() if self.anchor is not None else None,
                "every_days": self.every_days, "time_zone": self.time_zone}

    def fields(self) -> dict[str, Any]:
        return {"cycle": self.cycle, "cycle_anchor": self.anchor,
                "cycle_every_days": self.every_days, "time_zone": self.time_zone}

    def without_custom(self) -> CycleSpec:
        return CycleSpec(PLAN, None, None, self.time_zone)


@dataclass(frozen=True)
class PlanTraits:
    """What of a plan decides its tenants' cycle."""

    reset: str
    custom: bool

    @classmethod
    def of(cls, plan: Plan) -> PlanTraits:
        return cls(plan.reset_cycle, plan.allows_custom_cycle)

    @classmethod
    def from_json(cls, record: dict[str, Any], default: PlanTraits) -> PlanTraits:
        return cls(record.get("plan_reset", default.reset),
                   bool(record.get("allows_custom", default.custom)))

    def to_json(self) -> dict[str, Any]:
        return {"plan_reset": self.reset, "allows_custom": self.custom}


def resolve(spec: CycleSpec, traits: PlanTraits) -> Cycle:
    return cycle_of(plan_reset=traits.reset, allows_custom=traits.custom, cycle=spec.cycle,
                    anchor=spec.anchor, every_days=spec.every_days, zone=spec.time_zone)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


# -- the schedule ---------------------------------------------------------------------------------


def schedule_for(tenant: Tenant) -> CycleSchedule:
    """The tenant's schedule: its cycle now, and the pending change if one was asked for. Reads
    only the tenant row and its plan (no query when the plan was loaded with it)."""
    record = tenant.next_cycle or {}
    plan = PlanTraits.of(tenant.plan)
    current = resolve(CycleSpec.of(tenant), PlanTraits.from_json(record.get("before") or {}, plan))
    since = record.get("since")
    if "cycle" in record and tenant.cycle_changes_at is not None:
        following = resolve(CycleSpec.from_json(record, tenant.time_zone),
                            PlanTraits.from_json(record, plan))
        return CycleSchedule(current, following, _ms(tenant.cycle_changes_at), since)
    return CycleSchedule(current, since_ms=since)


def calendar_for(tenant: Tenant) -> Calendar:
    """The tenant's Calendar (shared per schedule)."""
    return calendar_of(schedule_for(tenant))


def time_zone_of(tenant: Tenant, at_ms: int | None = None) -> str:
    """The time zone of the tenant's days now (or at `at_ms`): its cycle's in force."""
    at = now_ms() if at_ms is None else at_ms
    return schedule_for(tenant).cycle_at(at)[0].zone


def current_windows(tenant: Tenant, at_ms: int | None = None) -> tuple[Span, Span]:
    """The tenant's day and cycle windows now (or at `at_ms`), as spans in their zone."""
    at = now_ms() if at_ms is None else at_ms
    cal = calendar_for(tenant)
    zone = cal.schedule.cycle_at(at)[0].zone
    return (Span.of(cal.window(WindowKind.DAY, at), zone),
            Span.of(cal.window(WindowKind.MONTH, at), zone))


def now_ms() -> int:
    """This process's estimate of the Redis clock (no round trip; quotas.windows.RedisClock)."""
    return get_engine().clock.now_ms()


def _redis_now_ms() -> int:
    """The Redis server's time, read (one round trip) for a change; the estimate while Redis
    cannot be reached (a change must not wait for it: the switch is a window's end anyway)."""
    engine = get_engine()
    try:
        seconds, micros = engine.client.time()
    except RedisError as exc:
        log.warning("Redis time unreadable (%s): the cycle change uses this host's estimate", exc)
        return engine.clock.now_ms()
    server_ms = int(seconds) * 1000 + int(micros) // 1000
    engine.clock.observe(server_ms)
    return server_ms


# -- past windows: the spans of earlier cycles ----------------------------------------------------


class Timeline:
    """A tenant's windows at any instant: the recorded spans of its past cycles
    (quotas.models.CyclePeriod), then its schedule. Built per use (reports, not the hot path)."""

    def __init__(self, tenant: Tenant, periods: Sequence[CyclePeriod] | None = None) -> None:
        self.tenant = tenant
        rows = list(periods) if periods is not None else list(
            CyclePeriod.objects.filter(tenant=tenant).order_by("ends_at"))
        self._spans = [(_ms(row.ends_at), Calendar(CycleSchedule(
            Cycle(CycleKind(row.kind), row.anchor, row.every_days, row.time_zone),
            switch_ms=_ms(row.ends_at),
            since_ms=_ms(row.starts_at) if row.starts_at is not None else None)))
            for row in rows]
        self.live = calendar_for(tenant)

    def calendar_at(self, at_ms: int) -> Calendar:
        for ends_ms, span in self._spans:
            if at_ms < ends_ms:
                return span
        return self.live

    def window(self, kind: WindowKind, at_ms: int) -> Window:
        return self.calendar_at(at_ms).window(kind, at_ms)

    def zone_at(self, at_ms: int) -> str:
        return self.calendar_at(at_ms).schedule.cycle_at(at_ms)[0].zone

    def zones(self) -> list[str]:
        found = [span.schedule.current.zone for _, span in self._spans]
        live = self.live.schedule
        found += [live.current.zone] + ([live.next.zone] if live.next is not None else [])
        return list(dict.fromkeys(found))


def timeline_for(tenant: Tenant) -> Timeline:
    return Timeline(tenant)


# -- describing a cycle ---------------------------------------------------------------------------


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_cycle(cycle: Cycle) -> str:
    """The cycle in words, e.g. "monthly from the 15th", "weekly from Monday", "daily"."""
    if cycle.kind is CycleKind.MONTHLY:
        day = cycle.anchor.day
        if day == 1:
            return "monthly (calendar month)"
        shorter = " (the last day of shorter months)" if day > 28 else ""
        return f"monthly from the {_ordinal(day)}{shorter}"
    if cycle.every_days == 1:
        return "daily"
    if cycle.every_days == 7:
        return f"weekly from {_WEEKDAYS[cycle.anchor.weekday()]}"
    return f"every {cycle.every_days} days from {cycle.anchor.isoformat()}"


@dataclass(frozen=True)
class Span:
    """A window as people read it: [start, end) in the time zone of its cycle."""

    id: str
    start: datetime  # aware, in `zone`
    end: datetime
    zone: str

    @classmethod
    def of(cls, window: Window, zone: str) -> Span:
        tz = ZoneInfo(zone)
        return cls(window.id, datetime.fromtimestamp(window.start_ms / 1000, tz),
                   datetime.fromtimestamp(window.end_ms / 1000, tz), zone)

    @property
    def label(self) -> str:
        """e.g. "2026-12-15 – 2027-01-14 (Europe/Paris)": the last day is the one before the
        end (a window ends at a midnight); a time is shown where it does not start or end at
        one (a window cut at a change)."""
        def point(moment: datetime) -> str:
            text = moment.strftime("%Y-%m-%d")
            return text if moment.time() == datetime.min.time() else f"{text} {moment:%H:%M}"
        last = self.end
        if last.time() == datetime.min.time():
            last = last - timedelta(days=1)
        first, final = point(self.start), point(last)
        span = first if first == final else f"{first} – {final}"
        return f"{span} ({self.zone})"


@dataclass(frozen=True)
class CycleStanding:
    """A tenant's cycle now, for the console, the API and the commands."""

    cycle: Cycle  # in force now
    description: str
    window: Span  # the current cycle window
    day: Span  # today, in the tenant's zone
    pending: Cycle | None  # the change waiting for the switch
    pending_description: str
    changes_at: datetime | None  # when it takes over (in the zone in force now)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cycle": self.description, "time_zone": self.cycle.zone,
            "window": {"id": self.window.id, "start": self.window.start.isoformat(),
                       "end": self.window.end.isoformat()},
            "day": {"id": self.day.id, "start": self.day.start.isoformat(),
                    "end": self.day.end.isoformat()},
            "pending": None if self.pending is None else {
                "cycle": self.pending_description, "time_zone": self.pending.zone,
                "changes_at": self.changes_at.isoformat() if self.changes_at else None},
        }


def cycle_standing(tenant: Tenant, at_ms: int | None = None) -> CycleStanding:
    at = now_ms() if at_ms is None else at_ms
    cal = calendar_for(tenant)
    schedule = cal.schedule
    cycle, _ = schedule.cycle_at(at)
    pending = None
    changes_at = None
    if schedule.next is not None and schedule.switch_ms is not None and at < schedule.switch_ms:
        pending = schedule.next
        changes_at = datetime.fromtimestamp(schedule.switch_ms / 1000, ZoneInfo(cycle.zone))
    return CycleStanding(
        cycle=cycle, description=describe_cycle(cycle),
        window=Span.of(cal.window(WindowKind.MONTH, at), cycle.zone),
        day=Span.of(cal.window(WindowKind.DAY, at), cycle.zone),
        pending=pending, pending_description=describe_cycle(pending) if pending else "",
        changes_at=changes_at)


# -- the windows a report may cover ---------------------------------------------------------------


def recent_cycle_windows(tenant: Tenant, count: int = 12, at_ms: int | None = None,
                         timeline: Timeline | None = None) -> list[Span]:
    """The tenant's cycle windows up to now, newest first (at most `count`; none that ended
    before the tenant was created)."""
    line = timeline or Timeline(tenant)
    at = now_ms() if at_ms is None else at_ms
    created_ms = _ms(tenant.created_at) if tenant.created_at else 0
    out: list[Span] = []
    window = line.window(WindowKind.MONTH, at)
    while len(out) < count:
        out.append(Span.of(window, line.zone_at(window.start_ms)))
        if window.start_ms <= created_ms:
            break
        window = line.window(WindowKind.MONTH, window.start_ms - 1)
    return out


def _month_span(text: str, line: Timeline) -> Span:
    try:
        moment = datetime.strptime(text, "%Y-%m")
    except ValueError:
        raise ValueError(f"a period is a month (YYYY-MM) or a cycle window id (m2026-12, "
                         f"c2026-12-15, c2026-12-15@1765843200), got {text!r}") from None
    year, month = moment.year, moment.month
    after = date(year + month // 12, month % 12 + 1, 1)
    middle = _ms(datetime(year, month, 15, tzinfo=UTC))
    zone = line.zone_at(middle)
    tz = ZoneInfo(zone)
    start = datetime(year, month, 1, tzinfo=tz)
    end = datetime(after.year, after.month, 1, tzinfo=tz)
    return Span(f"{year:04d}-{month:02d}", start, end, zone)


def _first_day(window_id: str) -> tuple[date, int | None]:
    base, _, switch = window_id.partition("@")
    try:
        if base.startswith("m"):
            first = datetime.strptime(base[1:], "%Y-%m").date()
        elif base.startswith("c"):
            first = datetime.strptime(base[1:], "%Y-%m-%d").date()
        else:
            raise ValueError(base)
        return first, int(switch) * 1000 if switch else None
    except ValueError:
        raise ValueError(f"not a cycle window id: {window_id!r}") from None


def report_span(tenant: Tenant, period: str, timeline: Timeline | None = None) -> Span:
    """What a report of `period` covers: a month "YYYY-MM" (the calendar month in the tenant's
    time zone of that month), or one of the tenant's cycle windows by id (as the counters name
    it: "m2026-12", "c2026-12-15", "c2026-12-15@1765843200" for the first window after a
    change). ValueError for anything else, or an id that is no window of this tenant's."""
    line = timeline or Timeline(tenant)
    if period[:1].isdigit():
        return _month_span(period, line)
    first, switch = _first_day(period)
    candidates = [switch] if switch is not None else [
        _ms(datetime(first.year, first.month, first.day, tzinfo=ZoneInfo(zone)))
        for zone in line.zones()]
    for at in candidates:
        window = line.window(WindowKind.MONTH, at)
        if window.id == period:
            return Span.of(window, line.zone_at(at))
    raise ValueError(f"{period!r} is not one of this tenant's cycle windows")


# -- changing a tenant's cycle --------------------------------------------------------------------


def check_cycle(spec: CycleSpec, plan: Plan) -> None:
    """ValidationError (per field: cycle, anchor, every_days, time_zone) for a cycle `plan` does
    not allow or that lacks what it needs. change_cycle checks again under its lock; forms call
    this to put the errors on their fields."""
    _check(spec, PlanTraits.of(plan), plan.display_name or plan.name)


def _check(spec: CycleSpec, traits: PlanTraits, plan_name: str) -> None:
    from tenants.validators import validate_time_zone  # noqa: PLC0415 - the models' own rule

    errors: dict[str, str] = {}
    if spec.cycle not in _CYCLES:
        errors["cycle"] = (f"Unknown cycle {spec.cycle!r}: one of monthly, weekly, days, or "
                           "empty for the plan's.")
    elif spec.cycle != PLAN and not traits.custom:
        errors["cycle"] = (f"The {plan_name} plan has no cycles of a tenant's own (its tenants "
                           f"reset {describe_cycle(resolve(spec.without_custom(), traits))}); "
                           "move the tenant to a plan that allows them (enterprise).")
    elif spec.cycle == PLAN:
        if spec.anchor is not None:
            errors["anchor"] = "The plan's cycle takes no anchor."
        if spec.every_days is not None:
            errors["every_days"] = "The plan's cycle takes no number of days."
    else:
        if spec.anchor is None:
            errors["anchor"] = {
                MONTHLY: "A monthly cycle needs its billing day: a date whose day of the month "
                         "starts each cycle (29, 30, 31: the last day of shorter months).",
                WEEKLY: "A weekly cycle needs an anchor: a date whose weekday starts each week.",
                DAYS: "An every-N-days cycle needs an anchor: the first day of one cycle.",
            }[spec.cycle]
        if spec.cycle == DAYS:
            if spec.every_days is None or not 1 <= spec.every_days <= 366:
                errors["every_days"] = "Every N days needs N from 1 to 366."
        elif spec.every_days is not None:
            errors["every_days"] = "Only an every-N-days cycle takes a number of days."
    try:
        validate_time_zone(spec.time_zone)
    except ValidationError as exc:
        errors["time_zone"] = " ".join(exc.messages)
    if errors:
        raise ValidationError(errors)


@dataclass(frozen=True)
class Rescheduled:
    """What a change does: the tenant's new field values, and what to tell."""

    fields: dict[str, Any]
    in_force: Cycle  # the cycle whose window was running when the change was asked for
    target: Cycle  # the cycle asked for
    changes_at: int | None  # the switch (ms), None when nothing is pending
    at_once: bool
    since: int | None  # when the cycle in force took over
    had_pending: bool  # a change was waiting for its switch (replaced or cancelled now)

    @property
    def changed(self) -> bool:
        return self.in_force != self.target

    @property
    def writes(self) -> bool:
        """Whether the tenant's fields change: a new cycle, or a pending change replaced or
        cancelled. Asking for the cycle in force with nothing pending changes nothing."""
        return self.changed or self.had_pending

    def audit(self) -> dict[str, Any]:
        return {
            "from": _cycle_json(self.in_force), "to": _cycle_json(self.target),
            "changes_at": (_moment(self.changes_at).isoformat(timespec="seconds")
                           if self.changes_at is not None else None),
            "at_once": self.at_once, "replaces_pending": self.had_pending,
        }


def _cycle_json(cycle: Cycle) -> dict[str, Any]:
    return {"cycle": describe_cycle(cycle), "time_zone": cycle.zone}


def _counted(tenant: Tenant, window: Window) -> bool:
    """Whether the tenant counted anything in this cycle window (its tenant counter exists; every
    call reserves it). Unknown (Redis down): counted, so the change waits for the window's end."""
    try:
        snapshot = get_engine().counter_at(
            keys.counter_key(keys.tenant_tag(tenant.pk), keys.tenant_scope(), window.id))
    except QuotaError:
        return True
    return snapshot.limit is not None


def reschedule(tenant: Tenant, spec: CycleSpec, traits: PlanTraits, at_ms: int) -> Rescheduled:
    """The fields that make `spec` under a plan of `traits` the tenant's cycle, by the change
    rule (module docstring). `tenant` is the locked row as stored (its plan the one in force)."""
    record = dict(tenant.next_cycle or {})
    plan = PlanTraits.of(tenant.plan)
    schedule = schedule_for(tenant)
    fields = CycleSpec.of(tenant)
    before = PlanTraits.from_json(record.get("before") or {}, plan)
    since = schedule.since_ms
    switch = None
    had_pending = False
    if schedule.next is not None and schedule.switch_ms is not None:
        if at_ms >= schedule.switch_ms:
            # The pending change is in force: fold it into the tenant's own fields.
            in_force = schedule.next
            fields = CycleSpec.from_json(record, tenant.time_zone)
            before = PlanTraits.from_json(record, plan)
            since = schedule.switch_ms
        else:
            in_force, switch, had_pending = schedule.current, schedule.switch_ms, True
    else:
        in_force = schedule.current
    target = resolve(spec, traits)
    at_once = False
    if target == in_force:
        # Nothing to wait for: the cycle asked for is the one running (a pending change is
        # cancelled). The fields say what was asked (they resolve to the same cycle).
        fields, switch, pins = spec, None, None
    else:
        if switch is None:
            running = Calendar(CycleSchedule(in_force, since_ms=since)).window(
                WindowKind.MONTH, at_ms)
            if _counted(tenant, running):
                switch = running.end_ms
            else:
                switch = (at_ms // 1000 + 1) * 1000  # the next whole second (ids name seconds)
                at_once = True
        # The cycle in force is read with the plan traits it had, if the tenant's fields under
        # the plan after the change would read otherwise (a plan change).
        pins = before if resolve(fields, traits) != in_force else None
    new_record: dict[str, Any] = {}
    if switch is not None:
        new_record.update(spec.to_json())
        if pins is not None:
            new_record["before"] = pins.to_json()
    if since is not None:
        new_record["since"] = since
    changes = {**fields.fields(), "next_cycle": new_record or None,
               "cycle_changes_at": _moment(switch) if switch is not None else None}
    return Rescheduled(changes, in_force, target, switch, at_once, since, had_pending)


def _record_spans(tenant: Tenant, done: Rescheduled, at_ms: int) -> None:
    """The span of the cycle in force ends at the switch: rewrite the spans still ahead."""
    CyclePeriod.objects.filter(tenant=tenant, ends_at__gt=_moment(at_ms)).delete()
    if done.changes_at is None:
        return
    cycle = done.in_force
    CyclePeriod.objects.create(
        tenant=tenant, kind=cycle.kind.value, anchor=cycle.anchor, every_days=cycle.every_days,
        time_zone=cycle.zone, starts_at=_moment(done.since) if done.since is not None else None,
        ends_at=_moment(done.changes_at))


def asked_spec(tenant: Tenant) -> CycleSpec:
    """What the tenant last asked for: the pending change if one is recorded, else its fields
    (what a change of one field keeps of the others)."""
    record = tenant.next_cycle or {}
    if "cycle" in record and tenant.cycle_changes_at is not None:
        return CycleSpec.from_json(record, tenant.time_zone)
    return CycleSpec.of(tenant)


def merged_spec(tenant: Tenant, *, cycle: str | None = None, anchor: date | None = None,
                every_days: int | None = None, time_zone: str | None = None,
                given: frozenset[str] = frozenset()) -> CycleSpec:
    """A change of some fields (`given` names the ones the caller set, None included): the
    others are what the tenant last asked for; a new kind of cycle starts without the old
    anchor and number of days (a monthly anchor means nothing to every N days)."""
    base = asked_spec(tenant)
    new_kind = "cycle" in given and cycle != base.cycle
    return CycleSpec(
        cycle if "cycle" in given and cycle is not None else base.cycle,
        anchor if "anchor" in given else (None if new_kind else base.anchor),
        every_days if "every_days" in given else (None if new_kind else base.every_days),
        time_zone if "time_zone" in given and time_zone else base.time_zone)


def describe_change(done: Rescheduled) -> str:
    """A change's outcome in words (the CLI, the API, the admin's message)."""
    target = f"{describe_cycle(done.target)} ({done.target.zone})"
    if not done.writes:
        return f"Nothing to change: the cycle is {target}."
    if done.changes_at is None:
        return f"The pending change is cancelled: the cycle stays {target}."
    when = _moment(done.changes_at).astimezone(ZoneInfo(done.in_force.zone))
    moment = f"{when:%Y-%m-%d %H:%M %Z}"
    if done.at_once:
        return (f"The cycle is {target} from {moment}: nothing was counted in the current "
                "window, so the change takes effect at once.")
    return (f"The cycle becomes {target} at {moment}, when the current window (on "
            f"{describe_cycle(done.in_force)}, {done.in_force.zone}) ends.")


def change_cycle(tenant: Tenant, *, cycle: str, anchor: date | None = None,
                 every_days: int | None = None, time_zone: str | None = None,
                 actor: str) -> Rescheduled:
    """Change a tenant's cycle and/or time zone (`time_zone` None keeps it): validated against
    its plan (ValidationError per field, nothing changed), scheduled by the change rule, audited
    (tenant.cycle_changed) and published to every gateway. The console, the API, the admin and
    `manage.py tenant_cycle` all call this."""
    from tenants.services.tenants import TENANT  # noqa: PLC0415 - the tenants' row lock
    from tenants.services._base import update  # noqa: PLC0415

    spec = CycleSpec(cycle, anchor, every_days, time_zone or tenant.time_zone)
    with transaction.atomic():
        locked = TENANT.lock(tenant)
        traits = PlanTraits.of(locked.plan)
        _check(spec, traits, locked.plan.display_name or locked.plan.name)
        at = _redis_now_ms()
        done = reschedule(locked, spec, traits, at)
        if done.writes:
            # One audit event and one invalidation: every gateway reloads the tenant's keys,
            # whose contexts carry its schedule (gateway/auth.py).
            update(TENANT, tenant, done.fields, actor=actor, action="tenant.cycle_changed",
                   data=lambda diff: done.audit())
            _record_spans(locked, done, at)
    return done


def plan_cycle_rule(tenant: Tenant, plan: Plan) -> dict[str, Any]:
    """The cycle fields a move of `tenant` (locked, on its old plan) to `plan` changes: the
    plan's cycle takes over by the change rule, like a change of cycle (a custom cycle is
    dropped by a plan that does not allow one). Installed into tenants.services.tenants by
    quotas.apps (tenants cannot import quotas)."""
    record = tenant.next_cycle or {}
    traits = PlanTraits.of(plan)
    spec = (CycleSpec.from_json(record, tenant.time_zone) if "cycle" in record
            and tenant.cycle_changes_at is not None else CycleSpec.of(tenant))
    if not traits.custom:
        spec = spec.without_custom()
    at = _redis_now_ms()
    done = reschedule(tenant, spec, traits, at)
    if not done.writes:
        return {}
    _record_spans(tenant, done, at)
    return done.fields
