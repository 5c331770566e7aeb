"""The queue policy's waiting queue through running gateways and the openai SDK: arrival order
across worker processes, the wait header, the bound (queue_full), a client that leaves, a call
that can never fit (refused at once), and a race that keeps the money exact (granted <= limit,
nothing pending, one ledger row per call, the ledger equal to what the mock upstream
produced)."""
from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.mock_upstream import MockUpstream
from quotas import keys
from quotas.engine import QuotaEngine
from quotas.status import utc_day_id
from tenants.models import Plan
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    async_client_for,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import billed, unique_model

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "queue test"}]
WAIT_HEADER = "x-tollgate-queue-wait-ms"


def queue_plan(django_db_blocker: Any, timeout_s: int, priority: int = 10) -> str:
    name = f"q-{uuid.uuid4().hex[:8]}"
    committed(django_db_blocker, lambda: Plan.objects.create(
        name=name, display_name=name, tokens_per_day=5_000_000, requests_per_second=-1,
        over_quota_policy="queue", queue_timeout_seconds=timeout_s, queue_priority=priority,
        shrink_hold_to_headroom=False))
    return name


@pytest.fixture(scope="module")
def bounded_gateway(provider_key: str, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[GatewayServer]:
    """Two workers with a small queue bound, so the bound is reached by a few calls."""
    server = start_gateway(tmp_path_factory.mktemp("bounded"), workers=2,
                           TOLLGATE_QUEUE_MAX_WAITERS="4")
    yield server
    server.stop()


def ledger_rows(django_db_blocker: Any, engine: QuotaEngine, tenant_id: int) -> list[UsageRecord]:
    def drain() -> list[UsageRecord]:
        while drain_tenant(engine.client, tenant_id):
            pass
        return list(UsageRecord.objects.filter(tenant_id=tenant_id))
    return committed(django_db_blocker, drain)


def waiting(engine: QuotaEngine, tag: str) -> int:
    return engine.client.zcard(keys.queue_waiters_key(tag))


def test_waiters_are_admitted_in_arrival_order_across_workers(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any, mock_upstream: MockUpstream,
) -> None:
    """The smaller end-to-end version of the engine's 200 waiters: a key allowed one call in
    flight, 30 callers queued one after the other on 4 workers, each admitted when the call
    before it ends: in arrival order exactly."""
    waiters = 30
    t = make_tenant(plan=queue_plan(django_db_blocker, 60), key_options={"max_concurrency": 1})
    base = unique_model("queue-order")
    client = client_for(gateway, t.plaintext, timeout=90)
    finished: list[int] = []
    headers: dict[int, str | None] = {}
    lock = threading.Lock()

    def call(index: int, model: str) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, max_tokens=5)
        raw.parse()
        with lock:
            finished.append(index)
            headers[index] = raw.headers.get(WAIT_HEADER)

    # The holder's call must outlast the queueing of all 30 waiters, one by one, on a loaded
    # machine (4 s did not always): the test waits for it once they are queued.
    threads = [threading.Thread(target=call, args=(-1, f"{base}@first_byte_ms=12000"))]
    threads[0].start()
    assert wait_until(lambda: len(engine.open_hold_ids(t.tag)) == 1)
    for i in range(waiters):
        threads.append(threading.Thread(target=call, args=(i, f"{base}@first_byte_ms=30")))
        threads[-1].start()
        assert wait_until(lambda n=i + 1: waiting(engine, t.tag) == n, 10), f"waiter {i}"
    for thread in threads:
        thread.join(60)
    assert finished == [-1, *range(waiters)]
    assert headers[-1] == "0"  # admitted at once: it did not wait
    assert all(int(headers[i]) > 0 for i in range(waiters))
    assert waiting(engine, t.tag) == 0
    counter = engine.counter(t.tag, "tenant")
    bill = billed(mock_upstream, base)
    assert counter.pending == 0 and counter.used == bill["total_tokens"]
    rows = ledger_rows(django_db_blocker, engine, t.tenant_id)
    assert len(rows) == len({r.request_id for r in rows}) == waiters + 1 == bill["requests"]
    assert sum(r.input_tokens + r.output_tokens for r in rows) == bill["total_tokens"]


