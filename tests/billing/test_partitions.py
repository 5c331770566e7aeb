"""The ledger partitioned by month on ended_at (billing/partitions.py, migration 0013): rows in
their month's partition, the default partition's catch and move, the dedupe key across months,
corrections, and the migration's rebuild of a plain table."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import redis
from django.db import IntegrityError, connection, transaction

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from billing.partitions import (
    REQUEST_INDEX,
    REQUEST_ONCE,
    TABLE,
    create_month,
    default_name,
    ensure_partitions,
    is_partitioned,
    month_of,
    monthly_partitions,
    partition_existing,
    partition_name,
    shift,
    unpartition,
)
from billing.reports import Month
from quotas import keys
from quotas.engine import Phase, QuotaEngine
from quotas.keys import tenant_tag
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.test_ledger import call, cost, hold_for, settle_event

pytestmark = pytest.mark.django_db

# Far from any month the migration made (this month and the next two).
FAR = Month(2031, 5)


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def partition_of(request_id: str) -> str:
    """The partition holding the row of `request_id` (the only one)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT tableoid::regclass::text FROM {TABLE} WHERE request_id = %s",
                       [request_id])
        [(name,)] = cursor.fetchall()
        return name


def row(acme: Tenant, request_id: str, ended_at: datetime, **fields: object) -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=request_id, tenant=acme, model="gpt-4o", served_model="gpt-4o",
        status=UsageRecord.Status.SETTLED, started_at=ended_at - timedelta(seconds=1),
        ended_at=ended_at, **fields)


def restamp(client: redis.Redis, tenant: Tenant, ended: datetime) -> None:
    """Move every event waiting on the tenant's usage stream to end (and start) at `ended`: an
    event of a call that ended in another month, written as the engine writes it otherwise."""
    stream = keys.usage_stream_key(tenant_tag(tenant.pk))
    entries = client.xrange(stream)
    ms = str(int(ended.timestamp() * 1000))
    for entry_id, fields in entries:
        client.xdel(stream, entry_id)
        client.xadd(stream, {**fields, "ended": ms, "created": ms})


def test_the_ledger_is_partitioned_by_month_with_a_default() -> None:
    now = datetime.now(UTC)
    with connection.cursor() as cursor:
        assert is_partitioned(cursor)
        months = monthly_partitions(cursor)
        cursor.execute("SELECT 1 FROM pg_class WHERE relname = %s", [default_name()])
        assert cursor.fetchone() is not None
    # The migration made this month and the next two (and the test database is newer than it).
    for n in range(3):
        assert shift(month_of(now), n) in months


