"""The drain's round trips per batch, pinned: the statements PostgreSQL receives for a drain
run and for each batch, and the Redis commands; and the references the insert resolves itself
(a project, key or provider key deleted since the call becomes NULL in the row and its rollup).

The counts are exact, so a statement added to the drain's per-batch path fails here: at 10
active tenants a run is one batch per tenant, and the busy tenants' first batches are written
together, 20 tenants a transaction: a run over a few small tenants costs one batch's statements.
"""
from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.ledger import drain_all
from billing.models import UsageHourly, UsageRecord, UsageRollup
from billing.rollups import verify
from gateway.providers import create_provider_key
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing import rollup_events as ev

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 3, 12, tzinfo=UTC)
# A drain run with work: the price book (model prices, model specs, aliases, provider keys'
# default prices), then the busy tenants with their plans, in one query.
RUN_STATEMENTS = ["SELECT"] * 5
# One batch, as captured inside the test's transaction: the drain's transaction is a savepoint
# here (BEGIN and COMMIT outside a test); the COPY into the staging table goes through
# psycopg's copy() and is one more round trip, not captured by Django. The one WITH: the insert
# and its rollups (WITH staged AS (DELETE ... RETURNING *), ins AS (INSERT INTO the ledger ...
# RETURNING *), hourly AS (INSERT INTO billing_usagehourly ...) ... INSERT INTO the daily rollup
# ...): the rows and both rollups in one round trip (two before the sums moved into it),
# prepared once per connection (billing.rollups._execute_insert) and run by EXECUTE.
BATCH_STATEMENTS = ["SAVEPOINT", "CREATE", "EXECUTE", "RELEASE"]


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _tenant_with_events(client: redis.Redis, count: int) -> Tenant:
    tenant = create_tenant(f"stmts-{uuid.uuid4().hex[:8]}", plan_name="free", actor="test")
    project = create_project(tenant, "web", actor="test")
    key = issue_key(project, actor="test").api_key.pk
    ev.push(client, tenant.pk, [
        ev.settled(f"{tenant.slug}-{i}", DAY + timedelta(minutes=i), project=project.pk, key=key)
        for i in range(count)])
    return tenant


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
            for name in ("xrange", "xdel")}


def _verbs(queries: list[dict[str, str]]) -> list[str]:
    """The statements' verbs, without the PREPARE of the drain's statement: once per
    connection, so in the first drain of the connection the tests run on (at most one)."""
    verbs = [q["sql"].split(None, 1)[0].upper() for q in queries]
    prepared = [q["sql"] for q in queries if q["sql"].upper().startswith("PREPARE")]
    assert len(prepared) <= 1 and all("usage_drain_stage_" in sql for sql in prepared)
    return [verb for verb in verbs if verb != "PREPARE"]


def test_a_drain_run_writes_the_tenants_first_batches_in_one_transaction(
        client: redis.Redis) -> None:
    tenants = [_tenant_with_events(client, 10) for _ in range(3)]
    before = _commands(client)
    with CaptureQueriesContext(connection) as queries:
        result = drain_all(client, tenant_ids=[t.pk for t in tenants])
    assert (result.events, result.tenants, result.refused) == (30, 3, ())
    # The three tenants' first batches: one transaction, the statements of one batch.
    assert _verbs(queries.captured_queries) == RUN_STATEMENTS + BATCH_STATEMENTS
    after = _commands(client)
    # One XRANGE per tenant (pipelined: one round trip) and, after the commit, one XDEL each
    # (one pipelined round trip).
    assert {name: after[name] - before[name] for name in after} == {"xrange": 3, "xdel": 3}
    assert UsageRecord.objects.filter(tenant__in=tenants).count() == 30
    assert verify(DAY.date(), DAY.date() + timedelta(days=1)) == []


def test_a_tenant_with_several_batches_pays_the_run_statements_once(client: redis.Redis) -> None:
    tenant = _tenant_with_events(client, 7)
    before = _commands(client)
    with CaptureQueriesContext(connection) as queries:
        result = drain_all(client, batch=3, tenant_ids=[tenant.pk])
    assert result.events == 7
    # Batches of 3, 3 and 1 (the short one ends the tenant's turn).
    assert _verbs(queries.captured_queries) == RUN_STATEMENTS + BATCH_STATEMENTS * 3
    after = _commands(client)
    assert {name: after[name] - before[name] for name in after} == {"xrange": 3, "xdel": 3}


def test_references_deleted_since_the_call_are_null_in_the_row_and_its_rollup(
        client: redis.Redis) -> None:
    tenant = create_tenant(f"gone-{uuid.uuid4().hex[:8]}", plan_name="free", actor="test")
    project = create_project(tenant, "web", actor="test")
    key = issue_key(project, actor="test").api_key.pk
    provider = create_provider_key(f"pk-{tenant.slug}", base_url="http://127.0.0.1:9/v1",
                                   secret="sk-test-0000000000", actor="test")
    kept = create_project(tenant, "kept", actor="test")
    kept_key = issue_key(kept, actor="test").api_key.pk
    events = [ev.settled(f"{tenant.slug}-gone", DAY, project=project.pk, key=key),
              ev.settled(f"{tenant.slug}-kept", DAY, project=kept.pk, key=kept_key),
              # A hold swept, then its late settle served by a provider key deleted since.
              ev.swept(f"{tenant.slug}-late", DAY, project=kept.pk, key=kept_key),
              ev.corrected(f"{tenant.slug}-late", DAY + timedelta(minutes=1), project=kept.pk,
                           key=kept_key)]
    for fields in events[:2]:
        fields["event"] = fields["event"].replace('"pk": null', f'"pk": {provider.pk}')
    events[3]["event"] = events[3]["event"].replace('"pk": null', f'"pk": {provider.pk}')
    ev.push(client, tenant.pk, events)
    project.delete()
    provider.delete()
    result = drain_all(client, tenant_ids=[tenant.pk])
    assert (result.events, result.corrected) == (4, 1)
    rows = {r.request_id.rsplit("-", 1)[1]: r for r in UsageRecord.objects.filter(tenant=tenant)}
    assert (rows["gone"].project_id, rows["gone"].api_key_id,
            rows["gone"].provider_key_id) == (None, None, None)
    assert (rows["kept"].project_id, rows["kept"].api_key_id,
            rows["kept"].provider_key_id) == (kept.pk, kept_key, None)
    assert rows["late"].corrected_at is not None and rows["late"].provider_key_id is None
    # (The swept group the correction left stays, summing to nothing.)
    groups = set(UsageRollup.objects.filter(tenant=tenant, zone="UTC", requests__gt=0).values_list(
        "project_id", "api_key_id", "provider_key_id", "status", "corrected", "requests"))
    assert groups == {(None, None, None, "settled", False, 1),
                      (kept.pk, kept_key, None, "settled", False, 1),
                      (kept.pk, kept_key, None, "settled", True, 1)}
    assert verify(DAY.date(), DAY.date() + timedelta(days=1), tenant_id=tenant.pk) == []
    # The hourly table's rows name the same references (the corrected row's tokens in its hour).
    assert set(UsageHourly.objects.filter(tenant=tenant).values_list(
        "project_id", "api_key_id", "requests", "tokens")) == {
        (None, None, 1, 150), (kept.pk, kept_key, 2, 150 + 300)}
