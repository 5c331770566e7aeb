"""The ledger summed per day (billing.UsageRollup): kept by the drain, rebuilt from raw rows,
checked against them, and read by the reports, the usage API, the dashboard and /metrics; and
its tokens per UTC hour (billing.UsageHourly), kept and rebuilt the same way, read by the usage
forecasts (billing/forecast.py) and kept TOLLGATE_FORECAST_HISTORY_DAYS + 2 days
(`prune_hourly`).

Writing (the only writers of the ledger's rows and of the rollup; billing/ledger.py calls them
inside the drain's transaction):

- `insert_records(rows, zones)`: the batch COPYed to a staging table, then one statement
  (`_insert_sql`, prepared once per connection) whose INSERT ... ON CONFLICT DO NOTHING RETURNING
  (the unique request id) feeds the daily and hourly upserts: only the rows this transaction
  actually inserted are summed, by PostgreSQL, so a redelivered event (its request id already in
  the ledger, or inserted by a concurrent drain of the same stream, whose commit the insert
  waits for) is never counted twice.
- `move_corrected(before, after, zones)`: a swept row corrected by a late settle or release
  leaves its (status swept, corrected false) group and joins (its new status, corrected true,
  its new provider key) with the swept_* sums, on the same day (ended_at does not change).
- `add_to_rollups` (for corrections): the contributions summed in Python per group, then one INSERT
  ... ON CONFLICT ON CONSTRAINT usage_rollup_group DO UPDATE SET col = col + EXCLUDED.col, groups in
  a stable (sorted) order, so two drains upserting overlapping groups lock them in the same order
  and cannot deadlock each other. The hourly sums (tenant, UTC hour, project, key: requests and
  input + output tokens) are upserted the same way by a data-modifying CTE of that same statement:
  the hourly table costs the drain no round trip. A correction's token delta goes to the hour the
  row ended in (ended_at does not change).

Which rows a usage row is summed into: its UTC day (zone "UTC") and its local day in the zone
the tenant's days were in when the call ended (`Zones`: quotas.cycles' schedule, or its
Timeline for an instant before the cycle in force took over); one row when that zone is "UTC".
That zone is a function of the row and the tenant's recorded cycle history, so the drain,
`rebuild` and the readers (`whole_days`) agree on it whenever they run.

Reading: `whole_days(tenant, zone, start, end)` splits [start, end) into the local days of
`zone` that the rollup holds whole (every instant of the day had `zone` as the tenant's zone)
and the rest (a window cut mid-day at a change of cycle, a day before or over a change of time
zone), which is read from raw rows. `sums(...)` combines both, grouped by any of the columns the
two models share.

Checking and repairing: `verify(start, end)` compares the UTC rollups with the raw rows' sums
(before a raw month is dropped); `rebuild(...)` (`manage.py rollup_rebuild`) recomputes the
rollups of a range from the raw rows (for rows drained before the rollup existed).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.conf import settings
from django.db import DataError, ProgrammingError, connection, transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone as dj_timezone

from billing.models import UsageHourly, UsageRecord, UsageRollup
from quotas.cycles import Timeline, schedule_for
from quotas.models import CyclePeriod
from quotas.windows import CycleSchedule
from tenants.models import Tenant

UTC_ZONE = "UTC"
GROUP_FIELDS: tuple[str, ...] = UsageRollup.GROUP_FIELDS
SUM_FIELDS: tuple[str, ...] = UsageRollup.SUM_FIELDS
_RAW_TABLE = UsageRecord._meta.db_table
_ROLLUP_TABLE = UsageRollup._meta.db_table
_GROUP_COLUMNS = ("tenant_id", "zone", "day", "project_id", "api_key_id", "provider_key_id",
                  "model", "served_model", "status", "corrected")
_GROUP_TYPES = ("bigint", "text", "date", "bigint", "bigint", "bigint", "text", "text", "text",
                "boolean")

Group = tuple[Any, ...]  # values of _GROUP_COLUMNS
Sums = list[int]  # values of SUM_FIELDS
_HOURLY_TABLE = UsageHourly._meta.db_table
_HOURLY_COLUMNS = ("tenant_id", "hour", "project_id", "api_key_id")
_HOURLY_TYPES = ("bigint", "timestamptz", "bigint", "bigint")
HOURLY_SUMS: tuple[str, ...] = UsageHourly.SUM_FIELDS  # requests, tokens (input + output)
HourGroup = tuple[Any, ...]  # values of _HOURLY_COLUMNS


@dataclass
class Totals:
    """A batch's deltas: per daily rollup group (SUM_FIELDS order) and per hourly group
    (HOURLY_SUMS order)."""

    days: dict[Group, Sums] = dataclasses.field(default_factory=dict)
    hours: dict[HourGroup, Sums] = dataclasses.field(default_factory=dict)


# -- the zone of a row ----------------------------------------------------------------------------


class Zones:
    """The zone the tenant's days were in at an instant (ms), per tenant: its schedule (current
    cycle, pending change) when that is its whole history or the instant is after its cycle in
    force took over; else its Timeline (its recorded past cycles: one more query, loaded once)."""

    def __init__(self) -> None:
        self._schedules: dict[int, CycleSchedule] = {}
        self._tenants: dict[int, Tenant] = {}
        self._timelines: dict[int, Timeline] = {}

    def add(self, tenant: Tenant) -> None:
        """A tenant already loaded (with its plan) by the caller."""
        self._tenants.setdefault(tenant.pk, tenant)

    def add_schedule(self, tenant_id: int, schedule: CycleSchedule) -> None:
        """The tenant's schedule, already loaded by the caller (the drain's calendar)."""
        self._schedules.setdefault(tenant_id, schedule)

    def _tenant(self, tenant_id: int) -> Tenant:
        if tenant_id not in self._tenants:
            self._tenants[tenant_id] = Tenant.objects.select_related("plan").get(pk=tenant_id)
        return self._tenants[tenant_id]

    def at(self, tenant_id: int, at_ms: int) -> str:
        schedule = self._schedules.get(tenant_id)
        if schedule is None:
            schedule = self._schedules[tenant_id] = schedule_for(self._tenant(tenant_id))
        since = schedule.since_ms
        # No change ever folded and none pending: the cycle in force is the whole history.
        # After `since` the schedule is the history too (Timeline's recorded spans end there).
        if (since is None and schedule.next is None) or (since is not None and at_ms >= since):
            return schedule.cycle_at(at_ms)[0].zone
        tenant = self._tenant(tenant_id)
        if tenant_id not in self._timelines:
            self._timelines[tenant_id] = Timeline(tenant)
        return self._timelines[tenant_id].zone_at(at_ms)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


# -- writing: what the drain calls ----------------------------------------------------------------


def _contribution(row: Row) -> Sums:
    """What one ledger row adds to its group (SUM_FIELDS order)."""
    over = row.over_hold_tokens or 0
    return [1, row.input_tokens, row.output_tokens, row.cached_input_tokens,
            row.cache_write_tokens, row.reasoning_tokens, row.cost_micros, over,
            1 if over > 0 else 0, row.swept_input_tokens or 0, row.swept_output_tokens or 0,
            row.swept_cost_micros or 0]


def _groups_of(row: Row, zone: str) -> list[Group]:
    """The row's group on its UTC day and on its local day in `zone` (one when zone is UTC)."""
    base = (row.project_id, row.api_key_id, row.provider_key_id, row.model, row.served_model,
            str(row.status), row.corrected_at is not None)
    ended = row.ended_at
    out = [(row.tenant_id, UTC_ZONE, ended.astimezone(UTC).date(), *base)]
    if zone != UTC_ZONE:
        out.append((row.tenant_id, zone, ended.astimezone(ZoneInfo(zone)).date(), *base))
    return out


