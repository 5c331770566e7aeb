"""What a /v1 call reports about itself (gateway/observe.py: its metrics, spans and log lines)
when the call does not go the usual way: tracing turned off mid-call, a client leaving while
the gateway waits on the upstream, a settle retried or orphaned, a body refused by the router,
the router's own lines, the worker's background tasks. The gateway (GatewayRouter in front of
Django's ASGI handler, as config/asgi.py builds it) runs in this process under httpx's ASGI
transport, over the session's Redis, PostgreSQL and mock upstream (as test_e2e_spans.py)."""
from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler

from config.log_format import JsonFormatter
from gateway import (
    circuit,
    forward,
    listener,
    metrics,
    other_endpoints,
    request_context,
    startup,
    tracing,
    views,
)
from gateway.asgi import GatewayRouter
from gateway.urls import direct_routes, prefix_routes
from gateway.usage import Usage
from quotas import keys
from quotas.engine import AsyncQuotaEngine, QuotaEngine, QuotaStoreUnavailable
from tenants.models import Tenant
from tests.gateway.conftest import MakeTenant, committed
from tests.gateway.test_e2e_queue import queue_plan
from tests.gateway.test_e2e_spans import _stop_runtime, fresh_runtime, in_memory_tracing  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def _app() -> GatewayRouter:
    return GatewayRouter(ASGIHandler(), direct_routes(), prefix_routes())


def run_app(work: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    """Run `work` with a client of an in-process gateway, then stop the worker's runtime."""
    async def run() -> Any:
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()),
                                         base_url="http://gateway", timeout=30) as client:
                return await work(client)
        finally:
            await _stop_runtime()

    return asyncio.run(run())


async def post(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})


async def leave_after(key: str, body: dict[str, Any], seconds: float,
                      left: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """One call through a router of its own whose client sends its body, then hangs up
    `seconds` later (httpx's ASGI transport cannot leave mid-call), or, given `left`, once that
    is set (within `seconds`); the messages it was sent."""
    raw = json.dumps(body).encode()
    gone = left or asyncio.Event()
    sent_body = False
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("gateway", 80),
             "headers": [(b"host", b"gateway"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode()),
                         (b"authorization", f"Bearer {key}".encode())]}
    call = asyncio.ensure_future(_app()(scope, receive, send))
    if left is None:
        await asyncio.sleep(seconds)
        gone.set()
    await asyncio.wait_for(call, None if left is None else seconds)
    return messages


