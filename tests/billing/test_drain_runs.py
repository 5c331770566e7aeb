"""A drain run over several tenants and long streams (billing/ledger.py drain_all): the busy
tenants' first batches written in one transaction, a tenant with more than a batch drained with
its next batch read while the last one is written, and a tenant whose rows PostgreSQL refuses
holding back no other. The money assertions: one row per usage event, the rollups equal to the
raw rows, a refused batch still in its stream (nothing lost, nothing counted twice)."""
from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from django.db import ProgrammingError, connection

from billing.ledger import drain_all
from billing.models import UsageRecord, UsageRollup
from billing.rollups import verify
from quotas import keys
from quotas.keys import tenant_tag
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing import rollup_events as ev

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 3, 12, tzinfo=UTC)
# Longer than the ledger's request_id column (128): PostgreSQL refuses the row (a DataError in
# the COPY of its batch). The gateway never writes such an event; a hand-made or corrupted one.
TOO_LONG = "x" * 200


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _tenant(prefix: str = "runs") -> tuple[Tenant, int, int]:
    tenant = create_tenant(f"{prefix}-{uuid.uuid4().hex[:8]}", plan_name="free", actor="test")
    project = create_project(tenant, "web", actor="test")
    return tenant, project.pk, issue_key(project, actor="test").api_key.pk


def _push(client: redis.Redis, tenant: Tenant, project: int, key: int, count: int, *,
          poison_at: int | None = None, first: int = 0) -> list[str]:
    """`count` settled events on the tenant's stream (one pipelined round trip), one a second;
    the one at `poison_at` with a request id PostgreSQL refuses. Returns the request ids."""
    stream = keys.usage_stream_key(tenant_tag(tenant.pk))
    pipe = client.pipeline(transaction=False)
    ids = []
    for i in range(first, first + count):
        rid = TOO_LONG if i == poison_at else f"{tenant.slug}-{i}"
        ids.append(rid)
        pipe.xadd(stream, ev.settled(rid, DAY + timedelta(seconds=i), project=project, key=key,
                                     model=("gpt-4o", "gpt-4o-mini")[i % 2], money=100 + i))
    pipe.execute()
    return ids


def _waiting(client: redis.Redis, tenant: Tenant) -> list[str]:
    """The request ids still in the tenant's stream, in stream order."""
    stream = keys.usage_stream_key(tenant_tag(tenant.pk))
    return [fields["request_id"] for _, fields in client.xrange(stream)]


def _rows(tenant: Tenant) -> list[str]:
    return sorted(UsageRecord.objects.filter(tenant=tenant).values_list("request_id", flat=True))


def _checked(tenant: Tenant, requests: int) -> None:
    """The tenant's rollups equal its raw rows, and count `requests` requests."""
    assert verify(DAY.date(), DAY.date() + timedelta(days=1), tenant_id=tenant.pk) == []
    summed = sum(UsageRollup.objects.filter(tenant=tenant, zone="UTC")
                 .values_list("requests", flat=True))
    assert summed == requests


def test_a_long_stream_is_drained_exactly_batch_after_batch(client: redis.Redis) -> None:
    tenant, project, key = _tenant()
    ids = _push(client, tenant, project, key, 2_300)
    small, small_project, small_key = _tenant()
    small_ids = _push(client, small, small_project, small_key, 7)
    result = drain_all(client, batch=500, tenant_ids=[tenant.pk, small.pk])
    assert (result.events, result.tenants, result.refused) == (2_307, 2, ())
    assert _rows(tenant) == sorted(ids) and _rows(small) == sorted(small_ids)
    assert _waiting(client, tenant) == [] and _waiting(client, small) == []
    _checked(tenant, 2_300)
    _checked(small, 7)
    # Every row is the event's: the cost the scripts charged, to the micro-dollar.
    assert sum(UsageRecord.objects.filter(tenant=tenant).values_list("cost_micros", flat=True)) \
        == sum(100 + i for i in range(2_300))


def test_a_run_stops_at_its_bound_and_the_next_one_goes_on(client: redis.Redis) -> None:
    tenant, project, key = _tenant()
    ids = _push(client, tenant, project, key, 1_250)
    first = drain_all(client, batch=200, max_batches_per_tenant=3, tenant_ids=[tenant.pk])
    assert first.events == 600
    # Read ahead and parsed, never written: still in the stream, in order.
    assert _waiting(client, tenant) == ids[600:]
    assert _rows(tenant) == sorted(ids[:600])
    while drain_all(client, batch=200, max_batches_per_tenant=3, tenant_ids=[tenant.pk]).events:
        pass
    assert _rows(tenant) == sorted(ids) and _waiting(client, tenant) == []
    _checked(tenant, 1_250)