def hour_of(moment: datetime) -> datetime:
    """The start of the UTC hour `moment` falls in (a UsageHourly row's `hour`)."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _add(totals: Totals, row: Row, zone: str, sign: int = 1) -> None:
    values = _contribution(row)
    if sign != 1:
        values = [sign * value for value in values]
    days = totals.days
    for group in _groups_of(row, zone):
        current = days.get(group)
        # A new list each time (map: the sums in C, per row of a batch): the lists in `days`
        # are never changed in place, so one `values` may stand for both of the row's groups.
        days[group] = values if current is None else list(map(operator.add, current, values))
    hour = (row.tenant_id, hour_of(row.ended_at), row.project_id, row.api_key_id)
    hourly = totals.hours.get(hour)
    tokens = sign * (row.input_tokens + row.output_tokens)
    totals.hours[hour] = [sign, tokens] if hourly is None else [hourly[0] + sign,
                                                                  hourly[1] + tokens]


def _sort_key(group: Group) -> tuple[Any, ...]:
    return tuple((value is None, value if value is not None else 0) for value in group)


def _upsert(table: str, constraint: str, group_columns: Sequence[str],
            group_types: Sequence[str], sum_columns: Sequence[str],
            deltas: dict[tuple[Any, ...], Sums]) -> tuple[str, list[Any]] | None:
    """The INSERT ... ON CONFLICT adding these per-group deltas, groups in a stable order, and
    its parameters (one array per column); None when every delta is zero."""
    items = sorted(((g, s) for g, s in deltas.items() if any(s)), key=lambda i: _sort_key(i[0]))
    if not items:
        return None
    columns = [list(col) for col in zip(*(g for g, _ in items), strict=True)]
    sums = [list(col) for col in zip(*(s for _, s in items), strict=True)]
    arrays = ", ".join([f"%s::{t}[]" for t in group_types] + ["%s::bigint[]"] * len(sum_columns))
    names = ", ".join((*group_columns, *sum_columns))
    updates = ", ".join(f"{c} = {table}.{c} + EXCLUDED.{c}" for c in sum_columns)
    # The rows are inserted in unnest's order (the sorted one): row locks are taken in it.
    return (f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays}) "
            f"ON CONFLICT ON CONSTRAINT {constraint} DO UPDATE SET {updates}",
            [*columns, *sums])


def add_to_rollups(totals: Totals) -> None:
    """Upsert these deltas into the daily rollup and the hourly table in ONE statement (the
    hourly upsert a data-modifying CTE of the daily one: no round trip more for the drain),
    each in a stable group order. Every statement of this shape takes its locks in the same
    order (PostgreSQL runs an unreferenced data-modifying CTE after the main statement)."""
    daily = _upsert(_ROLLUP_TABLE, "usage_rollup_group", _GROUP_COLUMNS, _GROUP_TYPES,
                    SUM_FIELDS, totals.days)
    hourly = _upsert(_HOURLY_TABLE, "usage_hourly_group", _HOURLY_COLUMNS, _HOURLY_TYPES,
                     HOURLY_SUMS, totals.hours)
    if daily is None and hourly is None:
        return
    if daily is None or hourly is None:
        sql, params = daily or hourly  # type: ignore[misc]
    else:
        sql, params = f"WITH hourly AS ({hourly[0]}) {daily[0]}", [*hourly[1], *daily[1]]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


ZoneOf = Callable[[int, int], str]  # (tenant id, instant in ms) -> zone name


def _fields() -> list[Any]:
    return [f for f in UsageRecord._meta.concrete_fields if not f.primary_key]


_ATTNAMES: tuple[str, ...] = tuple(f.attname for f in _fields())


class _RowMethods:
    __slots__ = ()
    id: int | None

    @property
    def pk(self) -> int | None:
        return self.id

    @pk.setter
    def pk(self, value: int | None) -> None:
        self.id = value

    def values(self) -> dict[str, Any]:
        """The columns' values by attname (to build a UsageRecord)."""
        return {name: getattr(self, name) for name in _ATTNAMES}


