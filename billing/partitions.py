"""The ledger's monthly partitions (billing.UsageRecord, PostgreSQL declarative partitioning).

billing_usagerecord is partitioned by RANGE on `ended_at` (the call's end on the Redis clock),
one partition per UTC month, named `billing_usagerecord_yYYYYmMM`, plus a DEFAULT partition
(`billing_usagerecord_default`) that takes any row outside the months created, so the drain never
fails on a missing month (a clock far off, or the beat not running). Why partitions: a month is
the unit a billion-row ledger is kept, exported and dropped in (billing/retention.py: DROP of a
detached partition instead of a DELETE of hundreds of millions of rows), and queries bounded by
`ended_at` (every report) read only their months.

What partitioning changes (PostgreSQL requires every primary key and unique constraint of a
partitioned table to include the partition key):
- the database's primary key is (id, ended_at). Django keeps `id` alone as the model's pk: ids
  still come from one identity sequence, so `id` stays unique in practice, and the ORM (bulk
  updates, the admin) addresses rows by it; a lookup by id probes each partition's pk index on
  its leading column.
- the dedupe key is UNIQUE (request_id, ended_at) (`usage_request_once`). A redelivered usage
  event carries the same `ended` field as its first delivery, so it still conflicts and never
  makes a second row. A non-unique index on request_id (`usage_request_id`) serves corrections,
  which look a row up by request id only (billing/ledger.py).
- every other index and constraint is defined on the parent, so each partition has its own
  (partial indexes and CHECK constraints included), and a partition created later gets them too.

Partitions are made ahead by the beat (billing.tasks.ensure_ledger_partitions: this month and
MONTHS_AHEAD more). Rows of a month that sit in the default partition (it had no partition when
they were drained) are moved into that month's new partition in the same transaction that
creates it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction

from billing.reports import Month

log = logging.getLogger(__name__)

TABLE = "billing_usagerecord"
KEY = "ended_at"
# This month and the next two: a beat that stops for weeks still finds next month ready.
MONTHS_AHEAD = 2
# The names the model state (billing/models.py) gives the new dedupe key and request id index.
REQUEST_ONCE = "usage_request_once"
REQUEST_INDEX = "usage_request_id"

# How long making a partition waits for the ledger's lock before giving up (create_month).
LOCK_TIMEOUT_MS = 10_000

_MONTH_SUFFIX = re.compile(r"_y(\d{4})m(\d{2})$")


def shift(month: Month, months: int) -> Month:
    index = month.year * 12 + month.month - 1 + months
    return Month(index // 12, index % 12 + 1)


def month_of(moment: datetime) -> Month:
    utc = moment.astimezone(UTC)
    return Month(utc.year, utc.month)


def partition_name(month: Month, table: str = TABLE) -> str:
    return f"{table}_y{month.year:04d}m{month.month:02d}"


def default_name(table: str = TABLE) -> str:
    return f"{table}_default"


def _ident(name: str) -> str:
    return connection.ops.quote_name(name)


def _literal(moment: datetime) -> str:
    """A partition bound: DDL takes no bind parameters; the text is made from integers only."""
    return f"'{moment.astimezone(UTC).isoformat()}'::timestamptz"


def is_partitioned(cursor: Any, table: str = TABLE) -> bool:
    cursor.execute("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s)",
                   [table])
    return cursor.fetchone() is not None


def monthly_partitions(cursor: Any, table: str = TABLE) -> dict[Month, str]:
    """The month partitions attached to `table`, by month (the default partition is not one)."""
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass(%s)", [table])
    found: dict[Month, str] = {}
    for (name,) in cursor.fetchall():
        match = _MONTH_SUFFIX.search(name)
        if match and name.startswith(table):
            found[Month(int(match[1]), int(match[2]))] = name
    return found


def default_months(cursor: Any, table: str = TABLE) -> list[Month]:
    """The UTC months of the rows sitting in the default partition."""
    cursor.execute(
        f"SELECT DISTINCT date_trunc('month', {KEY} AT TIME ZONE 'UTC') "
        f"FROM {_ident(default_name(table))}")
    return sorted(Month(m.year, m.month) for (m,) in cursor.fetchall())


def _create_partition(cursor: Any, month: Month, table: str) -> None:
    cursor.execute(
        f"CREATE TABLE {_ident(partition_name(month, table))} PARTITION OF {_ident(table)} "
        f"FOR VALUES FROM ({_literal(month.start)}) TO ({_literal(month.end)})")


@dataclass(frozen=True)
class Created:
    month: Month
    moved: int  # rows moved out of the default partition into it


def create_month(month: Month, table: str = TABLE) -> Created | None:
    """Create `month`'s partition (None when it exists), moving that month's rows out of the
    default partition into it, all in one transaction.

    PostgreSQL refuses to create a partition while the default partition holds rows of its range,
    so they go to a temporary table first, the partition is created, and they come back through
    the parent (which routes them to the new partition). The parent is locked first (ACCESS
    EXCLUSIVE, the lock CREATE TABLE ... PARTITION OF takes anyway), so no drain can put a row of
    that month in the default partition between the move and the creation, and the lock order
    (parent, then its partitions) is the drain's own: no deadlock. A drain waits for this
    transaction, which is milliseconds when the default partition is empty, as it is when the beat
    keeps months ahead.
    """
    with transaction.atomic(), connection.cursor() as cursor:
        # A long report holding the table would keep this waiting, and every drain queued behind
        # it: give up instead (the next day's run tries again; months are made two ahead).
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms'")
        cursor.execute(f"LOCK TABLE {_ident(table)} IN ACCESS EXCLUSIVE MODE")
        if month in monthly_partitions(cursor, table):
            return None
        default = _ident(default_name(table))
        # ON COMMIT DROP ends it at the outermost commit; an earlier month in the same outer
        # transaction (a savepoint here) may have left one.
        cursor.execute("DROP TABLE IF EXISTS pg_temp.ledger_move")
        cursor.execute(f"CREATE TEMPORARY TABLE ledger_move (LIKE {_ident(table)}) "
                       "ON COMMIT DROP")
        cursor.execute(
            f"WITH moved AS (DELETE FROM {default} WHERE {KEY} >= %s AND {KEY} < %s "
            "RETURNING *) INSERT INTO ledger_move SELECT * FROM moved",
            [month.start, month.end])
        moved = cursor.rowcount
        _create_partition(cursor, month, table)
        if moved:
            cursor.execute(f"INSERT INTO {_ident(table)} OVERRIDING SYSTEM VALUE "
                           "SELECT * FROM ledger_move")
            log.warning("ledger partition %s created with %d rows moved from the default "
                        "partition", partition_name(month, table), moved)
        return Created(month, moved)


def ensure_partitions(now: datetime | None = None, *, ahead: int = MONTHS_AHEAD,
                      table: str = TABLE) -> list[Created]:
    """This month's partition and `ahead` more, and one for every month whose rows sit in the
    default partition (moved into it); each month in its own transaction. Returns what it
    created."""
    current = month_of(now or datetime.now(UTC))
    with connection.cursor() as cursor:
        wanted = set(default_months(cursor, table))
        existing = monthly_partitions(cursor, table)
    wanted |= {shift(current, n) for n in range(ahead + 1)}
    created = []
    for month in sorted(wanted, key=lambda m: (m.year, m.month)):
        if month not in existing:
            made = create_month(month, table)
            if made is not None:
                created.append(made)
    return created


def rows_in(month: Month, table: str = TABLE) -> int:
    """Rows in `month`'s partition (0 when there is none)."""
    with connection.cursor() as cursor:
        name = monthly_partitions(cursor, table).get(month)
        if name is None:
            return 0
        cursor.execute(f"SELECT count(*) FROM {_ident(name)}")
        return int(cursor.fetchone()[0])