def histogram(name: str) -> dict[tuple[tuple[str, str], ...], tuple[float, float]]:
    """This process's histogram `name` as (count, sum) per label set (the tally written)."""
    metrics.flush()
    found: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for family in metrics.REGISTRY.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            if sample.name.endswith("_count"):
                found.setdefault(labels, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_sum"):
                found.setdefault(labels, [0.0, 0.0])[1] = sample.value
    return {labels: (count, total) for labels, (count, total) in found.items()}


def requests_total() -> dict[tuple[str, str, str, str], float]:
    """tollgate_requests_total by (endpoint, status, refusal, model)."""
    metrics.flush()
    found = {}
    for family in metrics.REGISTRY.collect():
        if family.name == "tollgate_requests":
            for sample in family.samples:
                if sample.name == "tollgate_requests_total":
                    found[tuple(sample.labels[k] for k in
                                ("endpoint", "status", "refusal", "model"))] = sample.value
    return found


def grown(after: dict[Any, Any], before: dict[Any, Any]) -> dict[Any, Any]:
    """What changed between two readings (counts, or (count, sum) pairs)."""
    def minus(a: Any, b: Any) -> Any:
        return tuple(x - y for x, y in zip(a, b, strict=True)) if isinstance(a, tuple) else a - b

    zero = {k: (0.0, 0.0) if isinstance(v, tuple) else 0.0 for k, v in after.items()}
    return {k: minus(v, before.get(k, zero[k])) for k, v in after.items()
            if v != before.get(k, zero[k])}


@contextmanager
def json_lines(*names: str) -> Iterator[io.StringIO]:
    """The lines of these loggers, in the JSON log format, at INFO and up."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield out
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def parsed(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


# -- tracing turned off mid-call ---------------------------------------------------------------


def test_tracing_turned_off_during_a_call_leaves_it_untouched(
        fresh_runtime: None, make_tenant: MakeTenant, engine: QuotaEngine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """telemetry.shutdown() (a worker's lifespan shutdown) turns tracing off while calls are in
    flight: a call traced from its start then gets no child span, and is answered and settled
    as usual, not 500 with its hold left to the sweep."""
    t = make_tenant(requests_per_second=1000)
    checked = views.checked

    async def checked_then_off(*args: Any, **kwargs: Any) -> Any:
        found = await checked(*args, **kwargs)
        tracing.disable()  # after the request span began, before the reserve's
        return found

    monkeypatch.setattr(views, "checked", checked_then_off)
    with in_memory_tracing() as exporter:
        answer = run_app(lambda client: post(client, t.plaintext, {
            "model": "gpt-4o", "max_tokens": 4, "messages": HI}))
        spans = exporter.get_finished_spans()
    assert answer.status_code == 200, answer.text
    assert engine.client.zcard(keys.hold_index_key(t.tag)) == 0  # settled
    # The request span, begun while tracing was on, still ends with the call.
    assert [s.name for s in spans] == ["gateway.request"]
    assert spans[0].attributes["http.response.status_code"] == 200


# -- over-hold counts ------------------------------------------------------------------------


def _hold_figures() -> tuple[float, float, float]:
    metrics.flush()
    return (metrics.OVER_HOLD_CALLS._value.get(), metrics.OVER_HOLD_TOKENS._value.get(),
            metrics.HOLD_SETTLED._value.get())


@pytest.mark.parametrize("fault", ["reply_lost_then_retried", "hold_record_lost"])
def test_a_settle_that_finds_no_live_hold_is_not_counted_over_it(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch,
        fault: str) -> None:
    """lua/settle.lua answers held 0 when the hold was settled already (the first attempt
    applied, its reply was lost, the retry finds it settled) or when Redis lost its record (the
    orphan path charges the usage without a hold): a 4-token call is not over a hold it was
    not compared with. The hold is counted settled once either way."""
    t = make_tenant(requests_per_second=1000)
    real = AsyncQuotaEngine.settle
    attempts = []
    returned = []  # attempts whose script answered: the hold's end is tallied right after

    async def settle(self: AsyncQuotaEngine, hold: Any, actual: int, event: str = "",
                     actual_money: int = 0, packed: Any = None) -> Any:
        attempts.append(actual)
        if fault == "hold_record_lost":  # a failover without the record
            await self.client.delete(keys.hold_key(hold.tenant, hold.request_id))
            result = await real(self, hold, actual, event, actual_money, packed)
            returned.append(actual)
            return result
        result = await real(self, hold, actual, event, actual_money, packed)
        if len(attempts) == 1:
            raise QuotaStoreUnavailable("connection lost before the reply")  # applied
        returned.append(actual)
        return result

    monkeypatch.setattr(AsyncQuotaEngine, "settle", settle)
    # The faults are injected before the settle's write: not written ahead of the answer
    # (Call.begin_settle, quotas: send_settle), which would send it before this fake runs.
    monkeypatch.setattr(AsyncQuotaEngine, "send_settle", lambda *args: None)
    before: list[tuple[float, float, float]] = []

    async def work(client: httpx.AsyncClient) -> httpx.Response:
        before.append(_hold_figures())
        answer = await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                  "messages": HI})
        # Until the attempt that answers has returned (the retry comes 0.2 s after the first
        # attempt, in the background): waiting for it to start was not enough on a loaded
        # machine, where its round trip could outlast a fixed pause and be cancelled with the
        # app. Its tally (Call._timed_end) runs as soon as it returns, in the same task.
        for _ in range(400):
            if returned:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        return answer

    answer = run_app(work)
    assert answer.status_code == 200
    over_calls, over_tokens, settled = (a - b for a, b in zip(_hold_figures(), before[0],
                                                              strict=True))
    assert attempts and all(n == attempts[0] for n in attempts) and 0 < attempts[0] < 100
    assert len(attempts) == (2 if fault == "reply_lost_then_retried" else 1)
    assert returned == attempts[-1:]
    assert (over_calls, over_tokens, settled) == (0, 0, 1)


def test_a_settle_above_its_live_hold_is_counted_over_it(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter still counts what it is for: an upstream that reports more output than the
    cap it was given (injected: the mock honours max_tokens) settles above its live hold."""
    t = make_tenant(requests_per_second=1000, tokens_per_day=10**9)
    body_usage = forward._body_usage

    def overrun(call: Any, body: bytes) -> tuple[Usage, str]:
        usage, outcome = body_usage(call, body)
        return Usage(usage.input_tokens, usage.output_tokens + 500), outcome

    monkeypatch.setattr(forward, "_body_usage", overrun)
    before: list[tuple[float, float, float]] = []

    async def work(client: httpx.AsyncClient) -> httpx.Response:
        before.append(_hold_figures())
        return await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 10,
                                                "messages": HI})

    answer = run_app(work)
    assert answer.status_code == 200, answer.text
    over_calls, over_tokens, settled = (a - b for a, b in zip(_hold_figures(), before[0],
                                                              strict=True))
    # The hold: the input estimate plus the 10 capped; the usage: 500 above the mock's.
    assert (over_calls, settled) == (1, 1) and 480 < over_tokens <= 500