def test_drained_rows_land_in_their_month_partition(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    key = issue_key(project, actor="test").api_key
    call(engine, acme, project, key.pk, "now-call")
    assert drain_tenant(client, acme.pk) == 1
    ended = UsageRecord.objects.get(request_id="now-call").ended_at
    assert partition_of("now-call") == partition_name(month_of(ended))

    next_month = shift(month_of(ended), 1)
    row(acme, "next-month", next_month.start + timedelta(hours=3))
    assert partition_of("next-month") == partition_name(next_month)
    # A month's last instant is still that month; its end is the next one's first.
    row(acme, "last-instant", next_month.end - timedelta(microseconds=1))
    row(acme, "first-instant", next_month.end)
    assert partition_of("last-instant") == partition_name(next_month)
    assert partition_of("first-instant") == partition_name(shift(next_month, 1))


def test_the_default_partition_catches_a_month_without_one_and_its_creation_moves_it(
        acme: Tenant) -> None:
    caught = row(acme, "far-1", FAR.start + timedelta(days=9), input_tokens=7, cost_micros=70)
    row(acme, "far-2", FAR.end - timedelta(seconds=1))
    row(acme, "farther", shift(FAR, 1).start + timedelta(days=1))
    assert {partition_of(r) for r in ("far-1", "far-2", "farther")} == {default_name()}

    made = create_month(FAR)
    assert made is not None and made.moved == 2
    assert partition_of("far-1") == partition_of("far-2") == partition_name(FAR)
    assert partition_of("farther") == default_name()  # not its month
    moved = UsageRecord.objects.get(request_id="far-1")
    assert (moved.pk, moved.input_tokens, moved.cost_micros, moved.ended_at) == (
        caught.pk, 7, 70, caught.ended_at)
    assert create_month(FAR) is None  # exists: nothing to do

    # The beat's pass makes the months ahead and the month of anything still in the default.
    created = ensure_partitions(now=datetime.now(UTC))
    assert [(c.month, c.moved) for c in created] == [(shift(FAR, 1), 1)]
    assert partition_of("farther") == partition_name(shift(FAR, 1))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {default_name()}")
        assert cursor.fetchone()[0] == 0
    # New rows of the month go straight to its partition.
    row(acme, "far-3", FAR.start + timedelta(days=20))
    assert partition_of("far-3") == partition_name(FAR)


def test_rows_of_several_months_in_the_default_partition_each_get_their_month(
        acme: Tenant) -> None:
    """The daily pass finds the months of the rows the default partition caught (sorted, oldest
    first) and makes each: with two months or more there it failed on sorting them (Month was
    not ordered), every day, so no partition was made any more, the months ahead included."""
    later, earlier = shift(FAR, 2), FAR
    row(acme, "two-later", later.start + timedelta(days=3))
    row(acme, "two-earlier", earlier.start + timedelta(days=3))
    row(acme, "two-earlier-b", earlier.start + timedelta(days=4))
    created = ensure_partitions(now=datetime.now(UTC))
    assert [(c.month, c.moved) for c in created] == [(earlier, 2), (later, 1)]
    assert partition_of("two-earlier") == partition_name(earlier)
    assert partition_of("two-later") == partition_name(later)

def test_a_new_partition_has_every_index_and_check_of_the_ledger(acme: Tenant) -> None:
    create_month(FAR)
    name = partition_name(FAR)
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [name])
        defs = [d for (d,) in cursor.fetchall()]
    assert any("UNIQUE" in d and "(request_id, ended_at)" in d for d in defs)
    assert any("UNIQUE" in d and "(id, ended_at)" in d for d in defs)
    # (Since migration 0015 no index of request_id alone: the dedupe key above serves lookups
    # by request id. The partition has exactly the ledger's indexes.)
    assert any(d.endswith("(tenant_id, ended_at)") for d in defs)
    assert any(d.endswith("(provider_key_id, served_model, ended_at)") for d in defs)
    assert any("WHERE (corrected_at IS NOT NULL)" in d for d in defs)
    assert any("WHERE (over_hold_tokens > 0)" in d for d in defs)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_indexes WHERE tablename = %s", [TABLE])
        assert cursor.fetchone()[0] == len(defs)
    with pytest.raises(IntegrityError, match="usage_classes_within_totals"), transaction.atomic():
        row(acme, "bad", FAR.start + timedelta(days=1), output_tokens=1, reasoning_tokens=2)


def test_a_redelivered_event_makes_no_second_row_under_the_new_key(
        client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    key = issue_key(project, actor="test").api_key
    call(engine, acme, project, key.pk, "again")
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    [(_id, event)] = client.xrange(stream)
    assert drain_tenant(client, acme.pk) == 1
    client.xadd(stream, event)  # delivered again: the same request id and the same end
    assert drain_tenant(client, acme.pk) == 1
    assert UsageRecord.objects.filter(request_id="again").count() == 1
    # The key is (request_id, ended_at): the database refuses the same pair twice.
    first = UsageRecord.objects.get(request_id="again")
    with pytest.raises(IntegrityError, match=r"\(request_id, ended_at\)"), transaction.atomic():
        row(acme, "again", first.ended_at)


def test_a_correction_updates_the_swept_row_in_an_earlier_month(
        client: redis.Redis, acme: Tenant) -> None:
    """The swept row ended last month (its partition), the late settle ends now: the correction
    finds the row by request id and updates it in place; no second row in this month."""
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "late")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    last_month = shift(month_of(datetime.now(UTC)), -1)
    swept_at = last_month.start + timedelta(days=3)
    restamp(client, acme, swept_at)
    ensure_partitions()  # the test database may be newer than last month
    create_month(last_month)
    assert drain_tenant(client, acme.pk) == 1
    assert partition_of("late") == partition_name(last_month)

    engine.settle(hold, 180, settle_event(100, 80), actual_money=cost(100, 80))
    assert drain_tenant(client, acme.pk) == 1
    [corrected] = UsageRecord.objects.filter(request_id="late")
    assert (corrected.status, corrected.input_tokens, corrected.output_tokens,
            corrected.cost_micros) == ("settled", 100, 80, cost(100, 80))
    assert corrected.ended_at == swept_at and corrected.corrected_at > swept_at
    assert corrected.swept_cost_micros == cost(100, 900)
    assert partition_of("late") == partition_name(last_month)

    # Redelivered, the swept event (its end is the row's) and the correction change nothing.
    before = UsageRecord.objects.filter(request_id="late").values().get()
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    ms = str(int(swept_at.timestamp() * 1000))
    client.xadd(stream, {"request_id": "late", "outcome": "swept", "ended": ms, "created": ms,
                         "held": "1000", "in": "100", "out": "900", "basis": "forwarded",
                         "meta": "{}"})
    assert drain_tenant(client, acme.pk) == 1
    assert UsageRecord.objects.filter(request_id="late").values().get() == before