def drop_month(month: Month, table: str = TABLE) -> bool:
    """Detach and drop `month`'s partition (False when there is none). The caller has checked the
    month's rollups and export (billing/retention.py); this only removes it."""
    with transaction.atomic(), connection.cursor() as cursor:
        name = monthly_partitions(cursor, table).get(month)
        if name is None:
            return False
        # PostgreSQL refuses to drop a table with deferred foreign key checks still pending on
        # it (rows written earlier in the caller's transaction): run them now.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        # The detach locks the parent: as in create_month, give up rather than queue the drains.
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms'")
        # Inside a transaction: DETACH ... CONCURRENTLY cannot run there, and the plain detach's
        # lock on the parent lasts milliseconds (no rows are read or moved).
        cursor.execute(f"ALTER TABLE {_ident(table)} DETACH PARTITION {_ident(name)}")
        cursor.execute(f"DROP TABLE {_ident(name)}")
        return True


# -- the migration (billing/migrations/0013_partition_usage.py) ---------------------------------


def _definitions(cursor: Any, table: str) -> tuple[list[tuple[str, str, str]],
                                                   list[tuple[str, str]]]:
    """The table's constraints (name, type, definition; not NOT NULL, which LIKE copies) and its
    indexes that back no constraint (name, definition)."""
    cursor.execute(
        "SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = to_regclass(%s) AND contype IN ('p', 'u', 'f', 'c') "
        "ORDER BY contype, conname", [table])
    constraints = [(n, t, d) for n, t, d in cursor.fetchall()]
    cursor.execute(
        "SELECT i.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x "
        "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid = to_regclass(%s) "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid "
        "AND c.conrelid = x.indrelid) ORDER BY i.relname", [table])
    # A partitioned table's index reads "ON ONLY parent": recreated without ONLY, so that every
    # partition gets it.
    return constraints, [(n, d.replace(" ON ONLY ", " ON ", 1)) for n, d in cursor.fetchall()]


