"""Redis forgets, the ledger remembers (billing/rebuild.py): after a FLUSHALL the reserve refuses
(QuotaEpochLost) until the current windows' counters are rebuilt from the ledger plus the usage
events not drained yet, and then every counter the gateway checks says what it said before."""
from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from django.core.management import call_command

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from billing.prices import PriceBook
from billing.rebuild import lost_tenants, rebuild_lost_tenants, rebuild_tenant
from gateway.auth import KeyContext, load_key_context
from quotas import keys
from quotas.engine import (
    Hold,
    QuotaEngine,
    QuotaEpochLost,
    ReserveRequest,
    Unit,
)
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import Window, WindowKind
from tenants.api_key_format import parse_key
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db

MODEL = "gpt-4o"


@dataclass
class Caller:
    """One API key of a tenant, calling the engine the way the gateway does."""

    engine: QuotaEngine
    ctx: KeyContext
    prices: PriceBook
    n: int = 0

    def reserve(self, amount: int = 400, model: str = MODEL) -> Hold:
        self.n += 1
        reservation = self.engine.reserve(self.request(f"c{self.ctx.api_key.pk}-{self.n}", amount,
                                                       model))
        assert reservation.admitted, reservation
        assert reservation.hold is not None
        return reservation.hold

    def request(self, request_id: str, amount: int, model: str = MODEL) -> ReserveRequest:
        meta = json.dumps({"p": self.ctx.project.pk, "k": self.ctx.api_key.pk, "m": model,
                           "served": model, "ep": "chat/completions"})
        return ReserveRequest(tenant=self.ctx.tenant_tag, request_id=request_id, amount=amount,
                              limits=self.ctx.scopes(model), meta=meta, money_amount=10_000,
                              check_epoch=True, schedule=self.ctx.schedule)

    def window(self, kind: WindowKind) -> Window:
        """The current window of `kind` in the tenant's windows, on the Redis clock."""
        return self.engine.current_window(kind, self.ctx.schedule)

    def settle(self, hold: Hold, input_tokens: int, output_tokens: int,
               model: str = MODEL) -> None:
        cost = self.prices.price(model, datetime.now(UTC)).cost(input_tokens, output_tokens)
        event = json.dumps({"in": input_tokens, "out": output_tokens, "st": 200,
                            "outcome": "complete"})
        result = self.engine.settle(hold, input_tokens + output_tokens, event, cost)
        assert result.outcome in {"settled", "corrected"}, result

    def call(self, input_tokens: int, output_tokens: int, model: str = MODEL) -> None:
        self.settle(self.reserve(model=model), input_tokens, output_tokens, model)


@pytest.fixture
def client(private_redis: PrivateRedis) -> Iterator[redis.Redis]:  # noqa: F811
    client = private_redis.client()
    yield client
    client.close()


@pytest.fixture
def engine(client: redis.Redis) -> QuotaEngine:
    return QuotaEngine(client)


def make_caller(engine: QuotaEngine, tenant: Tenant, project_slug: str = "web",
                **project_limits: Any) -> Caller:
    project = create_project(tenant, project_slug, actor="test", **project_limits)
    issued = issue_key(project, actor="test")
    ctx = load_key_context(parse_key(issued.plaintext) or "")
    assert ctx is not None
    return Caller(engine, ctx, PriceBook.load())


def counters(engine: QuotaEngine, caller: Caller, model: str = MODEL) -> dict[tuple[str, str, str], int]:
    """`used` of every counter a call of `model` is checked against, in the current windows."""
    found = {}
    for scope in caller.ctx.scopes(model):
        snapshot = engine.counter(caller.ctx.tenant_tag, scope.scope, scope.window,
                                  unit=scope.unit, schedule=caller.ctx.schedule)
        found[(scope.scope, scope.window.value, scope.unit.value)] = snapshot.used
    return found


def ledger_tokens(tenant: Tenant, since: datetime) -> int:
    return sum(r.total_tokens for r in UsageRecord.objects.filter(tenant=tenant,
                                                                   started_at__gte=since))


@pytest.fixture
def acme() -> Tenant:
    # A plan whose cycle is the calendar month, so that day and month windows differ (the free
    # plan's cycle is the day).
    return create_tenant("acme", plan_name="standard", actor="test", tokens_per_day=100_000,
                         monthly_spend_budget_micros=50_000_000)