# A ledger row's values before the insert, without a Django model instance: the drain builds
# one per usage event, and constructing a UsageRecord (signals, field descriptors, defaults)
# was about 40 % of its CPU per event. Its attributes are UsageRecord's (attnames with their
# defaults; recorded_at None until the insert; `id`/`pk` once inserted), so the insert, the
# rollup and the corrections read either. A generated dataclass: its __init__ is plain
# assignments.
LedgerRow = dataclasses.make_dataclass(
    "LedgerRow",
    [("id", int | None, dataclasses.field(default=None))]
    + [(f.attname, Any, dataclasses.field(
        default=None if f.attname == "recorded_at" else f.get_default())) for f in _fields()],
    bases=(_RowMethods,), slots=True)
LedgerRow.__module__ = __name__
Row = UsageRecord | LedgerRow


@functools.cache
def _stage_name() -> str:
    """The staging table's name, after the ledger's columns and types: a temporary table lives
    as long as its connection (under PgBouncer, a pooled server connection), so after a
    migration that changes the columns a connection opened before it gets a table of the new
    shape instead of COPYing into the old one (which stays behind, empty, until it closes).
    Computed once per process: the columns are the code's."""
    shape = ",".join([f"{f.column} {'bigint' if _widened(f) else f.db_type(connection)}"
                      for f in _fields()] + [f"{_ZONE_COLUMN} text"])
    return "usage_drain_stage_" + hashlib.sha256(shape.encode()).hexdigest()[:12]


# The references a row may hold to something deleted since the call (a project, a key, a
# provider key): the insert sets them to NULL rather than fail the whole batch.
_NULLABLE_REFERENCES = ("project_id", "api_key_id", "provider_key_id")


# The staging table's one column more than the ledger's: the zone of the row's local day
# (Zones.at, computed in Python: it depends on the tenant's recorded cycle history).
_ZONE_COLUMN = "rollup_zone"
# The rollup's group columns as the statement below orders them: the order of `_sort_key` (None
# last, text by code point: COLLATE "C"), the one every upsert of the rollup takes its row locks
# in, so two drains (or a drain and a correction) never deadlock on them.
_DAILY_ORDER = ", ".join(
    f"{c} NULLS LAST" if c.endswith("_id") and c != "tenant_id"
    else f'{c} COLLATE "C"' if t == "text" else c
    for c, t in zip(_GROUP_COLUMNS, _GROUP_TYPES, strict=True))
_HOURLY_ORDER = "tenant_id, hour, project_id NULLS LAST, api_key_id NULLS LAST"


