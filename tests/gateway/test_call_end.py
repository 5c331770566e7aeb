"""The end of a call, in process: the gateway's own Call / StreamRelay code over the session's
real Redis, with the upstream's answer made in the test (httpx responses over byte iterators the
test controls) and faults injected around the real engine (a settle held back, a Redis pool
drained by the test, Redis "unreachable" for the first attempts). Every scenario then reads the
tenant's counters and usage stream: each hold ended exactly once, with what was delivered.

Settings validation runs `config.settings` in a subprocess, like tests/test_settings.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis.asyncio
import redis.exceptions
from django.conf import settings as django_settings

from gateway.admission import Admission, Estimate
from gateway.bodies import Endpoint, parse_body
from gateway.catalog import fallback_model_info
from gateway.forward import (
    SETTLED_BEFORE_BODY,
    Call,
    StreamRelay,
    UnmeteredBacklog,
    UnmeteredUsage,
    _complete,
    _retry_end,
)
from gateway.dialects import openai_text as _text_of
from gateway.prices import Price
from gateway.runtime import GatewayRuntime
from gateway.tokens import count_stream_text
from gateway.usage import Usage
from quotas.client import make_async_redis, make_redis
from quotas.engine import (
    AsyncQuotaEngine,
    EngineSettings,
    QuotaEngine,
    QuotaStoreUnavailable,
    Reservation,
    ReserveRequest,
    ScopeLimit,
    SettleResult,
)
from quotas.keys import hold_key, usage_stream_key
from quotas.windows import WindowKind
from quotas.script_pool import ScriptPool
from tests.support.script_sends import packed_sends

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = "o200k_base"
INFO = replace(fallback_model_info("gpt-4o"), tokenizer=TOKENIZER)
PRICE = Price(2_500_000, 10_000_000)
PROMPT_TOKENS = 10
HELD = 200
LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)


# -- building a call over the real engine ------------------------------------------------------


def new_tenant() -> str:
    return f"ce{uuid.uuid4().hex[:12]}"


def async_engine(client: Any = None) -> AsyncQuotaEngine:
    return AsyncQuotaEngine(client or make_async_redis(), EngineSettings.from_django())


def runtime_for(engine: Any) -> GatewayRuntime:
    """A worker runtime with only what ending a call uses: the engine and the task set."""
    return GatewayRuntime(engine=engine, http=None, transport=None, auth=None,  # type: ignore[arg-type]
                          catalog=None, pool=None, db=None)  # type: ignore[arg-type]


async def open_call(engine: Any, tenant: str, *, stream: bool, metered: bool = True,
                    content: Any = "count these words") -> Call:
    """A Call whose hold was just reserved in Redis (or, metered=False, a fail-open call)."""
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    body: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    parsed = parse_body(Endpoint.CHAT, json.dumps(body).encode())
    ctx = SimpleNamespace(tenant_id=0, tenant_tag=tenant, project=SimpleNamespace(pk=7),
                          api_key=SimpleNamespace(pk=8))
    if metered:
        reservation = await engine.reserve(ReserveRequest(
            tenant, request_id, HELD, LIMITS, meta=json.dumps({"m": "gpt-4o"}),
            input_tokens=PROMPT_TOKENS, price_in=PRICE.input_micros_per_mtok,
            price_out=PRICE.output_micros_per_mtok))
        assert reservation.admitted
    else:
        reservation = Reservation(admitted=True, request_id=request_id, granted=0, counters=(),
                                  refused=None, server_time_ms=0, hold=None)
    estimate = Estimate(info=INFO, prompt_tokens=PROMPT_TOKENS, amount=HELD, output_cap=None,
                        price=PRICE)
    admission = Admission(reservation, "gpt-4o", estimate, None)
    call = Call(runtime_for(engine), ctx, parsed, admission, request_id,  # type: ignore[arg-type]
                0.0, {})
    call.sent = True  # as forward() marks it when handing the request to the upstream
    return call


# A whole chat answer of 12 input and 3 output tokens, as the upstream sends it.
ANSWER_12_3 = json.dumps({
    "id": "c1", "object": "chat.completion", "model": "gpt-4o", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}).encode()


async def _answered_12_3(engine: Any, tenant: str) -> tuple[Call, Any]:
    """A plain call whose settle was packed while the upstream answered, completed with the
    12 + 3 answer (its settle written as the answer is made): the call and its answer."""
    call = await open_call(engine, tenant, stream=False)
    call.prepare_settle()
    return call, await _complete(call, httpx.Response(200, content=ANSWER_12_3))


async def settled_background(call: Call) -> None:
    """Wait for every task the call left running (its end, retries, checkpoints, drains)."""
    while call.runtime.background:
        await asyncio.gather(*list(call.runtime.background), return_exceptions=True)


def usage_events(tenant: str) -> list[dict[str, Any]]:
    client = make_redis()
    try:
        events = []
        for _, fields in client.xrange(usage_stream_key(tenant)):
            entry = dict(fields)
            entry["event"] = json.loads(entry["event"]) if entry.get("event") else {}
            events.append(entry)
        return events
    finally:
        client.close()


def counter(tenant: str) -> tuple[int, int]:
    state = QuotaEngine(make_redis()).counter(tenant, "tenant")
    return state.used, state.pending


# -- a fake upstream answer, chunk by chunk ------------------------------------------------------


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def delta(content: Any = None, *, role: str | None = None, finish: str | None = None) -> bytes:
    message: dict[str, Any] = {}
    if role is not None:
        message["role"] = role
    if content is not None:
        message["content"] = content
    return sse({"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o",
                "choices": [{"index": 0, "delta": message, "finish_reason": finish}]})


def usage_chunk(prompt: int, completion: int) -> bytes:
    return sse({"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o", "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}})


DONE = sse(b"[DONE]")
WORDS = ["mock", " reply", " the", " quick", " brown", " fox", " jumps", " over"]


async def chunks_of(parts: list[bytes], gate: asyncio.Event | None = None,
                    gate_after: int = 0) -> AsyncIterator[bytes]:
    """The parts one by one; with a gate, the upstream stalls after `gate_after` parts until
    the test opens it."""
    for index, part in enumerate(parts):
        if gate is not None and index == gate_after:
            await gate.wait()
        yield part


async def consume(relay: StreamRelay, received: list[bytes]) -> None:
    async for part in relay.relay():
        received.append(part)


def delivered_text(received: list[bytes]) -> str:
    texts = []
    for part in received:
        for line in part.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                texts.append(_text_of(Endpoint.CHAT, json.loads(line[5:])))
    return "".join(texts)


# -- faults around the real engine ---------------------------------------------------------------


class Wrapped:
    """The real async engine, with some of its calls replaced by the test (fault injection)."""

    def __init__(self, engine: AsyncQuotaEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class HeldBackSettle(Wrapped):
    """settle() starts, says so, and reaches Redis only when the test lets it."""

    def __init__(self, engine: AsyncQuotaEngine) -> None:
        super().__init__(engine)
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def settle(self, *args: Any, **kwargs: Any) -> SettleResult:
        self.entered.set()
        await self.go.wait()
        return await self.engine.settle(*args, **kwargs)


class Unreachable(Wrapped):
    """The named operation fails as if Redis were down for its first `failures` attempts."""

    def __init__(self, engine: AsyncQuotaEngine, operation: str, failures: int) -> None:
        super().__init__(engine)
        self.operation = operation
        self.failures = failures
        self.attempts = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.engine, name)
        if name != self.operation:
            return real

        async def flaky(*args: Any, **kwargs: Any) -> Any:
            self.attempts += 1
            if self.attempts <= self.failures:
                raise QuotaStoreUnavailable("injected: Redis unreachable")
            return await real(*args, **kwargs)

        return flaky


class CountingProgress(Wrapped):
    """Counts progress writes and how many were in flight at once; each takes `delay` s."""

    def __init__(self, engine: AsyncQuotaEngine, delay: float = 0.0) -> None:
        super().__init__(engine)
        self.delay = delay
        self.calls: list[tuple[str, int]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def progress(self, hold: Any, phase: Any, output_tokens: int = 0,
                       upstream: int | None = None) -> str:
        self.calls.append((str(phase), output_tokens))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return await self.engine.progress(hold, phase, output_tokens, upstream)
        finally:
            self.in_flight -= 1


async def hold_fields(engine: AsyncQuotaEngine, call: Call) -> dict[str, str]:
    return await engine.client.hgetall(hold_key(call.ctx.tenant_tag, call.request_id))


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await check():
            return True
        await asyncio.sleep(0.02)
    return await check()


# -- 1. ending a hold cannot be cancelled ----------------------------------------------------------


def test_a_client_leaving_after_done_while_the_settle_is_held_back_still_settles() -> None:
    tenant = new_tenant()

    async def scenario() -> list[bytes]:
        engine = HeldBackSettle(async_engine())
        call = await open_call(engine, tenant, stream=True)
        upstream = httpx.Response(200, content=chunks_of(
            [delta("", role="assistant"), delta("mock"), delta(" reply"), delta(finish="stop"),
             usage_chunk(12, 2), DONE]))
        received: list[bytes] = []
        client = asyncio.create_task(consume(StreamRelay(call, upstream), received))
        await asyncio.wait_for(engine.entered.wait(), 10)  # [DONE] is out; the settle began
        assert received[-1] == DONE
        client.cancel()  # the client leaves now (the ASGI task is cancelled)
        with pytest.raises(asyncio.CancelledError):
            await client
        engine.go.set()
        await settled_background(call)
        return received

    received = asyncio.run(scenario())
    assert delivered_text(received) == "mock reply"
    [event] = usage_events(tenant)
    assert event["outcome"] == "settled"
    assert (event["event"]["in"], event["event"]["out"], event["event"]["outcome"]) == (
        12, 2, "complete")
    assert counter(tenant) == (14, 0)


@pytest.mark.parametrize("pool_kind", ["redis-py", "scripts"])
def test_a_client_leaving_while_the_settle_waits_for_a_redis_connection_still_settles(
        pool_kind: str) -> None:
    """The settle's Redis pool wait: a pool of one connection, held by the test at that moment.
    Once with redis-py's blocking pool, once with the gateway's client, whose scripts have a pool
    of their own (quotas/script_pool.py)."""
    tenant = new_tenant()

    async def scenario() -> None:
        if pool_kind == "redis-py":
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                django_settings.REDIS_URL, max_connections=1, timeout=30, decode_responses=True)
            engine = async_engine(redis.asyncio.Redis(connection_pool=pool))
            take, give, close = pool.get_connection, pool.release, pool.disconnect
        else:
            gateway_client = make_async_redis()
            scripts = gateway_client.scripts
            assert scripts is not None
            scripts.size, scripts.wait_timeout = 1, 30.0
            engine = async_engine(gateway_client)

            async def take() -> Any:
                return await scripts._take(asyncio.get_running_loop())

            async def give(conn: Any) -> None:
                scripts._give(conn, scripts.generation)

            close = gateway_client.aclose
        call = await open_call(engine, tenant, stream=True)
        parts = [delta("mock"), delta(" reply"), delta(" the"), usage_chunk(12, 3), DONE]
        received: list[bytes] = []
        client = asyncio.create_task(consume(
            StreamRelay(call, httpx.Response(200, content=chunks_of(parts))), received))
        taken = await take()  # the pool is empty from here on
        assert await eventually(lambda: _true(call.ended))
        assert received[-1] == DONE
        await asyncio.sleep(0.05)  # the settle is queued for a connection
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        await give(taken)
        await settled_background(call)
        await close()

    asyncio.run(scenario())
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["out"]) == ("settled", 3)
    assert counter(tenant) == (15, 0)


async def _true(value: bool) -> bool:
    return value


def test_a_second_end_waits_for_the_first_and_changes_nothing() -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        call = await open_call(async_engine(), tenant, stream=False)
        await asyncio.gather(call.settle(Usage(10, 5)), call.release(502, "late"),
                             call.settle(Usage(1, 1)))
        await settled_background(call)

    asyncio.run(scenario())
    assert [(e["outcome"], e["event"]["out"]) for e in usage_events(tenant)] == [("settled", 5)]
    assert counter(tenant) == (15, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_settle_packed_while_the_upstream_answered_is_what_the_end_sends(
        stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """forward schedules Call.prepare_ahead, and so prepare_settle, as the request goes
    upstream: the hold's settle packed but for its figures (quotas: PackedSettle). The end
    sends it as it is, and the counters and the usage event are those of the plain settle."""
    tenant = new_tenant()
    sent = packed_sends(monkeypatch)

    async def scenario() -> None:
        call = await open_call(async_engine(), tenant, stream=stream)
        call.prepare_settle()
        packed = call._packed_settle
        assert packed is not None and packed.hold is call.admission.reservation.hold
        sent.clear()
        if stream:
            received: list[bytes] = []
            parts = [delta("x"), usage_chunk(12, 3), DONE]
            await consume(StreamRelay(call, httpx.Response(200, content=chunks_of(parts))),
                          received)
        else:
            await _complete(call, httpx.Response(200, content=ANSWER_12_3))
        await settled_background(call)
        # Sent as packed, once (a server without the script yet is then sent the same command
        # by redis-py's script object, which loads it: not counted here).
        settles = [c for c in sent if call.request_id.encode() in c]
        assert len(settles) == 1 and settles[0].startswith(packed.head)
        call.prepare_settle()  # after the end began: nothing more is made
        assert call._packed_settle is packed

    asyncio.run(scenario())
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["in"], event["event"]["out"]) == ("settled", 12, 3)
    assert counter(tenant) == (15, 0)


@pytest.mark.parametrize("fault", [None, "connection_lost", "cancelled"])
def test_a_settle_written_before_the_answer_is_made_settles_once(
        fault: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """_complete writes the hold's settle to Redis at once (Call.begin_settle, quotas:
    send_settle on a free script connection) and makes the answer while Redis runs it; the
    end's task only waits for the reply. The hold is charged the upstream's usage once: as it
    is, when the connection breaks right after the write (the settle is sent once more on a
    new connection; the script is idempotent per request id), and when the client leaves
    while the reply is on its way (the end's task is shielded from it)."""
    tenant = new_tenant()
    written: list[Any] = []
    real_now = ScriptPool.send_now

    def send_now(self: ScriptPool, command: bytes) -> Any:
        sent = real_now(self, command)
        if sent is not None:
            written.append(sent)
            if fault == "connection_lost":
                sent.conn.transport.abort()  # injected: the socket breaks after the write
        return sent

    monkeypatch.setattr(ScriptPool, "send_now", send_now)

    async def scenario() -> None:
        engine = async_engine()
        call, response = await _answered_12_3(engine, tenant)
        # Written before the answer was made, in the same step of the view's task.
        assert len(written) == 1 and call.request_id.encode() in written[0].command
        assert response.status_code == 200
        # The router sends the body once the hold is settled (SETTLED_BEFORE_BODY).
        waiting = asyncio.ensure_future(getattr(response, SETTLED_BEFORE_BODY)())
        await asyncio.sleep(0)
        if fault == "cancelled":
            waiting.cancel()  # the client left: the view's wait is cancelled, not the settle
            with pytest.raises(asyncio.CancelledError):
                await waiting
        else:
            await waiting
        await settled_background(call)
        scripts = engine.client.scripts
        assert scripts.in_use == 0  # the connection went back (or, broken, its slot freed)
        await engine.client.aclose()

    asyncio.run(scenario())
    assert len(written) == 1
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["in"], event["event"]["out"]) == ("settled", 12, 3)
    assert counter(tenant) == (15, 0)