def test_queue_full_and_a_client_that_leaves(
    bounded_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(plan=queue_plan(django_db_blocker, 30), key_options={"max_concurrency": 1})
    base = unique_model("queue-full")
    holder = threading.Thread(target=lambda: client_for(bounded_gateway, t.plaintext).chat
                              .completions.create(model=f"{base}@first_byte_ms=10000",
                                                  messages=MESSAGES, max_tokens=5))
    holder.start()  # it holds the key's one slot while the steps below run (10 s of margin)
    assert wait_until(lambda: len(engine.open_hold_ids(t.tag)) == 1)

    # A client that gives up after 0.5 s: its waiter leaves the queue.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{bounded_gateway.base_url}/chat/completions", timeout=0.5,
                   headers={"Authorization": f"Bearer {t.plaintext}"},
                   json={"model": f"{base}@first_byte_ms=1", "messages": MESSAGES,
                         "max_tokens": 5})
    assert wait_until(lambda: waiting(engine, t.tag) == 0, 5)

    # Four waiters fill the bound; the fifth is refused at once with queue_full.
    results: list[Any] = []

    def queued() -> None:
        raw = client_for(bounded_gateway, t.plaintext, timeout=60).chat.completions \
            .with_raw_response.create(model=f"{base}@first_byte_ms=1", messages=MESSAGES,
                                      max_tokens=5)
        results.append(raw)

    threads = [threading.Thread(target=queued) for _ in range(4)]
    for i, thread in enumerate(threads):
        thread.start()
        assert wait_until(lambda n=i + 1: waiting(engine, t.tag) == n, 10)
    with pytest.raises(openai.RateLimitError) as info:
        client_for(bounded_gateway, t.plaintext).chat.completions.create(
            model=f"{base}@first_byte_ms=1", messages=MESSAGES, max_tokens=5)
    assert info.value.code == "queue_full"
    assert info.value.response.headers["Retry-After"] == "1"
    holder.join(30)
    for thread in threads:
        thread.join(30)
    assert len(results) == 4 and all(int(r.headers[WAIT_HEADER]) > 0 for r in results)
    refused = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
    assert refused.get("queue_full") == "1"
    assert engine.counter(t.tag, "tenant").pending == 0 and waiting(engine, t.tag) == 0