@functools.cache
def _insert_sql() -> str:
    """The drain's one statement per batch: the staged rows inserted into the ledger (skipping
    request ids already there) and only the rows inserted summed into the daily rollup (each
    row on its UTC day and, when its zone is another, its local day) and the hourly table, by
    PostgreSQL (the aggregates of `verify` and `rebuild`, `_RAW_AGGREGATES`), groups in the
    order every rollup upsert uses. Returns the number of rows inserted."""
    fields = _fields()
    columns = ", ".join(f.column for f in fields)
    selected = []
    for f in fields:
        if f.attname in _NULLABLE_REFERENCES:
            target = f.related_model._meta
            selected.append(f"(SELECT r.{target.pk.column} FROM {target.db_table} r "
                            f"WHERE r.{target.pk.column} = x.{f.column})")
        else:
            selected.append(f"x.{f.column}")
    groups = ", ".join(_GROUP_COLUMNS)
    sums = ", ".join(SUM_FIELDS)
    day_rows = ("tenant_id, {zone} AS zone, (ended_at AT TIME ZONE {zone})::date AS day, "
                "project_id, api_key_id, provider_key_id, model, served_model, status, "
                "corrected_at IS NOT NULL AS corrected, input_tokens, output_tokens, "
                "cached_input_tokens, cache_write_tokens, reasoning_tokens, cost_micros, "
                "over_hold_tokens, swept_input_tokens, swept_output_tokens, swept_cost_micros")
    daily_updates = ", ".join(f"{c} = {_ROLLUP_TABLE}.{c} + EXCLUDED.{c}" for c in SUM_FIELDS)
    hourly_updates = ", ".join(f"{c} = {_HOURLY_TABLE}.{c} + EXCLUDED.{c}" for c in HOURLY_SUMS)
    # The staged rows are deleted by the statement that reads them (a second insert in the same
    # transaction, the corrections', stages its own; the commit empties the table anyway).
    # The ledger is partitioned by month (billing/partitions.py): its dedupe key is
    # (request_id, ended_at), which a redelivered event hits (it carries the same ended_at), so
    # the conflict needs no target. A swept row and its correction end at different times: either
    # is inserted only while no row has its request id (the other one came first), a lookup by
    # the dedupe key that only these rare rows pay. The rollup upsert is the main statement and
    # the hourly one a data-modifying CTE that nothing reads, as in add_to_rollups: every
    # statement of the rollups takes its locks daily first, then hourly.
    return (
        f"WITH staged AS (DELETE FROM {_stage_name()} RETURNING *), "
        f"ins AS (INSERT INTO {_RAW_TABLE} ({columns}) SELECT {', '.join(selected)} "
        f"FROM staged AS x WHERE (x.status <> 'swept' AND x.corrected_at IS NULL) "
        f"OR NOT EXISTS (SELECT 1 FROM {_RAW_TABLE} u WHERE u.request_id = x.request_id) "
        f"ON CONFLICT DO NOTHING RETURNING *), "
        f"hourly AS (INSERT INTO {_HOURLY_TABLE} ({', '.join((*_HOURLY_COLUMNS, *HOURLY_SUMS))}) "
        f"SELECT tenant_id, date_trunc('hour', ended_at, 'UTC') AS hour, project_id, api_key_id, "
        f"count(*), coalesce(sum(input_tokens + output_tokens), 0) FROM ins "
        f"GROUP BY 1, 2, 3, 4 ORDER BY {_HOURLY_ORDER} "
        f"ON CONFLICT ON CONSTRAINT usage_hourly_group DO UPDATE SET {hourly_updates}), "
        f"zoned AS (SELECT ins.*, s.{_ZONE_COLUMN} FROM ins JOIN staged s USING (request_id) "
        f"WHERE s.{_ZONE_COLUMN} <> {UTC_ZONE!r}), "
        f"days AS (SELECT {day_rows.format(zone=repr(UTC_ZONE))} FROM ins "
        f"UNION ALL SELECT {day_rows.format(zone=_ZONE_COLUMN)} FROM zoned) "
        f"INSERT INTO {_ROLLUP_TABLE} ({groups}, {sums}) SELECT {groups}, {_RAW_AGGREGATES} "
        f"FROM days GROUP BY {groups} ORDER BY {_DAILY_ORDER} "
        f"ON CONFLICT ON CONSTRAINT usage_rollup_group DO UPDATE SET {daily_updates} "
        # The rows inserted (on every rollup row the statement wrote; none when it wrote none).
        f"RETURNING (SELECT count(*) FROM ins)")


@functools.cache
def _stage_sql() -> tuple[str, str]:
    """(create the staging table if this connection has none, COPY into it)."""
    columns = ", ".join(f.column for f in _fields())
    staged = ", ".join(f"{f.column}::bigint AS {f.column}" if _widened(f) else f.column
                       for f in _fields())
    stage = _stage_name()
    return (f"CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
            f"SELECT {staged}, ''::text AS {_ZONE_COLUMN} FROM {_RAW_TABLE} WITH NO DATA",
            f"COPY {stage} ({columns}, {_ZONE_COLUMN}) FROM STDIN (FORMAT BINARY)")


# Staged as bigint, the ledger's narrower integer columns (http_status smallint, latency_ms
# integer): psycopg's binary int2 / int4 dumpers wrap a value out of their range (70000 becomes
# 4464) where text would have been refused, so the value goes as int8 and the INSERT's
# assignment to the ledger's column checks its range (a DataError: the batch is refused).
_NARROW_INTEGERS = ("smallint", "integer")


def _widened(field: Any) -> bool:
    return field.db_type(connection) in _NARROW_INTEGERS


@functools.cache
def _stage_types() -> list[str]:
    """The staging columns' PostgreSQL types (varchar, int8, timestamptz...) for the binary
    COPY: each value goes as its binary form, no text to format here or to parse there (about
    7 -> 2 us of the drain's CPU per row, and a faster COPY in PostgreSQL). Lengths
    (varchar(128)) are still checked by the column, and ranges by the INSERT (_NARROW_INTEGERS):
    a value too long or too large is a DataError as with text."""
    return ["int8" if _widened(f) else f.db_type(connection).split("(", 1)[0].strip()
            for f in _fields()] + ["text"]


_row_values = operator.attrgetter(*_ATTNAMES)

# The sessions (psycopg connections) where the drain's statement is prepared (PREPARE is the
# session's, kept across transactions and rollbacks; a new connection prepares it again).
_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _execute_insert(cursor: Any) -> None:
    """Run the drain's statement (_insert_sql), prepared once per connection: PostgreSQL planned
    it in about 6 ms per batch (a partitioned ledger, five CTEs), as much as the insert of 500
    rows itself; prepared, the plan is kept (it has no parameters). Not behind PgBouncer in
    transaction mode (DATABASE_PGBOUNCER), whose next transaction may run on another server
    connection, where the statement was never prepared: there it is planned every time."""
    sql = _insert_sql()
    if settings.DATABASE_PGBOUNCER:
        cursor.execute(sql)
        return
    raw = connection.connection
    # Named after this process and connection too: a server session that already holds one
    # (PgBouncer in session mode without a reset query hands a session on) cannot collide.
    name = f"{_stage_name()}_{os.getpid()}_{id(raw) % 10**9}"
    prepared = _PREPARED.setdefault(raw, set())
    if name not in prepared:
        cursor.execute(f"PREPARE {name} AS {sql}")
        prepared.add(name)
    try:
        cursor.execute(f"EXECUTE {name}")
    except ProgrammingError:
        # The session lost it (DISCARD ALL, DEALLOCATE): this batch fails (its events stay in
        # Redis) and the next transaction prepares it again.
        prepared.discard(name)
        raise


