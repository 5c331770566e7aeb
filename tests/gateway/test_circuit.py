"""gateway/circuit.py on the session's Redis and PostgreSQL, inside one process: successes stay
in process until the flush, a failure is recorded at once and its transition reaches the pool,
the channel and the audit trail; probes after the cool-down; PostgreSQL down loses only the
audit row (logged), never the breaker or the call."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio
from django.db import OperationalError, connection

from gateway.circuit import NO_PROBE, Circuit, Ticket
from gateway.providers import KEY_BREAKER, ProviderPool, Upstream, create_provider_key
from gateway.runtime import Database
from quotas.breakers import AsyncBreakerStore, BreakerRules, BreakerStore
from quotas.keys import PROVIDER_BREAKER_CHANNEL
from quotas.runtime import get_engine
from tenants.models import AuditEvent

MODEL = "gpt-4o"
RULES = BreakerRules(window_ms=60_000, min_calls=3, error_percent=50, cooldown_ms=150,
                     probes=1, lease_ms=60_000)


class Runtime:
    """The parts of GatewayRuntime a Circuit uses, with its real detach and a real Database."""

    def __init__(self, pool: ProviderPool, db: Any) -> None:
        self.pool = pool
        self.db = db
        self.background: set[asyncio.Future[Any]] = set()

    def detach(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def spawn(self, factory: Callable[[], Any]) -> None:
        self.detach(factory())

    async def settle(self) -> None:
        """Wait for the detached work (records, publishes, audits) to finish."""
        for _ in range(10):
            if not self.background:
                return
            await asyncio.wait(set(self.background), timeout=1)
        raise AssertionError(f"detached work still running: {self.background}")


class DatabaseDown(Database):
    """Injected fault: PostgreSQL unreachable."""

    async def run(self, work: Callable[..., Any], *args: Any) -> Any:
        raise OperationalError("injected: database unreachable")


def _upstream(provider: Any) -> Upstream:
    return Upstream(id=provider.pk, public_id=provider.public_id, base_url="http://u",
                    secret="s", rpm_capacity=None, tpm_capacity=None)


def _run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


async def _circuit(redis_url: str, upstream: Upstream, db: Any,
                   ) -> tuple[Circuit, Runtime, redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    runtime = Runtime(ProviderPool([upstream]), db)
    circuit = Circuit(runtime, AsyncBreakerStore(client), RULES, flush_s=3600)  # type: ignore[arg-type]
    return circuit, runtime, client


@pytest.fixture
def provider() -> Any:
    # In the test's transaction: the breakers need only its id (the audit rows name it).
    return create_provider_key(f"circuit-{uuid.uuid4().hex[:8]}",
                               base_url="https://u.example/v1", secret="sk-circuit-test-secret")


def _take_audit_rows(public_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The breaker audit rows of a key, then deleted: the database thread committed them (on
    its own connection, outside the test's transaction), and tests leave no data behind."""
    found = AuditEvent.objects.filter(target=public_id, action__startswith="provider_key.breaker_")
    rows = [(e.action, e.actor, e.data) for e in found.order_by("id")]
    found.delete()
    return rows


def _snapshot(provider_id: int, model: str) -> Any:
    return next(b for b in BreakerStore(get_engine().client).snapshots(provider_id)
                if b.model == model)


@pytest.mark.django_db
def test_successes_cost_nothing_until_the_flush(redis_url: str, provider: Any) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, Database(1))
        for _ in range(5):
            circuit.ok(upstream, MODEL)
        assert circuit.pending == {(upstream.id, MODEL): 5}
        assert _snapshot(upstream.id, KEY_BREAKER).calls == 0  # nothing in Redis yet
        await circuit.flush()
        assert circuit.pending == {}
        await client.aclose()
        await runtime.db.run(lambda: connection.close())
        for task in list(runtime.background):
            task.cancel()  # the flusher loop

    _run(test)
    assert (_snapshot(provider.pk, KEY_BREAKER).calls, _snapshot(provider.pk, MODEL).calls) \
        == (5, 5)