# -- the worker's background tasks carry no request's ids --------------------------------------


def test_the_workers_own_tasks_carry_no_request_ids(
        fresh_runtime: None, make_tenant: MakeTenant, settings: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's runtime, and with it the listener and the last-use writer, is built in its
    first request; the breaker flusher starts in the first successful call. Their lines must
    not carry that request's id, tenant and key for the worker's life."""
    first = make_tenant(requests_per_second=1000)
    second = make_tenant(requests_per_second=1000)
    settings.GATEWAY_LAST_USED_FLUSH_SECONDS = 0.05
    settings.TOLLGATE_BREAKER_FLUSH_SECONDS = 0.05

    def database_down(*args: Any, **kwargs: Any) -> None:  # injected: the flush fails
        raise RuntimeError("database down")

    monkeypatch.setattr(listener, "touch_last_used", database_down)

    async def redis_away(*args: Any, **kwargs: Any) -> None:  # injected: the record fails
        raise ConnectionError("redis away")

    async def work(client: httpx.AsyncClient) -> list[str]:
        ids = []
        answer = await post(client, first.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                      "messages": HI})
        ids.append(answer.headers["x-request-id"])
        monkeypatch.setattr(circuit.circuit_for(startup._runtime).store, "record", redis_away)
        answer = await post(client, second.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                       "messages": HI})
        ids.append(answer.headers["x-request-id"])
        await asyncio.sleep(0.4)  # both flushers run, outside any request, and fail
        return ids

    with json_lines("gateway.listener", "gateway.circuit") as out:
        ids = run_app(work)
    lines = parsed(out)
    flusher = [line for line in lines if "last use" in line["message"]]
    breaker = [line for line in lines if "breaker record" in line["message"]]
    assert flusher and breaker
    for line in flusher + breaker:
        assert not {"request_id", "tenant", "api_key"} & set(line), line
    assert len(ids) == 2


def test_the_fail_open_backlog_is_the_workers_and_a_calls_end_is_the_calls(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fail-open backlog's flusher is one task per worker started by whichever call needed
    it first: no call's ids (each of its lines names the call it is about). A call's own
    detached work (runtime.detach: its hold's end, a drain) keeps the call's ids."""
    t = make_tenant(requests_per_second=1000)

    async def refused(*args: Any, **kwargs: Any) -> None:  # injected: Redis refuses the write
        raise RuntimeError("refused")

    async def work(client: httpx.AsyncClient) -> None:
        answer = await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                  "messages": HI})
        assert answer.status_code == 200
        runtime = startup._runtime
        monkeypatch.setattr(runtime.engine, "append_unmetered", refused)
        done = asyncio.Event()

        async def own_work() -> None:
            log.warning("the call's own detached work")
            done.set()

        def in_a_call() -> None:
            request_context.bind_request("req_starter")
            request_context.bind_caller("ten_starter", "key_starter")
            forward._unmetered_backlog().add(runtime, forward.UnmeteredUsage(
                t.tag, "req_unmetered", 7, 0, 0, "{}", "{}"))
            runtime.detach(own_work())

        contextvars.Context().run(in_a_call)
        await done.wait()
        for _ in range(100):
            if forward._unmetered_backlog().flushing is None:
                break
            await asyncio.sleep(0.02)

    with json_lines("gateway.forward", log.name) as out:
        run_app(work)
    lines = parsed(out)
    [backlog] = [line for line in lines if "req_unmetered" in line["message"]]
    assert not {"request_id", "tenant", "api_key"} & set(backlog)
    [own] = [line for line in lines if line["message"] == "the call's own detached work"]
    assert (own["request_id"], own["tenant"], own["api_key"]) == (
        "req_starter", "ten_starter", "key_starter")