def _stage(cursor: Any, batch: Sequence[Row], zone_of: ZoneOf) -> None:
    """The batch COPYed (binary, psycopg's C dumpers) into this connection's staging table: a
    temporary table emptied at every commit, created on first use (checked per transaction:
    under PgBouncer the next transaction may run on another server connection). Binding the
    batch as query parameters instead made psycopg quote every value in Python (half the
    drain's time)."""
    create, copy_sql = _stage_sql()
    cursor.execute(create)
    raw = cursor.cursor  # Django's wrapper has no copy(); psycopg's cursor does
    # Django's exceptions for psycopg's (a value the column refuses is a django.db.DataError,
    # as from any other statement: the drain tells such a batch from PostgreSQL being down).
    # The zones first: finding one may query the tenant (Zones), which must not happen on this
    # connection while its COPY runs.
    zones = [zone_of(row.tenant_id, _ms(row.ended_at)) for row in batch]
    try:
        with connection.wrap_database_errors, raw.copy(copy_sql) as copy:
            copy.set_types(_stage_types())
            for row, zone in zip(batch, zones, strict=True):
                copy.write_row((*_row_values(row), zone))
    except OverflowError as exc:
        # An integer beyond bigint (psycopg refuses to dump it): a value the ledger refuses.
        raise DataError(f"a value out of range in the batch: {exc}") from exc


def insert_records(rows: Sequence[Row], zone_of: ZoneOf | None = None, *,
                   returning: bool = False) -> int:
    """Insert these ledger rows (UsageRecord or LedgerRow: COPY to a staging table, then one
    statement), skipping request ids already in the ledger, and add the inserted ones to the
    daily rollup and the hourly table in that same statement; returns how many were inserted.
    Call inside a transaction (the drain's): rows and rollups commit together, and no savepoint
    is taken (an error fails the caller's transaction, which is what the drain wants). `zone_of`
    gives the tenant's zone at an instant (default: a `Zones` of this call). With `returning`
    (tests and fixtures that want the rows as stored), the inserted rows get their ids and the
    references the insert kept (a project, key or provider key deleted since the call is None):
    one SELECT more.

    Statements: CREATE TEMP TABLE IF NOT EXISTS, COPY, the insert with its rollups."""
    unique: dict[str, Row] = {}
    for row in rows:
        unique.setdefault(row.request_id, row)  # a duplicate within the batch: the same event
    if not unique:
        return 0
    zone_of = zone_of or Zones().at
    now = dj_timezone.now()
    batch = list(unique.values())
    for row in batch:
        if row.recorded_at is None:
            row.recorded_at = now  # auto_now_add, which a raw INSERT does not apply
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        _stage(cursor, batch, zone_of)
        _execute_insert(cursor)
        written = cursor.fetchone()
        inserted = int(written[0]) if written else 0
        if returning:
            cursor.execute(f"SELECT request_id, id, {', '.join(_NULLABLE_REFERENCES)} "
                           f"FROM {_RAW_TABLE} WHERE request_id = ANY(%s)", [list(unique)])
            for request_id, pk, *references in cursor.fetchall():
                row = unique[request_id]
                row.pk, (row.project_id, row.api_key_id, row.provider_key_id) = pk, references
                if isinstance(row, UsageRecord):
                    row._state.adding, row._state.db = False, "default"
    return inserted


def move_corrected(pairs: Iterable[tuple[Row, Row]],
                   zone_of: ZoneOf | None = None) -> None:
    """Move corrected rows in the rollup: each (row before, row after) its correction, in the
    correction's transaction. Both have the same ended_at (so the same days, and the same UTC
    hour: the hourly table gets the tokens' delta there, requests unchanged)."""
    zone_of = zone_of or Zones().at
    totals = Totals()
    for before, after in pairs:
        zone = zone_of(before.tenant_id, _ms(before.ended_at))
        _add(totals, before, zone, -1)
        _add(totals, after, zone, +1)
    add_to_rollups(totals)


# -- reading --------------------------------------------------------------------------------------


def day_start(day: date, zone: ZoneInfo) -> datetime:
    return datetime.combine(day, time.min, tzinfo=zone)


def _zone_changes(tenant: Tenant) -> list[int]:
    """Instants (ms) where the tenant's cycle may have changed (its zone with it)."""
    if not tenant.next_cycle:
        return []
    found = {_ms(p.ends_at) for p in CyclePeriod.objects.filter(tenant=tenant)}
    schedule = schedule_for(tenant)
    if schedule.switch_ms is not None:
        found.add(schedule.switch_ms)
    if schedule.since_ms is not None:
        found.add(schedule.since_ms)
    return sorted(found)


@dataclass(frozen=True)
class DayPlan:
    """[start, end) split into local days of `zone` read from the rollup and raw intervals."""

    zone: str
    days: list[date]  # whole days the rollup of `zone` holds
    raw: list[tuple[datetime, datetime]]  # the rest, read from UsageRecord


