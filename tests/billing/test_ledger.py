"""The ledger drain: usage events in Redis become exactly one PostgreSQL row per request."""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis

from billing.ledger import drain_all, drain_tenant
from billing.models import UsageRecord
from billing.prices import PriceBook
from gateway.models import ModelPrice
from quotas import keys
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
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
        # The gateway settles with the cost at the price it resolved (one price book for the hot
        # path and the ledger); the ledger bills exactly that.
        cost = PriceBook.load().price(model, datetime.now(UTC)).cost(input_tokens, output_tokens)
        engine.settle(hold, input_tokens + output_tokens, event, actual_money=cost)


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


def test_the_price_period_in_force_is_billed(client: redis.Redis, acme: Tenant) -> None:
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


def test_the_ledger_bills_what_the_spend_counter_was_charged(
    client: redis.Redis, acme: Tenant
) -> None:
    # The gateway priced the call when it admitted it; a price period that starts while the call
    # runs must not make the ledger disagree with the spend budget it was checked against.
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    call(engine, acme, project, issue_key(project, actor="test").api_key.pk, "before",
         input_tokens=1_000, output_tokens=1_000)
    ModelPrice.objects.create(model="gpt-4o", input_micros_per_mtok=90_000_000,
                              output_micros_per_mtok=90_000_000,
                              valid_from=datetime.now(UTC) - timedelta(seconds=1))
    drain_tenant(client, acme.pk)
    assert UsageRecord.objects.get(request_id="before").cost_micros == cost(1_000, 1_000)


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


# -- how a hold ended when nobody ended it: the sweep, and the settle that comes after it ------

LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 10**9),)
GPT_4O = (2_500_000, 10_000_000)  # gpt-4o's list price, micro-dollars per million in / out


def hold_for(engine: QuotaEngine, tenant: Tenant, project: Project, rid: str, *,
             amount: int = 1000, input_tokens: int = 100):
    """A reservation as the gateway makes it: meta, the input estimate and the prices."""
    meta = json.dumps({"p": project.pk, "m": "gpt-4o", "served": "gpt-4o",
                       "ep": "chat/completions"})
    reservation = engine.reserve(ReserveRequest(
        tenant_tag(tenant.pk), rid, amount, LIMITS, meta=meta, input_tokens=input_tokens,
        price_in=GPT_4O[0], price_out=GPT_4O[1]))
    assert reservation.hold is not None
    return reservation.hold


def settle_event(input_tokens: int, output_tokens: int, outcome: str = "complete") -> str:
    return json.dumps({"in": input_tokens, "out": output_tokens, "st": 200, "lat": 900,
                       "outcome": outcome, "pk": None, "stream": True, "soft": False})


def cost(input_tokens: int, output_tokens: int) -> int:
    from billing.prices import Price

    return Price(*GPT_4O).cost(input_tokens, output_tokens)


def row_values(rid: str) -> dict:
    return UsageRecord.objects.filter(request_id=rid).values().get()


def test_swept_rows_carry_what_the_sweep_charged_and_why(client: redis.Redis, acme: Tenant) -> None:
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold_for(engine, acme, project, "never-forwarded")
    engine.progress(hold_for(engine, acme, project, "forwarded"), Phase.FORWARDED)
    engine.progress(hold_for(engine, acme, project, "streaming"), Phase.STREAMING, 40)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)

    assert drain_tenant(client, acme.pk) == 3
    rows = {r.request_id: r for r in UsageRecord.objects.filter(tenant=acme)}
    got = {rid: (r.status, r.sweep_basis, r.input_tokens, r.output_tokens, r.cost_micros)
           for rid, r in rows.items()}
    assert got == {
        "never-forwarded": ("swept", "reserved", 0, 0, 0),
        # A non-streamed call that reached the upstream may have produced up to its cap.
        "forwarded": ("swept", "forwarded", 100, 900, cost(100, 900)),
        "streaming": ("swept", "streaming", 100, 40, cost(100, 40)),
    }
    assert all(r.corrected_at is None and r.swept_cost_micros is None for r in rows.values())