_KEY_COLUMNS = re.compile(r"^(PRIMARY KEY|UNIQUE(?: NULLS NOT DISTINCT)?) \(([^)]*)\)(.*)$")


def _with_key(definition: str) -> tuple[list[str], str]:
    """The columns of a PRIMARY KEY / UNIQUE definition with the partition key added."""
    match = _KEY_COLUMNS.match(definition)
    if match is None:
        raise ValueError(f"unexpected key definition {definition!r}")
    columns = [c.strip() for c in match[2].split(",")]
    if KEY not in columns:
        columns.append(KEY)
    return columns, f"{match[1]} ({', '.join(columns)}){match[3]}"


def _set_aside(cursor: Any, table: str, old: str, partitioning: str) -> None:
    """Rename `table` (and its identity sequence) to `old` and create `table` again like it,
    with `partitioning` (a PARTITION BY clause, or empty), without indexes or constraints: the
    two ways of migration 0013 (partition_existing, unpartition)."""
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
    (sequence,) = cursor.fetchone()
    cursor.execute(f"ALTER TABLE {_ident(table)} RENAME TO {_ident(old)}")
    if sequence:
        # Its name goes to the new table's identity sequence (the old one goes with the table).
        cursor.execute(f"ALTER SEQUENCE {sequence} RENAME TO {_ident(old + '_id_seq')}")
    cursor.execute(
        f"CREATE TABLE {_ident(table)} (LIKE {_ident(old)} INCLUDING DEFAULTS INCLUDING IDENTITY "
        f"INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMMENTS){partitioning}")


def _move_rows(cursor: Any, table: str, old: str, *, cascade: bool) -> int:
    """Copy every row of `old` into `table` with their ids, drop `old` (with its partitions when
    `cascade`), and start `table`'s identity sequence after the highest id. Returns the rows."""
    cursor.execute(f"INSERT INTO {_ident(table)} OVERRIDING SYSTEM VALUE "
                   f"SELECT * FROM {_ident(old)}")
    moved = cursor.rowcount
    cursor.execute(f"SELECT max(id) FROM {_ident(old)}")
    (top,) = cursor.fetchone()
    cursor.execute(f"DROP TABLE {_ident(old)}{' CASCADE' if cascade else ''}")
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
    (new_sequence,) = cursor.fetchone()
    if new_sequence and top is not None:
        cursor.execute("SELECT setval(%s, %s)", [new_sequence, top])
    return moved