def whole_days(tenant: Tenant, zone: str, start: datetime, end: datetime) -> DayPlan:
    """Split [start, end) into `zone`'s local days the rollup holds whole and raw intervals:
    a day is read from the rollup when it lies whole in [start, end) and the tenant's days were
    in `zone` through all of it (UTC: always, every row has its UTC rollup)."""
    tz = ZoneInfo(zone)
    changes = [] if zone == UTC_ZONE else _zone_changes(tenant)
    zones = Zones()
    zones.add(tenant)
    days: list[date] = []
    raw: list[tuple[datetime, datetime]] = []
    day = start.astimezone(tz).date()
    while True:
        day_from, day_to = day_start(day, tz), day_start(day + timedelta(days=1), tz)
        if day_from >= end:
            break
        lo, hi = max(day_from, start), min(day_to, end)
        whole = lo == day_from and hi == day_to
        if whole and zone != UTC_ZONE:
            # Also for a tenant that never changed: `zone` may not be its zone at all.
            a, b = _ms(day_from), _ms(day_to)
            points = [a, *(c for c in changes if a < c < b), b - 1]
            whole = all(zones.at(tenant.pk, p) == zone for p in points)
        if whole:
            days.append(day)
        elif lo < hi:
            if raw and raw[-1][1] == lo:
                raw[-1] = (raw[-1][0], hi)
            else:
                raw.append((lo, hi))
        day += timedelta(days=1)
    return DayPlan(zone, days, raw)


# Aggregations of the same name over raw rows and over rollup rows: requests, the token sums,
# cost, and the sweep's figures (rows still swept, corrected rows, what the sweep had charged
# them, their cost now).
_CORRECTED_RAW = Q(corrected_at__isnull=False)
RAW_SUMS: dict[str, Any] = {
    "requests": Count("id"), "input_tokens": Sum("input_tokens"),
    "output_tokens": Sum("output_tokens"), "cached_input_tokens": Sum("cached_input_tokens"),
    "cache_write_tokens": Sum("cache_write_tokens"), "reasoning_tokens": Sum("reasoning_tokens"),
    "cost_micros": Sum("cost_micros"),
    "swept": Count("id", filter=Q(status=UsageRecord.Status.SWEPT)),
    "corrected": Count("id", filter=_CORRECTED_RAW),
    "sweep_charged": Coalesce(Sum("swept_cost_micros", filter=_CORRECTED_RAW), 0),
    "corrected_cost": Coalesce(Sum("cost_micros", filter=_CORRECTED_RAW), 0),
}
_CORRECTED_ROLLUP = Q(corrected=True)
ROLLUP_SUMS: dict[str, Any] = {
    "requests": Sum("requests"), "input_tokens": Sum("input_tokens"),
    "output_tokens": Sum("output_tokens"), "cached_input_tokens": Sum("cached_input_tokens"),
    "cache_write_tokens": Sum("cache_write_tokens"), "reasoning_tokens": Sum("reasoning_tokens"),
    "cost_micros": Sum("cost_micros"),
    "swept": Coalesce(Sum("requests", filter=Q(status=UsageRecord.Status.SWEPT)), 0),
    "corrected": Coalesce(Sum("requests", filter=_CORRECTED_ROLLUP), 0),
    "sweep_charged": Coalesce(Sum("swept_cost_micros", filter=_CORRECTED_ROLLUP), 0),
    "corrected_cost": Coalesce(Sum("cost_micros", filter=_CORRECTED_ROLLUP), 0),
}
SUMMED = tuple(RAW_SUMS)


def _aliased(aggregates: dict[str, Any]) -> dict[str, Any]:
    """Aliases apart from the columns' names (an alias named like a column would be what a
    later aggregate of that column reads)."""
    return {f"sum_{name}": value for name, value in aggregates.items()}


def _raw_rows(plan: DayPlan, filters: Q) -> QuerySet[UsageRecord] | None:
    if not plan.raw:
        return None
    spans = Q()
    for lo, hi in plan.raw:
        spans |= Q(ended_at__gte=lo, ended_at__lt=hi)
    return (UsageRecord.objects.filter(filters).filter(spans)
            .annotate(day=TruncDate("ended_at", tzinfo=ZoneInfo(plan.zone))))


def sums(plan: DayPlan, fields: Sequence[str], filters: Q = Q()) -> list[dict[str, Any]]:
    """Sums (SUMMED) per group of `fields` (names both models resolve: "day", "served_model",
    "project__slug", "api_key__public_id", "tenant__slug"...) over the plan's rollup days and raw
    intervals; `filters` (fields both models have) narrow both. Sorted by
    `fields` (None last), integers (0 for nothing)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    parts: list[QuerySet[Any]] = []
    if plan.days:
        parts.append(UsageRollup.objects.filter(filters)
                     .filter(zone=plan.zone, day__in=plan.days)
                     .values(*fields).annotate(**_aliased(ROLLUP_SUMS)).order_by())
    raw = _raw_rows(plan, filters)
    if raw is not None:
        parts.append(raw.values(*fields).annotate(**_aliased(RAW_SUMS)).order_by())
    for part in parts:
        for row in part:
            key = tuple(row[f] for f in fields)
            into = merged.setdefault(key, {**{f: row[f] for f in fields},
                                           **dict.fromkeys(SUMMED, 0)})
            for name in SUMMED:
                into[name] += int(row[f"sum_{name}"] or 0)
    return [merged[k] for k in sorted(merged, key=_sort_key) if merged[k]["requests"]]


# -- checking: the UTC rollup against raw rows ----------------------------------------------------


_VERIFY_GROUP = ("tenant_id", "day", "model", "served_model", "status", "corrected")


@dataclass(frozen=True)
class Mismatch:
    """A (tenant, UTC day, model, served model, status, corrected) group whose UTC rollup sum
    differs from its raw rows' (field: a SUM_FIELDS name)."""

    tenant_id: int
    day: date
    model: str
    served_model: str
    status: str
    corrected: bool
    field: str
    rollup: int
    raw: int