def test_a_new_tenant_is_rebuilt_at_once_and_its_first_call_goes_through(
        engine: QuotaEngine, acme: Tenant) -> None:
    caller = make_caller(engine, acme)
    with pytest.raises(QuotaEpochLost):
        engine.reserve(caller.request("first", 100))
    result = rebuild_tenant(caller.ctx.tenant_tag, engine=engine)
    assert (result.rebuilt, result.counters, result.ledger_rows) == (True, 0, 0)
    assert engine.has_epoch(caller.ctx.tenant_tag)
    assert engine.reserve(caller.request("first", 100)).admitted


def test_flushall_then_rebuild_restores_every_counter_from_the_ledger(
        engine: QuotaEngine, client: redis.Redis, acme: Tenant) -> None:
    web = make_caller(engine, acme, "web", tokens_per_month=10_000_000)
    batch = make_caller(engine, acme, "batch")
    tag = web.ctx.tenant_tag
    rebuild_tenant(tag, engine=engine)  # a new tenant: its epoch
    for i in range(4):
        web.call(120 + i, 30)
    batch.call(200, 80)
    batch.call(50, 5, model="gpt-4o-mini")
    in_flight = web.reserve()  # its call is still running when Redis loses everything
    assert drain_tenant(client, acme.pk) == 6
    before_web, before_batch = counters(engine, web), counters(engine, batch)
    before_mini = counters(engine, batch, "gpt-4o-mini")
    assert before_web[("tenant", "day", "tokens")] == 4 * 150 + 6 + 280 + 55
    assert before_web[("tenant", "month", "micros")] > 0
    # The per-project monthly counter exists only where a monthly limit makes reserve use it.
    assert (f"project:{web.ctx.project.pk}", "month", "tokens") in before_web
    assert (f"project:{batch.ctx.project.pk}", "month", "tokens") not in before_batch

    client.flushall()
    with pytest.raises(QuotaEpochLost):
        engine.reserve(web.request("after-flush", 100))
    # The running call ends before the rebuild: its hold is gone, its settle is an orphan that
    # finds no counter to charge and leaves its usage event for the ledger, and the rebuild.
    web.settle(in_flight, 60, 40)
    result = rebuild_tenant(tag, engine=engine)

    assert (result.rebuilt, result.ledger_rows, result.pending_events) == (True, 6, 1)
    # Every counter is back, plus the orphan's usage (its call was web's: all of web's counters).
    orphan_cost = web.prices.price(MODEL, datetime.now(UTC)).cost(60, 40)
    assert counters(engine, web) == {
        k: used + (orphan_cost if k[2] == "micros" else 100) for k, used in before_web.items()}
    own = (f"project:{batch.ctx.project.pk}", f"key:{batch.ctx.api_key.pk}")
    assert {k: v for k, v in counters(engine, batch).items() if k[0] in own} == {
        k: v for k, v in before_batch.items() if k[0] in own}
    assert counters(engine, batch, "gpt-4o-mini")[("model:gpt-4o-mini", "day", "tokens")] == (
        before_mini[("model:gpt-4o-mini", "day", "tokens")])
    # Once drained, the ledger says what the counters say.
    assert drain_tenant(client, acme.pk) == 1
    month = web.window(WindowKind.MONTH)
    assert ledger_tokens(acme, datetime.fromtimestamp(month.start_ms / 1000, UTC)) == (
        counters(engine, web)[("tenant", "month", "tokens")])
    assert engine.reserve(web.request("after-rebuild", 100)).admitted