def test_queue_timeout_is_its_own_refusal(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(plan=queue_plan(django_db_blocker, 1), key_options={"max_concurrency": 1})
    base = unique_model("queue-timeout")
    holder = threading.Thread(target=lambda: client_for(gateway, t.plaintext).chat.completions
                              .create(model=f"{base}@first_byte_ms=3000", messages=MESSAGES,
                                      max_tokens=5))
    holder.start()
    assert wait_until(lambda: len(engine.open_hold_ids(t.tag)) == 1)
    with pytest.raises(openai.RateLimitError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model=f"{base}@first_byte_ms=1", messages=MESSAGES, max_tokens=5)
    assert info.value.code == "queue_timeout"
    assert info.value.body["type"] == "requests"
    assert info.value.response.headers["Retry-After"] == "1"
    holder.join(30)
    assert waiting(engine, t.tag) == 0
    refused = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
    assert refused.get("queue_timeout") == "1"
    assert engine.counter(t.tag, "tenant").pending == 0


def test_a_call_that_can_never_fit_is_refused_at_once(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    """Under the queue policy, a call bigger than the daily limit is not queued (it would head
    the queue and block the tenant's other calls until its timeout): 429 insufficient_quota at
    once, counted under its counter's reason; a small call of the tenant is admitted after it."""
    name = f"q-{uuid.uuid4().hex[:8]}"
    committed(django_db_blocker, lambda: Plan.objects.create(
        name=name, display_name=name, tokens_per_day=300, requests_per_second=-1,
        over_quota_policy="queue", queue_timeout_seconds=30, queue_priority=10,
        shrink_hold_to_headroom=False))
    t = make_tenant(plan=name)
    model = unique_model("never-fits")
    with pytest.raises(openai.RateLimitError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=1000)
    assert info.value.code == "insufficient_quota"
    assert waiting(engine, t.tag) == 0
    small = client_for(gateway, t.plaintext).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=5)
    assert small.headers[WAIT_HEADER] == "0"
    refused = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
    assert refused.get("quota_tenant") == "1" and "queue_timeout" not in refused
    assert engine.counter(t.tag, "tenant").pending == 0
    # One ledger row: the small call's (the refused one reached no upstream).
    rows = ledger_rows(django_db_blocker, engine, t.tenant_id)
    assert [r.request_id for r in rows] == [small.headers["x-request-id"]]


def test_a_race_of_queued_calls_keeps_the_money_exact(
    bounded_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any, mock_upstream: MockUpstream,
) -> None:
    calls = 40
    base = unique_model("queue-race")
    model = f"{base}@first_byte_ms=200"
    # Room for a handful of calls in the day: the rest wait, time out or find the queue full.
    t = make_tenant(plan=queue_plan(django_db_blocker, 2), tokens_per_day=150)

    async def one(client: openai.AsyncOpenAI) -> tuple[str, Any]:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, max_tokens=5)
        except openai.RateLimitError as error:
            return str(error.code), None
        return "admitted", raw

    async def race() -> list[tuple[str, Any]]:
        client = async_client_for(bounded_gateway, t.plaintext, timeout=30)
        return await asyncio.gather(*(one(client) for _ in range(calls)))

    outcomes = asyncio.run(race())
    kinds = [k for k, _ in outcomes]
    assert set(kinds) <= {"admitted", "queue_timeout", "queue_full"}
    admitted = [raw for k, raw in outcomes if k == "admitted"]
    assert admitted and all(WAIT_HEADER in raw.headers for raw in admitted)
    counter = engine.counter(t.tag, "tenant")
    bill = billed(mock_upstream, base)
    assert counter.pending == 0 and counter.used == bill["total_tokens"] <= 150
    assert bill["requests"] == len(admitted)
    rows = ledger_rows(django_db_blocker, engine, t.tenant_id)
    assert len(rows) == len({r.request_id for r in rows}) == len(admitted)
    assert sum(r.input_tokens + r.output_tokens for r in rows) == bill["total_tokens"]
    assert waiting(engine, t.tag) == 0
    refused = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
    assert sum(int(v) for v in refused.values()) == calls - len(admitted)
    print(f"\nqueue race through the gateway: {dict((k, kinds.count(k)) for k in set(kinds))}")


@contextmanager
def only_capped_key(django_db_blocker: Any, mock_upstream: MockUpstream, gateway: GatewayServer,
                    tmp_path: Any, rpm: int, check_key: str) -> Iterator[tuple[Any, str, Any]]:
    """A provider key allowing `rpm` requests a minute, the only key serving a new model (the
    session's shared key, which serves every model, is disabled meanwhile), and a gateway started
    with it: (the key, the model, the gateway). Afterwards the shared key is back and the session
    gateway serves again (checked with `check_key`)."""
    from gateway.models import ProviderKey
    from gateway.prices import Price
    from gateway.providers import create_provider_key, delete_provider_key, update_provider_key
    from tests.gateway.conftest import MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE

    model = unique_model("queue-cap")
    cap = committed(django_db_blocker, lambda: create_provider_key(
        f"cap-{uuid.uuid4().hex[:6]}", base_url=mock_upstream.base_url,
        secret="sk-capacity-upstream-key", models=[model], rpm_capacity=rpm,
        default_price=Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)))

    def shared_enabled(enabled: bool) -> None:
        def work() -> None:
            shared = ProviderKey.objects.get(name="mock")
            shared.enabled = enabled
            update_provider_key(shared, ["enabled"], actor="test")
        committed(django_db_blocker, work)

    shared_enabled(False)
    server = start_gateway(tmp_path, workers=2)
    try:
        yield cap, model, server
    finally:
        server.stop()
        shared_enabled(True)
        committed(django_db_blocker, lambda: delete_provider_key(
            ProviderKey.objects.get(pk=cap.pk), actor="test"))

        def serves_again() -> bool:
            try:
                client_for(gateway, check_key).chat.completions.create(
                    model="gpt-4o-mini", messages=MESSAGES, max_tokens=1)
            except openai.OpenAIError:
                return False
            return True
        # The session gateway has the shared key back before the next test.
        assert wait_until(serves_again, 10)