def _raw_utc_sums(start: date, end: date, tenant_id: int | None) -> dict[Group, Sums]:
    where = "ended_at >= %s AND ended_at < %s"
    params: list[Any] = [day_start(start, ZoneInfo(UTC_ZONE)), day_start(end, ZoneInfo(UTC_ZONE))]
    if tenant_id is not None:
        where += " AND tenant_id = %s"
        params.append(tenant_id)
    sql = (f"SELECT tenant_id, (ended_at AT TIME ZONE 'UTC')::date, model, served_model, status, "
           f"corrected_at IS NOT NULL, {_RAW_AGGREGATES} FROM {_RAW_TABLE} WHERE {where} "
           f"GROUP BY 1, 2, 3, 4, 5, 6")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {tuple(r[:6]): [int(v) for v in r[6:]] for r in cursor.fetchall()}


# The raw aggregates in SUM_FIELDS order.
_RAW_AGGREGATES = ", ".join([
    "count(*)", "coalesce(sum(input_tokens), 0)", "coalesce(sum(output_tokens), 0)",
    "coalesce(sum(cached_input_tokens), 0)", "coalesce(sum(cache_write_tokens), 0)",
    "coalesce(sum(reasoning_tokens), 0)", "coalesce(sum(cost_micros), 0)",
    "coalesce(sum(over_hold_tokens), 0)", "count(*) FILTER (WHERE over_hold_tokens > 0)",
    "coalesce(sum(swept_input_tokens), 0)", "coalesce(sum(swept_output_tokens), 0)",
    "coalesce(sum(swept_cost_micros), 0)"])


def verify(start: date, end: date, *, tenant_id: int | None = None) -> list[Mismatch]:
    """The UTC rollups of UTC days [start, end) against the raw rows that ended on those days:
    every (tenant, day, model, served model, status, corrected) group and every sum
    (UsageRollup.SUM_FIELDS), to the unit (micro-dollars for cost). Returns the mismatches;
    an empty list means the rollups may stand in for the raw rows of those days (the check to
    make before dropping them). Projects, keys and provider keys are not compared: deleting
    one sets the raw rows' reference to NULL while the rollup keeps its id.

    Scans the raw rows of the range (one grouped query) and the rollup's UTC rows."""
    raw = _raw_utc_sums(start, end, tenant_id)
    rollups = UsageRollup.objects.filter(zone=UTC_ZONE, day__gte=start, day__lt=end)
    if tenant_id is not None:
        rollups = rollups.filter(tenant_id=tenant_id)
    ours: dict[Group, Sums] = {}
    for row in (rollups.values(*_VERIFY_GROUP).annotate(**{f"s_{f}": Sum(f) for f in SUM_FIELDS})
                .order_by()):
        ours[tuple(row[f] for f in _VERIFY_GROUP)] = [int(row[f"s_{f}"]) for f in SUM_FIELDS]
    zero = [0] * len(SUM_FIELDS)
    out: list[Mismatch] = []
    for group in sorted(set(raw) | set(ours), key=_sort_key):
        theirs, mine = raw.get(group, zero), ours.get(group, zero)
        for name, r, m in zip(SUM_FIELDS, theirs, mine, strict=True):
            if r != m:
                out.append(Mismatch(group[0], group[1], group[2], group[3], group[4],
                                    bool(group[5]), name, m, r))
    return out


# -- rebuilding from raw rows ---------------------------------------------------------------------


class RawRowsMissing(Exception):
    """A day has rollups but no raw rows left (dropped): rebuilding would erase it."""


def _zone_intervals(tenant: Tenant, start: datetime,
                    end: datetime) -> list[tuple[datetime, datetime, str]]:
    """[start, end) cut where the tenant's zone may change, each piece with its zone."""
    zones = Zones()
    zones.add(tenant)
    cuts = [c for c in _zone_changes(tenant) if _ms(start) < c < _ms(end)]
    points = [start, *(datetime.fromtimestamp(c / 1000, UTC) for c in cuts), end]
    return [(a, b, zones.at(tenant.pk, _ms(a))) for a, b in zip(points, points[1:])
            if a < b]


_REBUILD_SELECT = (
    f"SELECT tenant_id, %s, (ended_at AT TIME ZONE %s)::date, project_id, api_key_id, "
    f"provider_key_id, model, served_model, status, corrected_at IS NOT NULL, "
    f"{_RAW_AGGREGATES} FROM {_RAW_TABLE} WHERE tenant_id = %s AND ended_at >= %s "
    f"AND ended_at < %s GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10")