def test_a_settle_after_the_sweep_corrects_the_row_once(client: redis.Redis, acme: Tenant) -> None:
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "late")
    engine.progress(hold, Phase.STREAMING, 40)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    drain_tenant(client, acme.pk)
    assert (row_values("late")["input_tokens"], row_values("late")["output_tokens"]) == (100, 40)

    late = engine.settle(hold, 100 + 250, settle_event(100, 250), actual_money=cost(100, 250))
    assert late.outcome == "corrected"
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    [(_, correction)] = client.xrange(stream)
    assert drain_tenant(client, acme.pk) == 1
    row = UsageRecord.objects.get(request_id="late")
    assert (row.status, row.detail, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "settled", "complete", 100, 250, cost(100, 250))
    assert (row.swept_input_tokens, row.swept_output_tokens, row.swept_cost_micros) == (
        100, 40, cost(100, 40))
    assert row.sweep_basis == "streaming" and row.corrected_at is not None
    assert (row.http_status, row.latency_ms, row.streamed) == (200, 900, True)

    # Redelivered (a drain that died after its commit, before XDEL): nothing changes.
    before = row_values("late")
    client.xadd(stream, correction)
    assert drain_tenant(client, acme.pk) == 1
    assert row_values("late") == before
    # A second late settle is a no-op in Redis: no event at all.
    again = engine.settle(hold, 999, settle_event(900, 99), actual_money=cost(900, 99))
    assert again.outcome == "corrected"
    assert client.xlen(stream) == 0


def test_a_swept_event_and_its_correction_in_one_batch_converge(
        client: redis.Redis, acme: Tenant) -> None:
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "both")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    engine.settle(hold, 130, settle_event(100, 30, outcome="client_disconnected"),
                  actual_money=cost(100, 30))

    assert drain_tenant(client, acme.pk) == 2  # swept, then corrected, in one transaction
    row = UsageRecord.objects.get(request_id="both")
    assert (row.status, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "partial", 100, 30, cost(100, 30))
    assert (row.swept_input_tokens, row.swept_output_tokens, row.swept_cost_micros) == (
        100, 900, cost(100, 900))


def test_a_correction_whose_swept_row_never_came_becomes_the_row(
        client: redis.Redis, acme: Tenant) -> None:
    """The swept event is missing (drained into nothing, or lost with Redis' data): the
    correction alone writes the corrected row; the swept event, should it come later, changes
    nothing."""
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "alone")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    [(swept_id, swept)] = client.xrange(stream)
    client.xdel(stream, swept_id)
    engine.settle(hold, 180, settle_event(100, 80), actual_money=cost(100, 80))

    assert drain_tenant(client, acme.pk) == 1
    row = UsageRecord.objects.get(request_id="alone")
    assert (row.status, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "settled", 100, 80, cost(100, 80))
    # The correction says how much the sweep charged, not the split; its money is exact.
    assert (row.swept_input_tokens, row.swept_output_tokens, row.swept_cost_micros) == (
        1000, 0, cost(100, 900))
    assert row.corrected_at is not None and row.held_tokens == 1000

    before = row_values("alone")
    client.xadd(stream, swept)
    assert drain_tenant(client, acme.pk) == 1
    assert row_values("alone") == before


def test_a_release_after_the_sweep_takes_the_charge_back(client: redis.Redis, acme: Tenant) -> None:
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "nothing-came")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    drain_tenant(client, acme.pk)
    assert engine.release(hold, json.dumps({"st": 502, "outcome": "upstream_status"})
                          ).outcome == "corrected"
    drain_tenant(client, acme.pk)
    row = UsageRecord.objects.get(request_id="nothing-came")
    assert (row.status, row.detail, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "released", "upstream_status", 0, 0, 0)
    assert (row.swept_input_tokens, row.swept_output_tokens, row.swept_cost_micros) == (
        100, 900, cost(100, 900))
    assert row.http_status == 502