def test_surviving_usage_events_count_once(
        engine: QuotaEngine, client: redis.Redis, acme: Tenant) -> None:
    """Counters lost while the usage stream survived (or a forced rebuild): the events not yet
    drained count, those drained but not yet deleted count once, a late settle's correction
    replaces what the sweep's row says."""
    web = make_caller(engine, acme, "web")
    tag = web.ctx.tenant_tag
    rebuild_tenant(tag, engine=engine)
    web.call(500, 20)
    # A hold the sweep charged nothing for (never forwarded), drained as such, then its late
    # settle: a correction.
    late = web.reserve()
    assert [s.request_id for s in engine.sweep(tag, stale_s=0).swept] == [late.request_id]
    assert drain_tenant(client, acme.pk) == 2
    web.settle(late, 90, 10)
    web.call(300, 100)
    # Drained but not yet deleted from the stream (the drain deletes after its commit): these
    # two events are in both.
    stream = keys.usage_stream_key(tag)
    copies = client.xrange(stream)
    assert drain_tenant(client, acme.pk) == 2
    for _, fields in copies:
        client.xadd(stream, fields)
    # Not drained at all: the ledger has not seen these yet.
    web.call(70, 7)
    web.call(11, 1)
    before = counters(engine, web)
    assert before[("tenant", "day", "tokens")] == 520 + 100 + 400 + 77 + 12

    lost = [keys.epoch_key(tag)] + [
        keys.counter_key(tag, s.scope + (":usd" if s.unit is Unit.MICROS else ""),
                         web.window(s.window).id) for s in web.ctx.scopes(MODEL)]
    assert client.delete(*lost) == len(lost)
    result = rebuild_tenant(tag, engine=engine)
    assert result.pending_events == 4
    assert counters(engine, web) == before


def test_only_rows_of_the_current_windows_count(engine: QuotaEngine, acme: Tenant) -> None:
    caller = make_caller(engine, acme)
    day = caller.window(WindowKind.DAY)
    month = caller.window(WindowKind.MONTH)

    def row(request_id: str, started_ms: int, tokens: int) -> None:
        started = datetime.fromtimestamp(started_ms / 1000, UTC)
        UsageRecord.objects.create(
            request_id=request_id, tenant=acme, project=caller.ctx.project,
            api_key=caller.ctx.api_key, model=MODEL, served_model=MODEL, input_tokens=tokens,
            output_tokens=0, cost_micros=tokens, status=UsageRecord.Status.SETTLED,
            started_at=started, ended_at=started + timedelta(seconds=1))

    row("last-month", month.start_ms - 1, 1_000)  # ended in this month, made in the last one
    row("today", day.start_ms, 7)
    if day.start_ms > month.start_ms:
        row("earlier-this-month", day.start_ms - 1, 20)
    month_extra = 20 if day.start_ms > month.start_ms else 0

    rebuild_tenant(caller.ctx.tenant_tag, engine=engine)
    used = counters(engine, caller)
    assert used[("tenant", "day", "tokens")] == 7
    assert used[("tenant", "month", "tokens")] == 7 + month_extra
    assert used[("tenant", "month", "micros")] == 7 + month_extra
    assert used[(f"key:{caller.ctx.api_key.pk}", "day", "tokens")] == 7
    assert used[(f"model:{MODEL}", "day", "tokens")] == 7


def test_a_rebuild_never_lowers_a_counter_and_respects_the_lock(
        engine: QuotaEngine, client: redis.Redis, acme: Tenant) -> None:
    caller = make_caller(engine, acme)
    tag = caller.ctx.tenant_tag
    rebuild_tenant(tag, engine=engine)
    caller.call(100, 50)  # counted in Redis, not drained: the ledger knows nothing of it
    client.delete(keys.usage_stream_key(tag))  # as if drained, and the ledger lost it
    assert rebuild_tenant(tag, engine=engine, force=True).raised == 0
    assert counters(engine, caller)[("tenant", "day", "tokens")] == 150

    client.set(keys.rebuild_lock_key(tag), "another worker")
    client.delete(keys.epoch_key(tag))
    busy = rebuild_tenant(tag, engine=engine)
    assert not busy.rebuilt and not engine.has_epoch(tag)
    client.delete(keys.rebuild_lock_key(tag))
    assert rebuild_tenant(tag, engine=engine).rebuilt and engine.has_epoch(tag)
    # Found intact: another worker rebuilt it since the caller saw the loss.
    assert rebuild_tenant(tag, engine=engine).already_intact