def _rebuild_into(tenant_id: int, zone: str, lo: datetime, hi: datetime) -> None:
    names = ", ".join((*_GROUP_COLUMNS, *SUM_FIELDS))
    updates = ", ".join(f"{c} = {_ROLLUP_TABLE}.{c} + EXCLUDED.{c}" for c in SUM_FIELDS)
    sql = (f"INSERT INTO {_ROLLUP_TABLE} ({names}) {_REBUILD_SELECT} "
           f"ON CONFLICT ON CONSTRAINT usage_rollup_group DO UPDATE SET {updates}")
    with connection.cursor() as cursor:
        cursor.execute(sql, [zone, zone, tenant_id, lo, hi])


_HOURLY_REBUILD = (
    f"INSERT INTO {_HOURLY_TABLE} ({', '.join((*_HOURLY_COLUMNS, *HOURLY_SUMS))}) "
    f"SELECT tenant_id, date_trunc('hour', ended_at, 'UTC'), project_id, api_key_id, count(*), "
    f"coalesce(sum(input_tokens + output_tokens), 0) FROM {_RAW_TABLE} WHERE tenant_id = %s "
    f"AND ended_at >= %s AND ended_at < %s GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4 "
    f"ON CONFLICT ON CONSTRAINT usage_hourly_group DO UPDATE SET "
    f"{', '.join(f'{c} = {_HOURLY_TABLE}.{c} + EXCLUDED.{c}' for c in HOURLY_SUMS)}")


def hourly_kept_since(now: datetime | None = None) -> datetime:
    """The first UTC hour the hourly table keeps: TOLLGATE_FORECAST_HISTORY_DAYS + 2 days back
    (forecasts read the history days before the tenant's today, at most a day before now)."""
    days = settings.TOLLGATE_FORECAST_HISTORY_DAYS + 2
    return hour_of((now or dj_timezone.now()) - timedelta(days=days))


def prune_hourly(now: datetime | None = None) -> int:
    """Delete the hourly rows older than `hourly_kept_since`; returns how many. Daily (the
    partition upkeep task, billing.tasks.ensure_ledger_partitions)."""
    deleted, _ = UsageHourly.objects.filter(hour__lt=hourly_kept_since(now)).delete()
    return deleted


def _rebuild_hourly(tenant_id: int, lo: datetime, hi: datetime) -> None:
    """The tenant's hourly rows of [lo, hi) (UTC day bounds) from its raw rows: those older
    than the table keeps are deleted, not recomputed (the daily prune would drop them)."""
    UsageHourly.objects.filter(tenant_id=tenant_id, hour__gte=lo, hour__lt=hi).delete()
    lo = max(lo, hourly_kept_since())
    if lo < hi:
        with connection.cursor() as cursor:
            cursor.execute(_HOURLY_REBUILD, [tenant_id, lo, hi])


def rebuild(start: date, end: date, *, tenant: Tenant | None = None,
            force: bool = False) -> int:
    """Recompute the rollups of days [start, end) (every zone: the UTC days and the tenants'
    local days) and the hourly rows of those UTC days (within the hours the table keeps) from
    the raw rows, per tenant in one transaction each; returns the number of tenants rebuilt. Raises RawRowsMissing (before changing anything of that tenant) when a UTC
    day has rollups but no raw rows, unless `force`: the raw rows were dropped and the rollup
    is all that is left of them.

    Safe beside a running drain: a drain that commits before the DELETE has its rows read by
    the INSERT ... SELECT that follows; one that upserts after the DELETE waits for this
    transaction on the deleted groups and then adds to the rebuilt rows."""
    tenants = [tenant] if tenant is not None else list(
        Tenant.objects.select_related("plan").order_by("pk"))
    utc = ZoneInfo(UTC_ZONE)
    done = 0
    for one in tenants:
        with transaction.atomic():
            if not force:
                _check_raw_present(one.pk, start, end)
            UsageRollup.objects.filter(tenant=one, day__gte=start, day__lt=end).delete()
            _rebuild_into(one.pk, UTC_ZONE, day_start(start, utc), day_start(end, utc))
            _rebuild_hourly(one.pk, day_start(start, utc), day_start(end, utc))
            # Local days: rows up to 14 h either side of the UTC range may fall on them.
            pad = timedelta(days=1)
            for lo, hi, zone in _zone_intervals(one, day_start(start, utc) - pad,
                                                day_start(end, utc) + pad):
                if zone == UTC_ZONE:
                    continue
                tz = ZoneInfo(zone)
                lo, hi = max(lo, day_start(start, tz)), min(hi, day_start(end, tz))
                if lo < hi:
                    _rebuild_into(one.pk, zone, lo, hi)
        done += 1
    return done


def _check_raw_present(tenant_id: int, start: date, end: date) -> None:
    rolled = set(UsageRollup.objects.filter(tenant_id=tenant_id, zone=UTC_ZONE, day__gte=start,
                                            day__lt=end, requests__gt=0)
                 .values_list("day", flat=True).distinct())
    if not rolled:
        return
    utc = ZoneInfo(UTC_ZONE)
    present = set(UsageRecord.objects.filter(
        tenant_id=tenant_id, ended_at__gte=day_start(min(rolled), utc),
        ended_at__lt=day_start(max(rolled) + timedelta(days=1), utc))
        .annotate(d=TruncDate("ended_at", tzinfo=utc)).values_list("d", flat=True).distinct())
    missing = sorted(rolled - present)
    if missing:
        raise RawRowsMissing(f"tenant {tenant_id}: UTC days {missing[0]}..{missing[-1]} "
                             f"({len(missing)}) have rollups but no raw rows")