def drain_capacity(engine: QuotaEngine, key_id: int, rpm: int) -> None:
    while engine.take_capacity(key_id, rpm, None, 1).taken:
        pass


def test_two_plans_waiting_for_one_provider_key_the_higher_first(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any, mock_upstream: MockUpstream, tmp_path: Any,
) -> None:
    """Shared capacity: one provider key allows 15 requests a minute (one each 4 s) and is the
    only key serving the model; tenants of a standard-like plan (priority 10) and an
    enterprise-like one (20) wait for it, arriving in turn: every enterprise call is served
    before every standard one, each plan in arrival order. (All four must be queued before the
    first slot comes back: 4 s leaves a loaded machine room; 2 s did not always.)"""
    rpm = 15
    low = make_tenant(plan=queue_plan(django_db_blocker, 40, priority=10))
    high = make_tenant(plan=queue_plan(django_db_blocker, 40, priority=20))
    with only_capped_key(django_db_blocker, mock_upstream, gateway, tmp_path, rpm,
                         low.plaintext) as (cap, model, server):
        drain_capacity(engine, cap.pk, rpm)  # the next request comes in 4 s
        finished: list[str] = []
        lock = threading.Lock()

        def call(name: str, key: str) -> None:
            client_for(server, key, timeout=60).chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=5)
            with lock:
                finished.append(name)

        arrivals = [("std-0", low), ("ent-0", high), ("std-1", low), ("ent-1", high)]
        threads = []
        for n, (name, tenant) in enumerate(arrivals, start=1):
            threads.append(threading.Thread(target=call, args=(name, tenant.plaintext)))
            threads[-1].start()
            assert wait_until(
                lambda n=n: engine.client.zcard(keys.provider_queue_key(cap.pk)) == n, 10)
        for thread in threads:
            thread.join(60)
        assert finished == ["ent-0", "ent-1", "std-0", "std-1"]
        assert engine.client.zcard(keys.provider_waiters_key(cap.pk)) == 0
        for tenant in (low, high):
            assert engine.counter(tenant.tag, "tenant").pending == 0


def test_waiting_for_a_provider_key_times_out_or_ends_with_its_client(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any, mock_upstream: MockUpstream, tmp_path: Any,
) -> None:
    """The key allows one request a minute and has none left: a queued call gives up after its
    plan's 2 s (429 queue_timeout, its hold released, the refusal counted); a call whose client
    leaves is taken out of the key's queue and its hold released."""
    rpm = 1
    t = make_tenant(plan=queue_plan(django_db_blocker, 2))
    patient = make_tenant(plan=queue_plan(django_db_blocker, 30))
    with only_capped_key(django_db_blocker, mock_upstream, gateway, tmp_path, rpm,
                         t.plaintext) as (cap, model, server):
        drain_capacity(engine, cap.pk, rpm)
        with pytest.raises(openai.RateLimitError) as info:
            client_for(server, t.plaintext, timeout=30).chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=5)
        assert info.value.code == "queue_timeout"
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert engine.client.zcard(keys.provider_waiters_key(cap.pk)) == 0
        assert engine.counter(t.tag, "tenant").pending == 0
        refused = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
        assert refused.get("queue_timeout") == "1"

        # A client that gives up after 3 s, while its call waits in the key's queue (its plan
        # would wait 30 s).
        gone: list[type[BaseException]] = []

        def leaving() -> None:
            try:
                httpx.post(f"{server.base_url}/chat/completions", timeout=3,
                           headers={"Authorization": f"Bearer {patient.plaintext}"},
                           json={"model": model, "messages": MESSAGES, "max_tokens": 5})
            except httpx.ReadTimeout as error:
                gone.append(type(error))

        thread = threading.Thread(target=leaving)
        thread.start()
        assert wait_until(lambda: engine.client.zcard(keys.provider_queue_key(cap.pk)) == 1, 5)
        assert len(engine.open_hold_ids(patient.tag)) == 1  # admitted, waiting for the key
        thread.join(10)
        assert gone == [httpx.ReadTimeout]
        assert wait_until(lambda: engine.client.zcard(keys.provider_queue_key(cap.pk)) == 0, 5)
        assert wait_until(lambda: engine.open_hold_ids(patient.tag) == [], 5)
        assert engine.counter(patient.tag, "tenant").pending == 0