def test_quota_rebuild_command_and_beat_job_rebuild_lost_tenants(acme: Tenant) -> None:
    engine = get_engine()  # the session's Redis: only this tenant's keys are touched
    caller = make_caller(engine, acme)
    tag = tenant_tag(acme.pk)
    call_command("quota_rebuild", "--tenant", "acme", "--json", stdout=io.StringIO())
    caller.call(40, 2)
    assert drain_tenant(engine.client, acme.pk) == 1
    counter = keys.counter_key(tag, "tenant", caller.window(WindowKind.DAY).id)

    engine.client.delete(keys.epoch_key(tag), counter)
    out = io.StringIO()
    call_command("quota_rebuild", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["busy"] == [] and report["tenants"]["acme"]["ledger_rows"] == 1
    assert engine.counter(tag, "tenant").used == 42

    engine.client.delete(keys.epoch_key(tag), counter)
    assert rebuild_lost_tenants() >= 1
    assert engine.has_epoch(tag) and engine.counter(tag, "tenant").used == 42

    out = io.StringIO()
    call_command("quota_rebuild", stdout=out)  # nothing lost any more
    assert out.getvalue().strip() == "No tenant has lost its quota counters."


def test_the_spend_counter_is_rebuilt_only_where_reserve_uses_it(
        engine: QuotaEngine, client: redis.Redis) -> None:
    free = create_tenant("nobudget", plan_name="free", actor="test")
    caller = make_caller(engine, free)
    assert all(s.unit is Unit.TOKENS for s in caller.ctx.scopes(MODEL))
    rebuild_tenant(caller.ctx.tenant_tag, engine=engine)
    caller.call(10, 10)
    drain_tenant(client, free.pk)
    client.flushall()
    result = rebuild_tenant(caller.ctx.tenant_tag, engine=engine)
    assert result.counters == len(caller.ctx.scopes(MODEL))
    money_key = keys.counter_key(caller.ctx.tenant_tag, "tenant:usd",
                                 caller.window(WindowKind.MONTH).id)
    assert not client.exists(money_key)


@pytest.mark.cluster
def test_rebuild_on_a_redis_cluster(redis_cluster_url: str, acme: Tenant) -> None:
    cluster = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    engine = QuotaEngine(cluster)
    caller = make_caller(engine, acme)
    tag = caller.ctx.tenant_tag
    assert lost_tenants(engine, [acme.pk]) == [acme.pk]
    rebuild_tenant(tag, engine=engine)
    assert lost_tenants(engine, [acme.pk]) == []
    caller.call(300, 30)
    caller.call(20, 2)
    assert drain_tenant(cluster, acme.pk) == 2
    before = counters(engine, caller)

    # The shard holding the tenant's slot lost its data (the cluster is shared with other
    # tests, so the tenant's keys are deleted rather than the whole cluster flushed).
    lost = [keys.epoch_key(tag)] + [
        keys.counter_key(tag, s.scope + (":usd" if s.unit is Unit.MICROS else ""),
                         caller.window(s.window).id) for s in caller.ctx.scopes(MODEL)]
    assert cluster.delete(*lost) == len(lost)
    assert lost_tenants(engine, [acme.pk]) == [acme.pk]
    with pytest.raises(QuotaEpochLost):
        engine.reserve(caller.request("after-loss", 100))
    assert rebuild_tenant(tag, engine=engine).ledger_rows == 2
    assert counters(engine, caller) == before
    cluster.close()


def test_a_pool_nobody_borrowed_from_is_rebuilt_at_zero(engine: Any, client: Any) -> None:
    """A protected project used only its allotment: the pool holds 0. The rebuild must write it
    (at 0): missing, the next reserve would seed it from the tenant counter and count the
    allotment's own use as borrowed, refusing the other project its untouched pool."""
    tenant = create_tenant("pooled", plan_name="standard", actor="test", tokens_per_day=1000)
    prot = make_caller(engine, tenant, "prot", allotment_tokens_per_day=600)
    other = make_caller(engine, tenant, "other")
    tag = prot.ctx.tenant_tag
    rebuild_tenant(tag, engine=engine)
    prot.settle(prot.reserve(amount=500), 400, 100)
    drain_tenant(client, tenant.pk)
    client.flushall()
    rebuild_tenant(tag, engine=engine)
    day = prot.window(WindowKind.DAY).id
    assert client.hget(keys.pool_key(tag, day), "taken") == "0"
    assert engine.reserve(other.request("o1", 400)).admitted