def test_a_correction_whose_swept_row_never_came_stays_the_one_row(
        client: redis.Redis, acme: Tenant) -> None:
    """The corrected row made from the correction ends at the settle; the swept event, should it
    come later with the sweep's earlier end, is not a second row (a different ended_at would not
    conflict on the key: the insert checks the request id)."""
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "orphan-fix")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    [(swept_id, swept)] = client.xrange(stream)
    client.xdel(stream, swept_id)
    engine.settle(hold, 180, settle_event(100, 80), actual_money=cost(100, 80))
    assert drain_tenant(client, acme.pk) == 1
    earlier = str(int(swept["ended"]) - 60_000)
    client.xadd(stream, {**swept, "ended": earlier})
    assert drain_tenant(client, acme.pk) == 1
    assert UsageRecord.objects.filter(request_id="orphan-fix").count() == 1


# -- the migration's function -------------------------------------------------------------------

PROBE = "ledger_migration_probe"


def _plain_probe(cursor) -> None:
    """A plain table shaped as the ledger was before 0013: primary key id, unique request id."""
    cursor.execute(f"CREATE TABLE {PROBE} (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING IDENTITY "
                   "INCLUDING CONSTRAINTS)")
    cursor.execute(f"ALTER TABLE {PROBE} ADD PRIMARY KEY (id)")
    cursor.execute(f"ALTER TABLE {PROBE} ADD CONSTRAINT {PROBE}_request_id_key UNIQUE (request_id)")
    cursor.execute(f"CREATE INDEX {PROBE}_corrected ON {PROBE} (corrected_at) "
                   "WHERE corrected_at IS NOT NULL")
    cursor.execute(f"CREATE INDEX {PROBE}_tenant_ended ON {PROBE} (tenant_id, ended_at)")


def _probe_insert(cursor, request_id: str, ended_at: datetime, tenant_id: int) -> None:
    cursor.execute(
        f"INSERT INTO {PROBE} (request_id, tenant_id, endpoint, model, served_model, "
        "input_tokens, output_tokens, cached_input_tokens, cache_write_tokens, reasoning_tokens, "
        "held_tokens, cost_micros, status, detail, streamed, over_soft_limit, started_at, "
        "ended_at, recorded_at, sweep_basis, over_hold_tokens) VALUES (%s, %s, '', 'm', 'm', 3, "
        "4, 0, 0, 0, 0, 5, 'settled', '', false, false, %s, %s, %s, '', 0)",
        [request_id, tenant_id, ended_at, ended_at, ended_at])


