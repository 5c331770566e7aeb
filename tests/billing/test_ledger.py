"""The ledger drain: usage events in Redis become exactly one PostgreSQL row per request."""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis

from billing.ledger import drain_all, drain_tenant
from billing.models import UsageRecord
from gateway.models import ModelPrice
from quotas import keys
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.limits import tenant_tag
from quotas.windows import WindowKind
from tenants.models import Project, Tenant
from tenants.services import create_project, create_tenant, issue_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def call(engine: QuotaEngine, tenant: Tenant, project: Project, key_id: int, rid: str, *,
         model: str = "gpt-4o", input_tokens: int = 100, output_tokens: int = 50,
         outcome: str = "complete", release: bool = False) -> None:
    """What the gateway does for one request: reserve with meta, then settle with the event."""
    meta = json.dumps({"p": project.pk, "k": key_id, "m": model, "served": model,
                       "ep": "chat/completions"})
    hold = engine.reserve(ReserveRequest(tenant_tag(tenant.pk), rid, 1000,
                                         (ScopeLimit("tenant", WindowKind.DAY, 10**9),),
                                         meta=meta)).hold
    event = json.dumps({"in": input_tokens, "out": output_tokens, "st": 200, "lat": 12,
                        "outcome": outcome, "pk": None, "stream": False, "soft": False})
    if release:
        engine.release(hold, json.dumps({"st": 502, "outcome": "upstream_status"}))
    else:
        engine.settle(hold, input_tokens + output_tokens, event)


def test_settled_released_and_swept_calls_become_rows(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    key = issue_key(project, actor="test").api_key
    call(engine, acme, project, key.pk, "r1")
    call(engine, acme, project, key.pk, "r2", outcome="client_disconnected")
    call(engine, acme, project, key.pk, "r3", release=True)
    engine.reserve(ReserveRequest(tenant_tag(acme.pk), "r4", 70,
                                  (ScopeLimit("tenant", WindowKind.DAY, 10**9),)))
    engine.sweep(tenant_tag(acme.pk), stale_s=0)

    assert drain_tenant(client, acme.pk) == 4
    rows = {r.request_id: r for r in UsageRecord.objects.filter(tenant=acme)}
    assert {rid: r.status for rid, r in rows.items()} == {
        "r1": "settled", "r2": "partial", "r3": "released", "r4": "swept"}
    r1 = rows["r1"]
    assert (r1.input_tokens, r1.output_tokens, r1.held_tokens) == (100, 50, 1000)
    assert (r1.project_id, r1.api_key_id, r1.model, r1.endpoint) == (
        project.pk, key.pk, "gpt-4o", "chat/completions")
    assert (r1.http_status, r1.latency_ms) == (200, 12)
    # gpt-4o list price: $2.50 in, $10.00 out per million tokens -> 250 + 500 micro-dollars.
    assert r1.cost_micros == 750
    assert rows["r3"].cost_micros == 0 and rows["r4"].held_tokens == 70
    assert client.xlen(keys.usage_stream_key(tenant_tag(acme.pk))) == 0


def test_a_redelivered_event_never_makes_a_second_row(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    call(engine, acme, project, issue_key(project, actor="test").api_key.pk, "once")
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    [(_, fields)] = client.xrange(stream)
    client.xadd(stream, fields)  # the same event again (e.g. a drain that died before XDEL)
    assert drain_tenant(client, acme.pk) == 2
    assert UsageRecord.objects.filter(request_id="once").count() == 1


def test_prices_in_force_at_the_end_of_the_call_are_used(client: redis.Redis, acme: Tenant) -> None:
    now = datetime.now(UTC)
    ModelPrice.objects.create(model="gpt-4o", input_micros_per_mtok=1_000_000,
                              output_micros_per_mtok=2_000_000, valid_from=now - timedelta(days=1))
    ModelPrice.objects.create(model="gpt-4o", input_micros_per_mtok=9_000_000,
                              output_micros_per_mtok=9_000_000, valid_from=now - timedelta(days=9),
                              valid_to=now - timedelta(days=1))
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    call(engine, acme, project, issue_key(project, actor="test").api_key.pk, "priced",
         input_tokens=1_000_000, output_tokens=500_000)
    drain_tenant(client, acme.pk)
    assert UsageRecord.objects.get(request_id="priced").cost_micros == 1_000_000 + 1_000_000


def test_deleted_project_or_key_does_not_block_the_batch(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    key = issue_key(project, actor="test").api_key
    call(engine, acme, project, key.pk, "orphan")
    project.delete()
    assert drain_tenant(client, acme.pk) == 1
    row = UsageRecord.objects.get(request_id="orphan")
    assert row.project_id is None and row.api_key_id is None


def test_drain_all_moves_every_tenant_in_bounded_batches(client: redis.Redis) -> None:
    engine = QuotaEngine(client)
    tenants = [create_tenant(f"t{i}", plan_name="free", actor="test") for i in range(3)]
    for tenant in tenants:
        project = create_project(tenant, "web", actor="test")
        key_id = issue_key(project, actor="test").api_key.pk
        for n in range(7):
            call(engine, tenant, project, key_id, f"{tenant.slug}-{n}")
    result = drain_all(client, batch=3)
    assert (result.events, result.tenants) == (21, 3)
    assert UsageRecord.objects.filter(tenant__in=tenants).count() == 21
    assert drain_all(client).events == 0


def test_cost_is_integer_micro_dollars_rounded_half_up() -> None:
    from billing.prices import Price

    assert Price(2_500_000, 10_000_000).cost(1, 0) == 3  # 2.5 micro-dollars rounds up
    assert Price(2_500_000, 10_000_000).cost(0, 0) == 0
    assert isinstance(Price(150_000, 600_000).cost(123_456, 7_890), int)
    assert Decimal(Price(150_000, 600_000).cost(10**6, 10**6)) == Decimal(750_000)