@pytest.mark.parametrize("reached", [True, False])
def test_a_settle_written_ahead_whose_store_is_gone_is_retried_and_settles_once(
        reached: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settle written before the answer is made, then its connection breaks and the new
    connection its reply's wait opens fails too: the end's first attempt finds the store
    unavailable, and the end is retried in the background the usual way until it lands. The
    hold is charged the upstream's usage once, whether the written settle reached Redis
    (`reached`: the retry finds the hold settled already) or not (the connection was broken
    before the write), and no script connection is left taken."""
    tenant = new_tenant()
    written: list[Any] = []
    real_now = ScriptPool.send_now
    real_connect = ScriptPool._connect
    refusals = [0]

    def send_now(self: ScriptPool, command: bytes) -> Any:
        if not reached:
            for conn in self.free:
                conn.transport.abort()  # injected: broken before the write
        sent = real_now(self, command)
        if sent is not None:
            written.append(sent)
            if reached:
                sent.conn.transport.abort()  # injected: broken right after the write
            refusals[0] = 1  # and the reply's new connection cannot be opened
        return sent

    async def connect(self: ScriptPool) -> Any:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise redis.exceptions.ConnectionError("injected: Redis is unreachable")
        return await real_connect(self)

    monkeypatch.setattr(ScriptPool, "send_now", send_now)
    monkeypatch.setattr(ScriptPool, "_connect", connect)

    async def scenario() -> None:
        engine = async_engine()
        call, response = await _answered_12_3(engine, tenant)
        assert len(written) == 1 and response.status_code == 200
        await settled_background(call)
        assert refusals[0] == 0  # the injected failure did happen
        assert engine.client.scripts.in_use == 0
        await engine.client.aclose()

    asyncio.run(scenario())
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["in"], event["event"]["out"]) == ("settled", 12, 3)
    assert counter(tenant) == (15, 0)


# -- errors after the upstream answered ----------------------------------------------------------


def test_content_as_a_list_of_parts_without_usage_settles_the_counted_tokens() -> None:
    tenant = new_tenant()
    text = "mock reply the quick brown fox"
    answer = {"id": "c1", "object": "chat.completion", "model": "gpt-4o", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": "x"}}]}}]}

    async def scenario() -> int:
        call = await open_call(async_engine(), tenant, stream=False)
        response = await _complete(call, httpx.Response(200, content=json.dumps(answer).encode()))
        await settled_background(call)
        return response.status_code

    assert asyncio.run(scenario()) == 200
    expected = count_stream_text(text, TOKENIZER)
    assert expected > 0
    [event] = usage_events(tenant)
    assert event["outcome"] == "settled"
    assert (event["event"]["in"], event["event"]["out"], event["event"]["outcome"]) == (
        PROMPT_TOKENS, expected, "no_usage")
    assert counter(tenant) == (PROMPT_TOKENS + expected, 0)


def test_a_stream_of_content_parts_without_usage_settles_what_was_relayed() -> None:
    tenant = new_tenant()
    parts = [delta([{"type": "text", "text": word}]) for word in WORDS[:5]]

    async def scenario() -> list[bytes]:
        call = await open_call(async_engine(), tenant, stream=True)
        received: list[bytes] = []
        await consume(StreamRelay(call, httpx.Response(200, content=chunks_of(
            [*parts, delta(finish="stop"), DONE]))), received)
        await settled_background(call)
        return received

    received = asyncio.run(scenario())
    text = delivered_text(received)
    assert text == "".join(WORDS[:5])
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["outcome"]) == ("settled", "complete_counted")
    assert event["event"]["out"] == count_stream_text(text, TOKENIZER) == 5
    assert counter(tenant) == (PROMPT_TOKENS + 5, 0)


@pytest.mark.parametrize(("data", "text"), [
    ({"choices": [{"message": {"content": "plain"}}]}, "plain"),
    ({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, "b",
                                           {"type": "refusal", "refusal": "c"}, 5, None]}}]},
     "abc"),
    ({"choices": [{"delta": {"content": None, "refusal": "no"}}]}, "no"),
    ({"choices": [{"delta": {"reasoning_content": "think", "content": "!"}}]}, "!think"),
    ({"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{}"}},
                                              "junk", {"function": None}]}}]}, "f{}"),
    ({"choices": [{"message": {"function_call": {"name": "g", "arguments": "[1]"}}}]}, "g[1]"),
    ({"choices": "nope"}, ""),
    ({"choices": [None, 3, {"message": "text"}, {"delta": [1]}]}, ""),
    ({"choices": [{"message": {"content": {"text": "a dict is not a content"}}}]}, ""),
    ({}, ""),
])
def test_text_of_reads_any_json_shape_without_raising(data: dict[str, Any], text: str) -> None:
    assert _text_of(Endpoint.CHAT, data) == text


def test_text_of_legacy_completions() -> None:
    assert _text_of(Endpoint.COMPLETIONS, {"choices": [{"text": "x"}, {"text": 3}, "y"]}) == "x"


# -- Redis unreachable at the end ----------------------------------------------------------------


def test_a_settle_that_finds_redis_unreachable_is_retried_until_it_lands() -> None:
    tenant = new_tenant()

    async def scenario() -> int:
        engine = Unreachable(async_engine(), "settle", failures=3)
        call = await open_call(engine, tenant, stream=False)
        await call.settle(Usage(20, 4))
        await settled_background(call)
        return engine.attempts

    assert asyncio.run(scenario()) == 4
    assert [(e["outcome"], e["event"]["out"]) for e in usage_events(tenant)] == [("settled", 4)]
    assert counter(tenant) == (24, 0)


def test_end_retries_outlast_the_deadline_and_the_stale_threshold() -> None:
    async def scenario() -> tuple[float, float, float]:
        call = await open_call(async_engine(), new_tenant(), stream=False)
        give_up = call._give_up_at() - call.reserved_at
        await call.release(499, "test")
        await settled_background(call)
        engine_settings = call.runtime.engine.settings
        return give_up, float(engine_settings.stale_hold_s), float(engine_settings.tombstone_s)

    give_up, stale, tombstone = asyncio.run(scenario())
    # Before issue 9 they stopped after about 39 s, whatever the deadline. Now they go on past
    # the stale threshold (a settle after the sweep corrects it) while the hold's tombstone lives.
    assert django_settings.GATEWAY_HOLD_END_SECONDS < stale < give_up < tombstone


def test_retry_end_gives_up_at_its_limit() -> None:
    attempts: list[float] = []

    async def never() -> SettleResult:
        attempts.append(asyncio.get_running_loop().time())
        raise QuotaStoreUnavailable("down")

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 1.0
        await _retry_end(never, "req_x", give_up)
        return give_up, loop.time()

    give_up, ended = asyncio.run(scenario())
    assert len(attempts) >= 2  # retried, then gave up (it returned) instead of trying forever
    assert ended >= give_up


# -- a fail-open call still yields a ledger row ----------------------------------------------------


def test_a_fail_open_call_appends_its_usage_once_redis_answers_again() -> None:
    tenant = new_tenant()

    async def scenario() -> int:
        engine = Unreachable(async_engine(), "append_unmetered", failures=2)
        call = await open_call(engine, tenant, stream=False, metered=False)
        await call.settle(Usage(30, 6))
        await settled_background(call)
        return engine.attempts

    assert asyncio.run(scenario()) == 3
    [event] = usage_events(tenant)
    assert (event["outcome"], int(event["actual"]), int(event["held"])) == ("unmetered", 36, 0)
    assert (event["event"]["in"], event["event"]["out"]) == (30, 6)
    assert json.loads(event["meta"])["p"] == 7 and json.loads(event["meta"])["k"] == 8
    assert counter(tenant) == (0, 0)  # nothing was held, nothing is charged to the counters


def test_the_unmetered_backlog_is_bounded_and_keeps_the_newest() -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        engine = Unreachable(async_engine(), "append_unmetered", failures=10**6)
        runtime = runtime_for(engine)
        backlog = UnmeteredBacklog(3)
        for i in range(5):
            backlog.add(runtime, UnmeteredUsage(tenant, f"req_{i}", i, 0, 0, "{}", "{}"))
        assert [u.request_id for u in backlog.pending] == ["req_2", "req_3", "req_4"]
        engine.failures = 0  # Redis is back
        while runtime.background:
            await asyncio.gather(*list(runtime.background))
        assert not backlog.pending

    asyncio.run(scenario())
    assert [e["request_id"] for e in usage_events(tenant)] == ["req_2", "req_3", "req_4"]


# -- the hold knows how far the call got ---------------------------------------------------------


def test_a_short_call_writes_no_checkpoint(settings: Any) -> None:
    settings.GATEWAY_CHECKPOINT_SECONDS = 30.0
    tenant = new_tenant()
    answer = {"choices": [{"message": {"content": "hi"}}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 1}}

    async def scenario() -> list[tuple[str, int]]:
        engine = CountingProgress(async_engine())
        call = await open_call(engine, tenant, stream=False)
        await _complete(call, httpx.Response(200, content=json.dumps(answer).encode()))
        await settled_background(call)
        return engine.calls

    assert asyncio.run(scenario()) == []
    assert counter(tenant) == (10, 0)


def test_a_call_still_in_flight_after_the_interval_is_marked_forwarded_once(settings: Any) -> None:
    settings.GATEWAY_CHECKPOINT_SECONDS = 0.05
    tenant = new_tenant()
    answer = json.dumps({"choices": [{"message": {"content": "hi"}}],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 1}}).encode()

    async def scenario() -> tuple[dict[str, str], list[tuple[str, int]]]:
        engine = CountingProgress(async_engine())
        call = await open_call(engine, tenant, stream=False)
        gate = asyncio.Event()
        reading = asyncio.create_task(_complete(call, httpx.Response(
            200, content=chunks_of([answer], gate))))
        real = engine.engine
        assert await eventually(lambda: _phase_is(real, call, "forwarded"))
        await asyncio.sleep(0.3)  # several more intervals: nothing more to tell
        before_end = await hold_fields(real, call)
        gate.set()
        await reading
        await settled_background(call)
        return before_end, engine.calls

    fields, calls = asyncio.run(scenario())
    assert fields["phase"] == "forwarded" and fields["state"] == "open"
    assert calls == [("forwarded", 0)]
    assert counter(tenant) == (10, 0)


async def _phase_is(engine: AsyncQuotaEngine, call: Call, phase: str) -> bool:
    return (await hold_fields(engine, call)).get("phase") == phase


def test_stream_checkpoints_follow_the_client_and_catch_up_when_the_upstream_stalls(
    settings: Any,
) -> None:
    """The timer, not the next chunk, writes the checkpoint: a stalled stream's hold still
    learns everything its client received. Writes slower than the interval never overlap."""
    settings.GATEWAY_CHECKPOINT_SECONDS = 0.05
    tenant = new_tenant()
    first, rest = WORDS[:5], WORDS[5:]

    async def scenario() -> tuple[int, CountingProgress]:
        engine = CountingProgress(async_engine(), delay=0.2)
        call = await open_call(engine, tenant, stream=True)
        gate = asyncio.Event()
        parts = [delta("", role="assistant"), *(delta(w) for w in first), *(delta(w) for w in rest),
                 delta(finish="stop"), usage_chunk(11, len(WORDS)), DONE]
        received: list[bytes] = []
        client = asyncio.create_task(consume(StreamRelay(call, httpx.Response(
            200, content=chunks_of(parts, gate, gate_after=1 + len(first)))), received))
        delivered = count_stream_text("".join(first), TOKENIZER)

        async def caught_up() -> bool:
            fields = await hold_fields(engine.engine, call)
            return fields.get("phase") == "streaming" and int(fields.get("progress", 0)) == delivered

        assert await eventually(caught_up)  # the upstream is stalled: only the timer can do it
        assert delivered_text(received) == "".join(first)
        gate.set()
        await client
        await settled_background(call)
        return delivered, engine

    delivered, engine = asyncio.run(scenario())
    assert delivered == 5
    assert engine.most_in_flight == 1
    assert all(phase == "streaming" for phase, _ in engine.calls)
    assert [tokens for _, tokens in engine.calls] == sorted(tokens for _, tokens in engine.calls)
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["out"]) == ("settled", len(WORDS))
    assert counter(tenant) == (11 + len(WORDS), 0)


# -- start-up validation of the deadline ---------------------------------------------------------


def load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("GATEWAY_CALL_DEADLINE_SECONDS", "GATEWAY_UPSTREAM_TOTAL_TIMEOUT")}
    return subprocess.run(
        [sys.executable, "-c",
         "import config.settings as s; print(s.GATEWAY_CALL_DEADLINE_SECONDS)"],
        cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_a_stale_threshold_the_deadline_does_not_fit_in_refuses_to_start() -> None:
    result = load_settings(QUOTA_STALE_HOLD_SECONDS="6")
    assert result.returncode != 0
    assert "must be at most half of QUOTA_STALE_HOLD_SECONDS (6 s)" in result.stderr


def test_a_deadline_within_half_the_stale_threshold_starts() -> None:
    result = load_settings(QUOTA_STALE_HOLD_SECONDS="6", GATEWAY_CALL_DEADLINE_SECONDS="1.5",
                           GATEWAY_STREAM_DRAIN_SECONDS="0.5", REDIS_SOCKET_TIMEOUT="0.5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.5"


def test_the_former_total_timeout_name_still_sets_the_deadline_but_not_both() -> None:
    old = load_settings(GATEWAY_UPSTREAM_TOTAL_TIMEOUT="100")
    assert old.returncode == 0, old.stderr
    assert old.stdout.strip() == "100.0"
    both = load_settings(GATEWAY_UPSTREAM_TOTAL_TIMEOUT="100", GATEWAY_CALL_DEADLINE_SECONDS="90")
    assert both.returncode != 0
    assert "Set GATEWAY_CALL_DEADLINE_SECONDS only" in both.stderr