def test_a_tenant_whose_rows_are_refused_holds_back_no_other(client: redis.Redis) -> None:
    tenants = [_tenant() for _ in range(3)]
    pushed = [_push(client, t, p, k, 10, poison_at=4 if n == 1 else None)
              for n, (t, p, k) in enumerate(tenants)]
    result = drain_all(client, tenant_ids=[t.pk for t, _, _ in tenants])
    bad = tenants[1][0]
    assert result.refused == (bad.pk,)
    assert (result.events, result.tenants) == (20, 2)
    for n in (0, 2):
        assert _rows(tenants[n][0]) == sorted(pushed[n])
        assert _waiting(client, tenants[n][0]) == []
        _checked(tenants[n][0], 10)
    # Nothing of the refused batch was written or deleted: its ten events wait in the stream.
    assert _rows(bad) == [] and _waiting(client, bad) == pushed[1]
    _checked(bad, 0)
    # The next run refuses it again and still drains the others' new events.
    more = _push(client, *tenants[2], 3, first=10)
    again = drain_all(client, tenant_ids=[t.pk for t, _, _ in tenants])
    assert (again.events, again.refused) == (3, (bad.pk,))
    assert _rows(tenants[2][0]) == sorted(pushed[2] + more)


def test_a_batch_refused_mid_stream_keeps_it_and_what_follows(client: redis.Redis) -> None:
    tenant, project, key = _tenant()
    ids = _push(client, tenant, project, key, 2_300, poison_at=1_200)
    result = drain_all(client, batch=500, tenant_ids=[tenant.pk])
    assert (result.events, result.refused) == (1_000, (tenant.pk,))
    # Batches 1 and 2 written; batch 3 (with the refused event) and everything after it wait.
    assert _rows(tenant) == sorted(ids[:1_000])
    assert _waiting(client, tenant) == ids[1_000:]
    _checked(tenant, 1_000)


def test_a_lone_tenant_whose_first_batch_is_refused_keeps_its_whole_stream(
        client: redis.Redis) -> None:
    """The one busy tenant of a run drains from its first batch with the next one read ahead:
    a refused first batch writes nothing, and what was read ahead stays in the stream too."""
    tenant, project, key = _tenant()
    ids = _push(client, tenant, project, key, 1_500, poison_at=3)
    result = drain_all(client, batch=500, tenant_ids=[tenant.pk])
    assert (result.events, result.tenants, result.refused) == (0, 0, (tenant.pk,))
    assert _rows(tenant) == [] and _waiting(client, tenant) == ids
    _checked(tenant, 0)


def test_an_integer_out_of_its_column_range_is_refused_not_wrapped(client: redis.Redis) -> None:
    """The binary COPY would wrap a status of 70,000 into a smallint (4,464) without a word;
    staged as bigint, the ledger's column refuses it, like the text COPY did."""
    tenants = [_tenant() for _ in range(2)]
    pushed = [_push(client, t, p, k, 5) for t, p, k in tenants]
    stream = keys.usage_stream_key(tenant_tag(tenants[1][0].pk))
    fields = ev.settled(f"{tenants[1][0].slug}-odd", DAY, project=tenants[1][1],
                        key=tenants[1][2])
    fields["event"] = fields["event"].replace('"st": 200', '"st": 70000')
    client.xadd(stream, fields)
    result = drain_all(client, tenant_ids=[t.pk for t, _, _ in tenants])
    assert result.refused == (tenants[1][0].pk,)
    assert _rows(tenants[0][0]) == sorted(pushed[0])
    assert _rows(tenants[1][0]) == [] and len(_waiting(client, tenants[1][0])) == 6
    assert not UsageRecord.objects.filter(http_status=4464).exists()