# -- the router's own lines -------------------------------------------------------------------


def test_the_routers_lines_about_a_call_carry_its_ids(
        fresh_runtime: None, make_tenant: MakeTenant, settings: Any,
        django_db_blocker: Any) -> None:
    """The router logs a stream cut at its call's deadline (and a failed send) outside the
    view's context: the line names the call's request, tenant and key all the same."""
    t = make_tenant(requests_per_second=1000)
    settings.GATEWAY_CALL_DEADLINE_SECONDS = 1.0
    settings.TOLLGATE_ACCESS_LOG = True
    tenant_id = committed(django_db_blocker,
                          lambda: Tenant.objects.get(pk=t.tenant_id).public_id)

    async def work(client: httpx.AsyncClient) -> str:
        messages = await leave_after(t.plaintext, {
            "model": "slow@chunk_ms=400@output_tokens=20", "stream": True, "messages": HI}, 2.0)
        start = next(m for m in messages if m["type"] == "http.response.start")
        return dict(start["headers"])[b"x-request-id"].decode()

    with json_lines("gateway.asgi", "tollgate.access") as out:
        request_id = run_app(work)
    lines = parsed(out)
    [cut] = [line for line in lines if line["logger"] == "gateway.asgi"]
    assert "reached the call's deadline" in cut["message"]
    assert (cut["request_id"], cut["tenant"], cut["api_key"]) == (
        request_id, tenant_id, t.api_key_public_id)
    [access] = [line for line in lines if line["logger"] == "tollgate.access"]
    assert (access["request_id"], access["status"]) == (request_id, 504)


# -- calls the router refuses before their view runs -------------------------------------------