@pytest.mark.django_db
def test_a_failure_opens_at_once_published_and_audited(redis_url: str, provider: Any) -> None:
    upstream = _upstream(provider)
    heard: list[dict[str, Any]] = []
    audited: list[tuple[str, str, dict[str, Any]]] = []

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, Database(1))
        pubsub = client.pubsub()
        await pubsub.subscribe(PROVIDER_BREAKER_CHANNEL)
        # One success not flushed yet (as ok() leaves it, without starting the flusher loop,
        # which settle() would wait for): it goes with the first failure.
        circuit.pending[(upstream.id, MODEL)] = 1
        for _ in range(2):
            await circuit.report(upstream, MODEL, NO_PROBE, server_failed=True)
        await runtime.settle()
        assert _snapshot(upstream.id, MODEL).state == "open"
        assert runtime.pool.breakers_due(upstream.id, MODEL, 0.0) == []
        assert runtime.pool.breakers_due(upstream.id, "other", 0.0) is None
        # The first read may be the subscription's confirmation (returned as None).
        for _ in range(3):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                heard.append(json.loads(message["data"]))
        await pubsub.aclose()
        await client.aclose()
        audited.extend(await runtime.db.run(_take_audit_rows, upstream.public_id))
        await runtime.db.run(lambda: connection.close())  # the database thread's own

    _run(test)
    assert [(m["id"], m["model"], m["state"]) for m in heard] == [(provider.pk, MODEL, "open")]
    [(action, actor, data)] = audited
    assert (action, actor) == ("provider_key.breaker_opened", "gateway")
    assert data == {"breaker": "model", "model": MODEL, "calls": 3, "errors": 2,
                    "open_seconds": pytest.approx(0.15, abs=0.01)}


@pytest.mark.django_db
def test_probes_after_the_cooldown_close_it(redis_url: str, provider: Any) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        for _ in range(3):
            await circuit.report(upstream, MODEL, NO_PROBE, transport_failed=True)
        assert runtime.pool.breakers_due(upstream.id, MODEL, 1e12) == [KEY_BREAKER]
        await asyncio.sleep(RULES.cooldown_ms / 1000 + 0.05)
        ticket = await circuit.admit(upstream, MODEL, [KEY_BREAKER])
        assert ticket == Ticket(key=True)
        # The one slot is taken: another call skips the key.
        assert await circuit.admit(upstream, MODEL, [KEY_BREAKER]) is None
        await circuit.report(upstream, MODEL, ticket)
        await runtime.settle()
        assert runtime.pool.breakers() == {}
        await client.aclose()

    _run(test)
    breaker = _snapshot(provider.pk, KEY_BREAKER)
    assert (breaker.state, breaker.opened, breaker.half_opened, breaker.closed) == (
        "closed", 1, 1, 1)