def partition_existing(cursor: Any, table: str = TABLE, *, now: datetime | None = None,
                       ahead: int = MONTHS_AHEAD) -> int:
    """Turn the plain table `table` into one partitioned by month on `ended_at`, keeping its
    rows, its identity sequence's position and every index and constraint (the primary key and
    unique keys get `ended_at` added; the unique request id becomes REQUEST_ONCE, with the plain
    index REQUEST_INDEX beside it). Partitions: every month that has rows, this month and `ahead`
    more, and the default one. Returns the rows moved. Runs in the caller's transaction (the
    migration's): all of it or nothing.

    The new table is loaded before its indexes are built (one sorted build per index, faster
    than maintaining them row by row), and the old table is dropped only after the copy."""
    if is_partitioned(cursor, table):
        return 0
    constraints, indexes = _definitions(cursor, table)
    old = f"{table}_unpartitioned"
    _set_aside(cursor, table, old, f" PARTITION BY RANGE ({KEY})")
    cursor.execute(f"SELECT DISTINCT date_trunc('month', {KEY} AT TIME ZONE 'UTC') "
                   f"FROM {_ident(old)}")
    months = {Month(m.year, m.month) for (m,) in cursor.fetchall()}
    current = month_of(now or datetime.now(UTC))
    months |= {shift(current, n) for n in range(ahead + 1)}
    for month in sorted(months, key=lambda m: (m.year, m.month)):
        _create_partition(cursor, month, table)
    cursor.execute(f"CREATE TABLE {_ident(default_name(table))} PARTITION OF {_ident(table)} "
                   "DEFAULT")
    moved = _move_rows(cursor, table, old, cascade=False)
    has_request_index = False
    for name, kind, definition in constraints:
        if kind in ("p", "u"):
            columns, definition = _with_key(definition)
            if kind == "u" and columns == ["request_id", KEY] and table == TABLE:
                name = REQUEST_ONCE
        cursor.execute(f"ALTER TABLE {_ident(table)} ADD CONSTRAINT {_ident(name)} {definition}")
    for name, definition in indexes:
        if re.search(r"\(request_id( varchar_pattern_ops)?\)$", definition):
            if "varchar_pattern_ops" in definition:
                # Django's index for LIKE on the unique column: nothing searches request ids
                # by prefix.
                continue
            has_request_index = True
        cursor.execute(definition)
    if not has_request_index:
        index = REQUEST_INDEX if table == TABLE else f"{table}_request_id_idx"
        cursor.execute(f"CREATE INDEX {_ident(index)} ON {_ident(table)} (request_id)")
    return moved


def unpartition(cursor: Any, like_index: str, table: str = TABLE) -> int:
    """The migration's reverse: the partitioned `table` back to one plain table with a unique
    request id (`like_index`: Django's name for its varchar_pattern_ops index). Fails, and the
    reverse migration with it, if two rows share a request id (possible only after the
    partitioning: the same request id ended at two times)."""
    if not is_partitioned(cursor, table):
        return 0
    constraints, indexes = _definitions(cursor, table)
    old = f"{table}_partitioned"
    _set_aside(cursor, table, old, "")
    moved = _move_rows(cursor, table, old, cascade=True)
    for name, kind, definition in constraints:
        if kind in ("p", "u"):
            match = _KEY_COLUMNS.match(definition)
            if match is None:
                raise ValueError(f"unexpected key definition {definition!r}")
            columns = [c.strip() for c in match[2].split(",") if c.strip() != KEY]
            definition = f"{match[1]} ({', '.join(columns)}){match[3]}"
            if name == REQUEST_ONCE:
                name = f"{table}_request_id_key"
        cursor.execute(f"ALTER TABLE {_ident(table)} ADD CONSTRAINT {_ident(name)} {definition}")
    for name, definition in indexes:
        if name != REQUEST_INDEX:
            cursor.execute(definition)
    cursor.execute(f"CREATE INDEX {_ident(like_index)} ON {_ident(table)} "
                   "(request_id varchar_pattern_ops)")
    return moved