def test_a_prepared_statement_the_session_lost_is_prepared_again(client: redis.Redis) -> None:
    """DEALLOCATE ALL (or a pooler's DISCARD ALL) drops the drain's prepared statement: the
    group's transaction fails, each tenant's batch is written in its own with the statement
    prepared again; a lone tenant's batch fails its run (events kept) and the next run drains."""
    tenants = [_tenant() for _ in range(3)]
    pushed = [_push(client, t, p, k, 4) for t, p, k in tenants]
    drain_all(client, tenant_ids=[tenants[0][0].pk])  # prepared on this connection
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    more = _push(client, *tenants[0], 2, first=4)
    result = drain_all(client, tenant_ids=[t.pk for t, _, _ in tenants])
    assert (result.events, result.refused) == (10, ())
    for n, (tenant, _, _) in enumerate(tenants):
        assert _rows(tenant) == sorted(pushed[n] + (more if n == 0 else []))
        _checked(tenant, len(_rows(tenant)))
    lone, project, key = _tenant()
    ids = _push(client, lone, project, key, 3)
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with pytest.raises(ProgrammingError):
        drain_all(client, tenant_ids=[lone.pk])
    assert _waiting(client, lone) == ids and _rows(lone) == []
    assert drain_all(client, tenant_ids=[lone.pk]).events == 3
    assert _rows(lone) == sorted(ids) and _waiting(client, lone) == []


@pytest.mark.e2e
def test_two_drain_runs_racing_over_the_same_tenants_write_each_event_once(
        client: redis.Redis, django_db_blocker: Any) -> None:
    """Two workers run drain_all over the same three tenants at once (each with a long stream,
    so both read ahead and write their groups and batches concurrently): one row per event,
    the rollups equal to the raw rows (nothing summed twice), every stream empty."""
    from tests.gateway.conftest import committed

    prefix = f"drain-race-{os.getpid()}-{time.monotonic_ns()}"
    made = committed(django_db_blocker, lambda: [_tenant(prefix) for _ in range(3)])
    pushed = {t.pk: _push(client, t, p, k, 1_700) for t, p, k in made}
    tenant_ids = sorted(pushed)

    def run() -> int:
        moved = 0
        try:
            while True:
                done = drain_all(client, batch=250, max_batches_per_tenant=4,
                                 tenant_ids=tenant_ids)
                assert done.refused == ()
                moved += done.events
                if not done.events:
                    return moved
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(2) as pool:
        moved = [f.result() for f in [pool.submit(run) for _ in range(2)]]
    # Each event was read by one run or both; written once either way.
    assert 3 * 1_700 <= sum(moved) <= 2 * 3 * 1_700

    def check() -> None:
        for tenant, _, _ in made:
            assert _rows(tenant) == sorted(pushed[tenant.pk])
            assert _waiting(client, tenant) == []
            _checked(tenant, 1_700)

    committed(django_db_blocker, check)


def test_a_correction_locks_only_its_rows_partitions(client: redis.Redis) -> None:
    """A late settle's correction updates its swept row within the row's own month: the UPDATE
    is bounded by the rows' ended_at, so PostgreSQL locks (ROW EXCLUSIVE) only that month's
    partition. Unbounded, it locked every month's, and so waited behind the retention's SHARE
    lock on an old month (billing/retention.py) for as long as that month's check took."""
    tenant, project, key = _tenant()
    stream = keys.usage_stream_key(tenant_tag(tenant.pk))
    ended = datetime.now(UTC).replace(microsecond=0)
    client.xadd(stream, ev.swept("late-1", ended, project=project, key=key))
    assert drain_all(client, tenant_ids=[tenant.pk]).events == 1
    client.xadd(stream, ev.corrected("late-1", ended + timedelta(seconds=2), project=project,
                                     key=key))
    with connection.cursor() as cursor:
        cursor.execute("SELECT inhrelid::regclass::text FROM pg_inherits "
                       "WHERE inhparent = 'billing_usagerecord'::regclass")
        partitions = {name for (name,) in cursor.fetchall()}
        cursor.execute("SELECT tableoid::regclass::text FROM billing_usagerecord "
                       "WHERE request_id = 'late-1'")
        [(own,)] = cursor.fetchall()
    assert len(partitions) >= 3  # this month's, the months ahead, the default
    # The test's transaction keeps every lock the drain's statements took until it ends.
    assert drain_all(client, tenant_ids=[tenant.pk]).corrected == 1
    with connection.cursor() as cursor:
        cursor.execute("SELECT relation::regclass::text FROM pg_locks "
                       "WHERE pid = pg_backend_pid() AND mode = 'RowExclusiveLock' "
                       "AND relation IS NOT NULL")
        locked = {name for (name,) in cursor.fetchall()} & partitions
    assert locked == {own}
    row = UsageRecord.objects.get(request_id="late-1")
    assert row.status == "settled" and row.corrected_at is not None