async def raw_call(key: str, chunks: list[bytes], *, query: bytes = b"",
                   length: int | None = None, then_hang: bool = False) -> list[dict[str, Any]]:
    """One /v1 call straight through the router's ASGI interface: its body in `chunks`
    (chunked when `length` is None), then, with `then_hang`, a client that sends no more and
    never leaves; the messages it was sent."""
    inbox: list[dict[str, Any]] = [
        {"type": "http.request", "body": chunk, "more_body": then_hang or i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)]
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await asyncio.Event().wait()  # silent: only the router's deadline ends the wait
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    headers = [(b"host", b"gateway"), (b"content-type", b"application/json"),
               (b"authorization", f"Bearer {key}".encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": query, "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("gateway", 80), "headers": headers}
    await _app()(scope, receive, send)
    return messages


def _status_and_id(messages: list[dict[str, Any]]) -> tuple[int, str]:
    start = next(m for m in messages if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"])[b"x-request-id"].decode()


def test_calls_refused_before_their_view_are_counted_and_logged(
        fresh_runtime: None, make_tenant: MakeTenant, settings: Any) -> None:
    """A body too large (by its Content-Length, or past the limit while a chunked one is read),
    one not received by the read deadline, and one Django cannot make a request of are calls
    the clients made: each is counted in tollgate_requests_total (model "", as the other
    refusals before the body is read) with its status and access-logged with its request id.
    A span is made for each when tracing is on."""
    t = make_tenant(requests_per_second=1000)
    settings.GATEWAY_MAX_BODY_BYTES = 200
    settings.REQUEST_BODY_TIMEOUT_SECONDS = 0.3
    settings.TOLLGATE_ACCESS_LOG = True
    small = json.dumps({"model": "gpt-4o", "max_tokens": 4, "messages": HI}).encode()
    big = json.dumps({"model": "gpt-4o", "messages": [{"role": "user",
                                                        "content": "x" * 500}]}).encode()
    before: list[Any] = []

    async def work(client: httpx.AsyncClient) -> list[tuple[int, str]]:
        before.append(requests_total())
        return [_status_and_id(await raw_call(t.plaintext, [big], length=len(big))),
                _status_and_id(await raw_call(t.plaintext, [big[:150], big[150:]])),
                _status_and_id(await raw_call(t.plaintext, [small[:10]], then_hang=True)),
                _status_and_id(await raw_call(t.plaintext, [small], length=len(small),
                                              query=b"x=\xff")),
                _status_and_id(await raw_call(t.plaintext, [small], length=len(small)))]

    with in_memory_tracing() as exporter, json_lines("tollgate.access") as out:
        answers = run_app(work)
        spans = exporter.get_finished_spans()
    assert [status for status, _ in answers] == [400, 400, 408, 400, 200]
    assert grown(requests_total(), before[0]) == {
        ("chat/completions", "400", "", ""): 3, ("chat/completions", "408", "", ""): 1,
        ("chat/completions", "200", "", "gpt-4o"): 1}
    lines = {line["request_id"]: line for line in parsed(out)}
    for status, request_id in answers:
        line = lines[request_id]
        assert (line["endpoint"], line["status"], line["model"]) == (
            "chat/completions", status, "" if status != 200 else "gpt-4o")
    roots = {s.attributes["tollgate.request_id"]: s for s in spans if s.name == "gateway.request"}
    assert {rid: roots[rid].attributes["http.response.status_code"]
            for _, rid in answers} == {rid: status for status, rid in answers}


def test_a_refused_body_on_an_unmetered_path_is_counted_there_but_not_on_a_health_check(
        fresh_runtime: None, make_tenant: MakeTenant, settings: Any) -> None:
    """/v1/models and the other unmetered /v1 paths are counted by endpoint (model "": nothing
    is metered; gateway/observe.py count_other), a call whose body is refused too; the health
    checks are not calls of the API and count nothing."""
    t = make_tenant(requests_per_second=1000)
    settings.GATEWAY_MAX_BODY_BYTES = 10
    before: list[Any] = []

    async def work(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        before.append(requests_total())
        models = await client.post("/v1/models", content=b"x" * 50,
                                   headers={"Authorization": f"Bearer {t.plaintext}"})
        return models, await client.post("/healthz", content=b"x" * 50)

    models, health = run_app(work)
    assert models.status_code == 400 and health.status_code == 400
    assert grown(requests_total(), before[0]) == {("models", "400", "", ""): 1}


# -- the gateway's overhead when the call ends mid-wait ----------------------------------------


OVERHEAD = "tollgate_gateway_overhead_seconds"
DURATION = "tollgate_request_duration_seconds"


@pytest.mark.parametrize("wait", ["upstream_first_byte", "stream_next_chunk", "queue"])
def test_a_client_leaving_mid_wait_leaves_the_wait_out_of_the_overhead(
        fresh_runtime: None, make_tenant: MakeTenant, django_db_blocker: Any,
        settings: Any, wait: str) -> None:
    """The overhead is the call's time minus its waits on upstreams and queues. A client that
    leaves 1 s into such a wait ends the call there (499) while the wait goes on (the call is
    detached to end its hold): the wait counts up to the call's end, so the overhead stays the
    gateway's milliseconds, not the client's patience."""
    settings.TOLLGATE_ACCESS_LOG = True
    if wait == "queue":
        t = make_tenant(plan=queue_plan(django_db_blocker, 30),
                        key_options={"max_concurrency": 1})
    else:
        t = make_tenant(requests_per_second=1000)
    body = {"upstream_first_byte": {"model": "slow@first_byte_ms=2500", "max_tokens": 4,
                                    "messages": HI},
            "stream_next_chunk": {"model": "slow@chunk_ms=1500@output_tokens=3",
                                  "stream": True, "messages": HI},
            "queue": {"model": "gpt-4o", "max_tokens": 4, "messages": HI}}[wait]
    before: list[Any] = []

    async def work(client: httpx.AsyncClient) -> str:
        # A first call builds the worker's runtime (the gateway's own, slow, start).
        await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 4, "messages": HI})
        before.extend([histogram(OVERHEAD), histogram(DURATION)])
        holder = None
        if wait == "queue":  # holds the key's one slot for 2.5 s: the next call queues
            holder = asyncio.ensure_future(post(client, t.plaintext, {
                "model": "slow@first_byte_ms=2500", "max_tokens": 4, "messages": HI}))
            await asyncio.sleep(0.3)
        messages = await leave_after(t.plaintext, body, 1.0)
        if holder is not None:
            assert (await holder).status_code == 200
        await asyncio.sleep(2.0 if wait != "queue" else 0.5)  # the detached call settles
        starts = [m for m in messages if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"])[b"x-request-id"].decode() if starts else ""

    with json_lines("tollgate.access") as out:
        request_id = run_app(work)
    overhead = grown(histogram(OVERHEAD), before[0])
    duration = grown(histogram(DURATION), before[1])
    calls = 2 if wait == "queue" else 1
    [(count, total)] = overhead.values()
    assert count == calls
    assert total < 0.25 * calls, overhead  # was the 1 s wait (and more)
    assert sum(n for n, _ in duration.values()) == calls
    assert sum(s for _, s in duration.values()) > 0.9 * calls
    left = [line for line in parsed(out) if line["status"] == 499]
    assert len(left) == 1
    if wait == "stream_next_chunk":
        assert left[0]["request_id"] == request_id
    if wait != "queue":  # the upstream's time, up to the client's leaving
        assert 900 < left[0]["upstream_ms"] < 1500


def test_a_stream_its_client_left_is_logged_with_its_charge_even_if_the_settle_fails(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch,
        settings: Any) -> None:
    """A stream whose client leaves is logged when its hold ends, after the drain, with the
    usage its settle charges (not the zeros known when the client left), the client's 499 and
    time. Its line does not wait for a settle Redis did not answer: the retry goes on in the
    background, and the line is written once, before it."""
    settings.TOLLGATE_ACCESS_LOG = True
    t = make_tenant(requests_per_second=1000)
    real = AsyncQuotaEngine.settle
    attempts: list[int] = []
    lines_at_retry: list[str] = []
    retried = asyncio.Event()
    out = io.StringIO()

    async def settle(self: AsyncQuotaEngine, hold: Any, actual: int, event: str = "",
                     actual_money: int = 0, packed: Any = None) -> Any:
        attempts.append(actual)
        if len(attempts) == 1:
            raise QuotaStoreUnavailable("Redis unreachable")  # nothing applied
        lines_at_retry.append(out.getvalue())
        result = await real(self, hold, actual, event, actual_money, packed)
        retried.set()
        return result

    async def work(client: httpx.AsyncClient) -> str:
        # A first call builds the worker's runtime and settles as usual.
        assert (await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                 "messages": HI})).status_code == 200
        monkeypatch.setattr(AsyncQuotaEngine, "settle", settle)
        # Refused before its write: not written ahead (Call.begin_settle), see above.
        monkeypatch.setattr(AsyncQuotaEngine, "send_settle", lambda *args: None)
        messages = await leave_after(t.plaintext, {
            "model": "gpt-4o@chunk_ms=100@output_tokens=12", "max_tokens": 50,
            "stream": True, "messages": HI}, 0.35)
        await asyncio.wait_for(retried.wait(), 15)  # the drain, its failed settle, the retry
        starts = [m for m in messages if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"])[b"x-request-id"].decode()

    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    access = logging.getLogger("tollgate.access")
    access.addHandler(handler)
    try:
        request_id = run_app(work)
    finally:
        access.removeHandler(handler)
    [left] = [line for line in parsed(out) if line["status"] == 499]
    assert left["request_id"] == request_id and left["stream"] is True
    # The usage the settle charged (the first attempt's, the retry's: the same), not zeros.
    assert len(attempts) == 2 and attempts[0] == attempts[1]
    assert left["input_tokens"] + left["output_tokens"] == attempts[0]
    assert left["output_tokens"] >= 12 and left["cost_micros"] > 0
    assert left["duration_ms"] < 1000  # the client's side: it left after 0.35 s
    # Written when the failed attempt returned, before the retry began.
    assert request_id in lines_at_retry[0]


def test_a_call_cancelled_before_its_hold_ends_still_writes_its_access_line(
        fresh_runtime: None, make_tenant: MakeTenant, settings: Any,
        engine: QuotaEngine) -> None:
    """A call whose client left while the upstream thought goes on detached, its access line
    held back for its hold's end. A worker stopping past its drain deadline cancels such calls
    (gateway/shutdown.py): the hold is left to the sweep, and the line is written then, once,
    with the client's 499."""
    settings.TOLLGATE_ACCESS_LOG = True
    settings.GATEWAY_CHECKPOINT_SECONDS = 0.2
    t = make_tenant(requests_per_second=1000)

    async def work(client: httpx.AsyncClient) -> tuple[str, str]:
        assert (await post(client, t.plaintext, {"model": "gpt-4o", "max_tokens": 4,
                                                 "messages": HI})).status_code == 200
        runtime = startup._runtime
        assert runtime is not None
        before = set(runtime.background)
        await leave_after(t.plaintext, {"model": "slow@first_byte_ms=8000", "max_tokens": 4,
                                        "messages": HI}, 0.3)
        await asyncio.sleep(0.6)  # its checkpoint (every 0.2 s) marks the hold `forwarded`
        written_before = out.getvalue()
        calls = [task for task in runtime.background - before if not task.done()]
        assert calls  # the call, detached, still waiting for its upstream
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return written_before, out.getvalue()

    with json_lines("tollgate.access") as out:
        written_before, written_after = run_app(work)
    assert '"status": 499' not in written_before  # held back for the hold's end
    [left] = [line for line in parsed(out) if line["status"] == 499]
    assert left["request_id"] in written_after
    assert (left["input_tokens"], left["output_tokens"], left["cost_micros"]) == (0, 0, 0)
    # The money: the hold stays open for the sweep, which charges the whole of it (the call
    # was handed to its upstream, which may have produced it all); nothing stays pending.
    assert engine.open_hold_ids(t.tag) == [left["request_id"]]
    used_before = engine.counter(t.tag, "tenant").used
    [swept] = engine.sweep(t.tag, stale_s=0).swept
    assert (swept.request_id, swept.basis, swept.charged) == (
        left["request_id"], "forwarded", swept.amount)
    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0 and counter.used == used_before + swept.amount


def test_an_unmetered_view_that_raises_is_counted_as_the_500_its_client_gets(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """A view that raises makes no answer: the server sends its 500, and the call is counted
    so, not as a client that left."""
    t = make_tenant()

    def broken(*args: Any) -> list[str]:  # injected: a bug in the view
        raise RuntimeError("a bug")

    monkeypatch.setattr(other_endpoints, "listed_models", broken)
    before: list[Any] = []
    sent: list[dict[str, Any]] = []

    async def work(client: httpx.AsyncClient) -> None:
        before.append(requests_total())

        asked = asyncio.Event()  # the body once, then a client that stays

        async def receive() -> dict[str, Any]:
            if not asked.is_set():
                asked.set()
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await _app()({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                      "method": "GET", "scheme": "http", "path": "/v1/models",
                      "raw_path": b"/v1/models", "query_string": b"", "root_path": "",
                      "client": ("127.0.0.1", 5000), "server": ("gateway", 80),
                      "headers": [(b"host", b"gateway"),
                                  (b"authorization", f"Bearer {t.plaintext}".encode())]},
                     receive, send)

    with json_lines("gateway.asgi") as out:
        run_app(work)
    assert sent == []  # no answer made: the server's own 500 goes out
    assert grown(requests_total(), before[0]) == {("models", "500", "", ""): 1}
    [line] = parsed(out)  # logged as the view's failure, not as a send that broke
    assert line["message"] == "the view of /v1/models failed; the server answers 500"
    assert "RuntimeError: a bug" in line["exception"]