@pytest.mark.django_db
def test_postgresql_down_loses_only_the_audit_row(redis_url: str, provider: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        for _ in range(3):
            await circuit.report(upstream, MODEL, NO_PROBE, transport_failed=True)
        await runtime.settle()
        assert runtime.pool.breakers_due(upstream.id, MODEL, 0.0) == []
        await client.aclose()

    with caplog.at_level(logging.ERROR, logger="gateway.circuit"):
        _run(test)
    assert _snapshot(provider.pk, KEY_BREAKER).state == "open"
    [record] = [r for r in caplog.records if "not recorded" in r.getMessage()]
    assert "provider_key.breaker_opened" in record.getMessage()
    assert provider.public_id in record.getMessage()
    assert not AuditEvent.objects.filter(target=provider.public_id,
                                         action__startswith="provider_key.breaker_").exists()


async def _open_both(circuit: Circuit, upstream: Upstream) -> None:
    """Open the (key, model) breaker (5xx answers, which the key's counts as successes), then
    the key's own (transport failures: 3 of 6 calls), and wait out the cool-down."""
    for _ in range(3):
        await circuit.report(upstream, MODEL, NO_PROBE, server_failed=True)
    for _ in range(3):
        await circuit.report(upstream, MODEL, NO_PROBE, transport_failed=True)
    await asyncio.sleep(RULES.cooldown_ms / 1000 + 0.05)


@pytest.mark.django_db
def test_a_refused_second_slot_hands_the_first_back(redis_url: str, provider: Any) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        await _open_both(circuit, upstream)
        assert runtime.pool.breakers_due(upstream.id, MODEL, 1e12) == [KEY_BREAKER, MODEL]
        # Another call (another worker) holds the model breaker's one slot.
        assert (await circuit.store.probe(upstream.id, MODEL, RULES)).granted
        assert await circuit.admit(upstream, MODEL, [KEY_BREAKER, MODEL]) is None
        await runtime.settle()
        # The key's slot this call took first is free again: a call for another model gets it.
        assert await circuit.admit(upstream, "other", [KEY_BREAKER]) == Ticket(key=True)
        await client.aclose()

    _run(test)


@pytest.mark.django_db
def test_a_ticket_given_back_frees_its_slots_once(redis_url: str, provider: Any) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        await _open_both(circuit, upstream)
        ticket = await circuit.admit(upstream, MODEL, [KEY_BREAKER, MODEL])
        assert ticket == Ticket(key=True, model=True)
        assert await circuit.admit(upstream, MODEL, [KEY_BREAKER, MODEL]) is None
        await runtime.settle()
        circuit.give_back(upstream, MODEL, ticket)  # e.g. no RPM capacity on the key
        circuit.give_back(upstream, MODEL, ticket)  # a second time: nothing more
        circuit.give_back(upstream, MODEL, NO_PROBE)  # a plain call: no script call
        assert len(runtime.background) == 1
        await runtime.settle()
        again = await circuit.admit(upstream, MODEL, [KEY_BREAKER, MODEL])
        assert again == Ticket(key=True, model=True)
        await circuit.report(upstream, MODEL, again)
        await runtime.settle()
        circuit.give_back(upstream, MODEL, again)  # reported: nothing to hand back
        assert not runtime.background
        await client.aclose()

    _run(test)
    assert (_snapshot(provider.pk, KEY_BREAKER).state, _snapshot(provider.pk, MODEL).state) \
        == ("closed", "closed")


@pytest.mark.django_db
def test_a_transport_failure_is_no_result_for_a_model_probe(redis_url: str,
                                                            provider: Any) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        for _ in range(3):
            await circuit.report(upstream, MODEL, NO_PROBE, server_failed=True)
        await asyncio.sleep(RULES.cooldown_ms / 1000 + 0.05)
        ticket = await circuit.admit(upstream, MODEL, [MODEL])
        assert ticket == Ticket(model=True)
        await circuit.report(upstream, MODEL, ticket, transport_failed=True)
        await runtime.settle()
        # The upstream never answered: the model's breaker is still half-open, its one slot
        # free for the next call (which finds the upstream healed and closes it).
        assert _snapshot(upstream.id, MODEL).state == "half_open"
        healed = await circuit.admit(upstream, MODEL, [MODEL])
        assert healed == Ticket(model=True)
        await circuit.report(upstream, MODEL, healed)
        await runtime.settle()
        await client.aclose()

    _run(test)
    model = _snapshot(provider.pk, MODEL)
    assert (model.state, model.opened, model.half_opened, model.closed) == ("closed", 1, 1, 1)
    key = _snapshot(provider.pk, KEY_BREAKER)
    assert (key.state, key.calls, key.errors) == ("closed", 5, 1)


@pytest.mark.parametrize("breaker", [KEY_BREAKER, MODEL])
@pytest.mark.django_db
def test_a_probes_record_leaves_the_pending_successes_to_the_flush(
        redis_url: str, provider: Any, breaker: str) -> None:
    upstream = _upstream(provider)

    async def test() -> None:
        circuit, runtime, client = await _circuit(redis_url, upstream, DatabaseDown(1))
        failure = {"transport_failed": True} if breaker == KEY_BREAKER else \
            {"server_failed": True}
        for _ in range(3):
            await circuit.report(upstream, MODEL, NO_PROBE, **failure)
        await asyncio.sleep(RULES.cooldown_ms / 1000 + 0.05)
        ticket = await circuit.admit(upstream, MODEL, [breaker])
        assert ticket
        # Four successes counted in process and not flushed yet when the probe's result comes.
        circuit.pending[(upstream.id, MODEL)] = 4
        await circuit.report(upstream, MODEL, ticket)  # closes the breaker (one probe)
        await runtime.settle()
        await circuit.flush()
        await client.aclose()

    _run(test)
    key, model = _snapshot(provider.pk, KEY_BREAKER), _snapshot(provider.pk, MODEL)
    assert (key.state, model.state) == ("closed", "closed")
    if breaker == KEY_BREAKER:  # the key's new window: the 4; the model's: the probe + 4
        assert (key.calls, model.calls) == (4, 5)
    else:  # the key's window: 3 + the probe + 4; the model's new window: the 4
        assert (key.calls, model.calls) == (8, 4)