def test_the_migration_moves_existing_rows_into_month_partitions(acme: Tenant) -> None:
    now = datetime(2026, 12, 1, 22, 0, tzinfo=UTC)
    moments = {"a": datetime(2026, 9, 30, 23, 59, 59, tzinfo=UTC),
               "b": datetime(2026, 10, 1, tzinfo=UTC), "c": datetime(2026, 10, 15, tzinfo=UTC),
               "d": datetime(2025, 1, 2, tzinfo=UTC)}
    with connection.cursor() as cursor:
        _plain_probe(cursor)
        for rid, moment in moments.items():
            _probe_insert(cursor, rid, moment, acme.pk)
        cursor.execute(f"SELECT request_id, id FROM {PROBE}")
        ids = dict(cursor.fetchall())

        assert partition_existing(cursor, PROBE, now=now) == 4
        assert is_partitioned(cursor, PROBE)
        assert set(monthly_partitions(cursor, PROBE)) == {
            Month(2025, 1), Month(2026, 9), Month(2026, 10), Month(2026, 12), Month(2027, 1),
            Month(2027, 2)}
        cursor.execute(f"SELECT request_id, id, tableoid::regclass::text FROM {PROBE}")
        where = {rid: (pk, part) for rid, pk, part in cursor.fetchall()}
        assert where == {
            "a": (ids["a"], partition_name(Month(2026, 9), PROBE)),
            "b": (ids["b"], partition_name(Month(2026, 10), PROBE)),
            "c": (ids["c"], partition_name(Month(2026, 10), PROBE)),
            "d": (ids["d"], partition_name(Month(2025, 1), PROBE))}
        # Keys with the partition key, the request id index, the partial index, the checks.
        cursor.execute("SELECT contype, pg_get_constraintdef(oid) FROM pg_constraint "
                       "WHERE conrelid = %s::regclass AND contype IN ('p', 'u')", [PROBE])
        assert sorted(cursor.fetchall()) == [("p", "PRIMARY KEY (id, ended_at)"),
                                             ("u", "UNIQUE (request_id, ended_at)")]
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s",
                       [partition_name(Month(2026, 10), PROBE)])
        defs = [d for (d,) in cursor.fetchall()]
        assert any(d.endswith("(request_id)") for d in defs)
        assert any("WHERE (corrected_at IS NOT NULL)" in d for d in defs)
        assert any(d.endswith("(tenant_id, ended_at)") for d in defs)
        # The identity goes on after the moved rows; the default partition takes the rest.
        _probe_insert(cursor, "e", datetime(2040, 1, 1, tzinfo=UTC), acme.pk)
        cursor.execute(f"SELECT id, tableoid::regclass::text FROM {PROBE} WHERE request_id = 'e'")
        new_id, part = cursor.fetchone()
        assert new_id > max(ids.values()) and part == default_name(PROBE)
        with pytest.raises(IntegrityError), transaction.atomic():
            cursor.execute(f"UPDATE {PROBE} SET output_tokens = -1 WHERE request_id = 'a'")

        # And back (the migration's reverse): one plain table, the rows and ids kept.
        assert unpartition(cursor, f"{PROBE}_like", PROBE) == 5
        assert not is_partitioned(cursor, PROBE)
        cursor.execute(f"SELECT request_id, id FROM {PROBE} WHERE request_id <> 'e'")
        assert dict(cursor.fetchall()) == ids
        cursor.execute("SELECT contype, pg_get_constraintdef(oid) FROM pg_constraint "
                       "WHERE conrelid = %s::regclass AND contype IN ('p', 'u')", [PROBE])
        assert sorted(cursor.fetchall()) == [("p", "PRIMARY KEY (id)"),
                                             ("u", "UNIQUE (request_id)")]


def test_the_ledger_model_state_matches_the_database() -> None:
    """Django's pk is id; the database's is (id, ended_at); the dedupe key and the request id
    index are the model's (makemigrations sees no change: the migration says so too)."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, TABLE)
    assert constraints[REQUEST_ONCE]["columns"] == ["request_id", "ended_at"]
    assert constraints[REQUEST_ONCE]["unique"]
    # Migration 0015 dropped the request id index (REQUEST_INDEX, made by 0013) with the
    # others that led another index, and the foreign keys of the references a call outlives.
    assert REQUEST_INDEX not in constraints
    indexed = sorted(tuple(c["columns"]) for c in constraints.values()
                     if c["index"] and not c["unique"] and not c["primary_key"])
    assert indexed == [("api_key_id",), ("corrected_at",), ("ended_at",), ("over_hold_tokens",),
                       ("project_id",), ("provider_key_id", "served_model", "ended_at"),
                       ("tenant_id", "ended_at")]
    referenced = sorted(c["foreign_key"] for c in constraints.values() if c["foreign_key"])
    assert referenced == [("tenants_tenant", "id")]
    [pk] = [c for c in constraints.values() if c["primary_key"]]
    assert pk["columns"] == ["id", "ended_at"]
    assert UsageRecord._meta.pk.name == "id"


def test_making_a_partition_gives_up_when_a_reader_holds_the_ledger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long report holding the table: the beat's partition step times out (and tries again the
    next day) instead of waiting with every drain queued behind its lock."""
    import psycopg
    from django.db import OperationalError

    import billing.partitions

    monkeypatch.setattr(billing.partitions, "LOCK_TIMEOUT_MS", 200)
    with psycopg.connect(**connection.get_connection_params()) as reader:
        reader.execute(f"SELECT count(*) FROM {TABLE}")  # its transaction holds ACCESS SHARE
        with pytest.raises(OperationalError, match="lock timeout"):
            create_month(FAR)
        reader.rollback()
    with connection.cursor() as cursor:
        assert FAR not in monthly_partitions(cursor)