def test_a_settle_whose_hold_redis_lost_is_an_ordinary_row(
        client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    hold = hold_for(engine, acme, project, "orphan-settle")
    client.delete(keys.hold_key(tenant_tag(acme.pk), "orphan-settle"))  # Redis lost the record
    settled = engine.settle(hold, 150, settle_event(100, 50), actual_money=cost(100, 50))
    assert settled.outcome == "settled"
    [(_, fields)] = client.xrange(keys.usage_stream_key(tenant_tag(acme.pk)))
    assert fields.get("orphan") == "1"

    assert drain_tenant(client, acme.pk) == 1
    row = UsageRecord.objects.get(request_id="orphan-settle")
    assert (row.status, row.input_tokens, row.output_tokens, row.cost_micros, row.project_id) == (
        "settled", 100, 50, cost(100, 50), project.pk)


def test_a_fail_open_call_is_an_unmetered_row(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    meta = json.dumps({"p": project.pk, "m": "gpt-4o", "served": "gpt-4o",
                       "ep": "chat/completions"})
    engine.append_unmetered(tenant_tag(acme.pk), "fail-open", actual=70, created_ms=now_ms - 500,
                            ended_ms=now_ms, meta=meta, event=settle_event(60, 10))
    assert drain_tenant(client, acme.pk) == 1
    row = UsageRecord.objects.get(request_id="fail-open")
    assert (row.status, row.input_tokens, row.output_tokens, row.held_tokens, row.cost_micros) == (
        "unmetered", 60, 10, 0, cost(60, 10))
    assert row.over_hold_tokens == 0  # no hold: nothing to be above


def test_usage_above_the_hold_is_recorded_per_row(client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "web", actor="test")
    engine.settle(hold_for(engine, acme, project, "over", amount=100, input_tokens=50), 130,
                  settle_event(60, 70))
    engine.settle(hold_for(engine, acme, project, "under", amount=100, input_tokens=50), 90,
                  settle_event(60, 30))
    drain_tenant(client, acme.pk)
    assert dict(UsageRecord.objects.filter(tenant=acme).values_list(
        "request_id", "over_hold_tokens")) == {"over": 30, "under": 0}


@pytest.mark.e2e
def test_two_drainers_racing_over_one_correction_apply_it_once(
        client: redis.Redis, django_db_blocker: Any) -> None:
    """Both workers read the batch before either commits (as when a drain task runs on two
    workers at once): the row ends corrected, with what the sweep charged kept as the sweep's
    figures, whichever worker applies the correction."""
    import os
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from quotas.engine import Phase
    from tests.gateway.conftest import committed

    slug = f"ledger-race-{os.getpid()}-{time.monotonic_ns()}"
    rid = f"{slug}-call"

    def setup() -> tuple[Tenant, Project]:
        tenant = create_tenant(slug, plan_name="free", actor="test")
        return tenant, create_project(tenant, "web", actor="test")

    tenant, project = committed(django_db_blocker, setup)
    engine = QuotaEngine(client)
    hold = hold_for(engine, tenant, project, rid)
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(tenant.pk), stale_s=0)
    assert committed(django_db_blocker, lambda: drain_tenant(client, tenant.pk)) == 1
    late = engine.settle(hold, 300, settle_event(100, 200), actual_money=cost(100, 200))
    assert late.outcome == "corrected"

    both_read = threading.Barrier(2)

    class ReadTogether:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def xrange(self, *args: Any, **kwargs: Any) -> Any:
            entries = client.xrange(*args, **kwargs)
            both_read.wait(timeout=30)
            return entries

    def drain() -> int:
        try:
            return drain_tenant(ReadTogether(), tenant.pk)
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(2) as pool:
        assert [f.result() for f in [pool.submit(drain) for _ in range(2)]] == [1, 1]
    row = committed(django_db_blocker, lambda: UsageRecord.objects.get(request_id=rid))
    assert (row.status, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "settled", 100, 200, cost(100, 200))
    assert (row.swept_input_tokens, row.swept_output_tokens, row.swept_cost_micros) == (
        100, 900, cost(100, 900))


# -- token classes: cached input, cache writes, reasoning (gateway/usage.py) -------------------

SONNET = "claude-sonnet-4-5"  # seeded: $3 in, $15 out, cache reads $0.30, cache writes $3.75


def classed_event(usage: Any, outcome: str = "complete") -> str:
    """A settle event as the gateway writes it: the usage's event fields, then the call's."""
    return json.dumps({**usage.event_fields(), "st": 200, "lat": 40, "outcome": outcome,
                       "pk": None, "stream": False, "soft": False})


def sonnet_hold(engine: QuotaEngine, tenant: Tenant, project: Project, rid: str):
    meta = json.dumps({"p": project.pk, "m": SONNET, "served": SONNET, "ep": "messages"})
    return engine.reserve(ReserveRequest(
        tenant_tag(tenant.pk), rid, 20_000, LIMITS, meta=meta, input_tokens=10_000,
        price_in=3_000_000, price_out=15_000_000)).hold


def test_a_settled_call_keeps_its_token_classes_apart(client: redis.Redis, acme: Tenant) -> None:
    from gateway.usage import Usage

    engine = QuotaEngine(client)
    project = create_project(acme, "claude", actor="test")
    usage = Usage(10_000, 1_000, cached_input_tokens=6_000, cache_write_tokens=2_000,
                  reasoning_tokens=400)
    price = PriceBook.load().price(SONNET, datetime.now(UTC))
    # 2,000 plain input at $3, 6,000 cache reads at $0.30, 2,000 cache writes at $3.75,
    # 1,000 output at $15 (thinking included): 6,000 + 1,800 + 7,500 + 15,000 micro-dollars.
    assert price.cost_of(usage) == 30_300
    engine.settle(sonnet_hold(engine, acme, project, "classed"), usage.total,
                  classed_event(usage), actual_money=price.cost_of(usage))
    plain = Usage(500, 100)
    engine.settle(sonnet_hold(engine, acme, project, "plain"), plain.total,
                  classed_event(plain), actual_money=price.cost_of(plain))
    assert drain_tenant(client, acme.pk) == 2
    row = row_values("classed")
    assert (row["input_tokens"], row["output_tokens"], row["cached_input_tokens"],
            row["cache_write_tokens"], row["reasoning_tokens"], row["cost_micros"]) == (
        10_000, 1_000, 6_000, 2_000, 400, 30_300)
    assert row["over_hold_tokens"] == 0  # totals, not classes, count against the hold
    row = row_values("plain")
    assert (row["cached_input_tokens"], row["cache_write_tokens"], row["reasoning_tokens"],
            row["cost_micros"]) == (0, 0, 0, 500 * 3 + 100 * 15)


def test_an_unmetered_call_is_priced_by_class(client: redis.Redis, acme: Tenant) -> None:
    from gateway.usage import Usage

    engine = QuotaEngine(client)
    project = create_project(acme, "claude", actor="test")
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    meta = json.dumps({"p": project.pk, "m": SONNET, "served": SONNET, "ep": "messages"})
    usage = Usage(1_000, 200, cached_input_tokens=800, reasoning_tokens=50)
    engine.append_unmetered(tenant_tag(acme.pk), "open-classed", actual=usage.total,
                            created_ms=now_ms - 100, ended_ms=now_ms, meta=meta,
                            event=classed_event(usage))
    drain_tenant(client, acme.pk)
    row = row_values("open-classed")
    # No money in the event: the ledger prices it, 200 plain at $3 + 800 reads at $0.30 +
    # 200 output at $15.
    assert (row["status"], row["cached_input_tokens"], row["reasoning_tokens"],
            row["cost_micros"]) == ("unmetered", 800, 50, 600 + 240 + 3_000)


def test_a_correction_brings_the_classes_and_a_swept_row_has_none(
        client: redis.Redis, acme: Tenant) -> None:
    from gateway.usage import Usage
    from quotas.engine import Phase

    engine = QuotaEngine(client)
    project = create_project(acme, "claude", actor="test")
    hold = sonnet_hold(engine, acme, project, "late-classed")
    engine.progress(hold, Phase.FORWARDED)
    engine.sweep(tenant_tag(acme.pk), stale_s=0)
    drain_tenant(client, acme.pk)
    swept = row_values("late-classed")
    assert (swept["status"], swept["cached_input_tokens"], swept["cache_write_tokens"],
            swept["reasoning_tokens"]) == ("swept", 0, 0, 0)

    usage = Usage(10_000, 300, cached_input_tokens=9_000, cache_write_tokens=500,
                  reasoning_tokens=100)
    price = PriceBook.load().price(SONNET, datetime.now(UTC))
    assert engine.settle(hold, usage.total, classed_event(usage),
                         actual_money=price.cost_of(usage)).outcome == "corrected"
    drain_tenant(client, acme.pk)
    row = row_values("late-classed")
    assert (row["status"], row["input_tokens"], row["output_tokens"], row["cached_input_tokens"],
            row["cache_write_tokens"], row["reasoning_tokens"], row["cost_micros"]) == (
        "settled", 10_000, 300, 9_000, 500, 100, price.cost_of(usage))
    assert (row["swept_input_tokens"], row["swept_cost_micros"]) == (swept["input_tokens"],
                                                                     swept["cost_micros"])


def test_an_upstream_split_larger_than_its_totals_is_clamped_into_them(
        client: redis.Redis, acme: Tenant) -> None:
    engine = QuotaEngine(client)
    project = create_project(acme, "claude", actor="test")
    event = json.dumps({"in": 100, "out": 10, "ci": 90, "cw": 50, "rs": 99, "st": 200,
                        "outcome": "complete"})
    engine.settle(sonnet_hold(engine, acme, project, "odd"), 110, event)
    drain_tenant(client, acme.pk)
    row = row_values("odd")
    # Cache writes first (the dearer class), then reads within what is left: the row always
    # satisfies the database's check that classes are parts of their totals.
    assert (row["input_tokens"], row["cache_write_tokens"], row["cached_input_tokens"],
            row["output_tokens"], row["reasoning_tokens"]) == (100, 50, 50, 10, 10)


def test_the_database_refuses_classes_outside_their_totals(acme: Tenant) -> None:
    from django.db import IntegrityError, transaction

    moment = datetime.now(UTC)
    for classes in ({"cached_input_tokens": 60, "cache_write_tokens": 50},
                    {"reasoning_tokens": 11}, {"cached_input_tokens": -1}):
        with pytest.raises(IntegrityError), transaction.atomic():
            UsageRecord.objects.create(request_id="bad", tenant=acme, model="m",
                                       served_model="m", input_tokens=100, output_tokens=10,
                                       status="settled", started_at=moment, ended_at=moment,
                                       **classes)
