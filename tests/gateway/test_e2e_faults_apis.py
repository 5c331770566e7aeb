"""Faults of the Responses and Messages API streams end to end: the client leaving at each
instant, the upstream cutting the stream, an upstream that hangs or stalls past the call's
deadline, and a worker SIGKILLed mid-stream. After each, the hold ended exactly once (nothing
pending) and the ledger row is what the upstream produced, as the mock upstream billed it:

- a client that leaves (before the headers, after the first event, mid-stream, right after the
  final event): the gateway reads the upstream to its end for the usage; the row equals the
  bill token for token, token classes included;
- a cut stream (no terminal event): what was relayed. A Messages stream told its input side in
  `message_start`: that is charged exactly (classes included), and the output is the larger of
  the text relayed (counted) and the last `message_delta`'s cumulative `output_tokens`. A
  Responses stream tells nothing before its terminal event: the input estimate and the text
  relayed;
- a hang: 504 in the API's shape, the hold released, nothing billed; a stall mid-stream: the
  deadline ends it and charges what was relayed;
- a dead worker: the sweep charges the input estimate plus the last checkpoint (the text its
  client received), never more than the hold.

Every fault but the dead worker runs through each upstream transport
(GATEWAY_UPSTREAM_TRANSPORT): the end-to-end half of their contract with
tests/gateway/test_upstream_http.py.

Counted text (a cut, a sweep) uses the gateway's tokenizer, which for these models (outside the
catalog) is the documented heuristic: it counts the mock's words as at least one token each, so
those rows are at least the bill, never less."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.models import UsageRecord
from config.embedded import free_port
from gateway.catalog import fallback_model_info
from gateway.mock_upstream import MockUpstream
from gateway.mock_upstream.server import wait_until_ready
from gateway.tokens import count_stream_text, estimate_messages_prompt, estimate_responses_input
from gateway.upstream_http import TRANSPORTS
from quotas.engine import QuotaEngine
from quotas.keys import hold_key
from tests.gateway.conftest import (
    ANTHROPIC_MOCK_SECRET,
    ROOT,
    GatewayServer,
    MakeTenant,
    TenantKey,
    committed,
    start_gateway,
    wait_until,
)
from tests.gateway.test_e2e_race_apis import MOCK_PRICE, ledger_rows, row_usage
from tests.support.gateway_calls import SHARED_PROVIDER_SECRET, billed, unique_model, usage_events
from tests.support.transports import (
    CUT_LOSES_LAST_EVENTS,
    known_difference,
    transport_gateway,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

APIS = ("responses", "messages")
PROMPT = "tell me a rather long story please"
MAX_OUTPUT = 300
HEURISTIC = "heuristic"  # the tokenizer of models outside the catalog
# Token classes in every answer that tells them (the mock's faults), so rows keep them apart.
CLASS_FAULTS = {"responses": "@cached_tokens=2@reasoning_tokens=4",
                "messages": "@cache_read_tokens=2@cache_write_tokens=1"}
SECRETS = {"responses": SHARED_PROVIDER_SECRET, "messages": ANTHROPIC_MOCK_SECRET}
TERMINAL = {"responses": ("response.completed", "response.incomplete", "response.failed"),
            "messages": ("message_stop",)}


@pytest.fixture(scope="module", params=TRANSPORTS)
def upstream_gateway(request: pytest.FixtureRequest, provider_key: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A gateway on each upstream transport (tests/support/transports.py)."""
    yield from transport_gateway(request, tmp_path_factory.mktemp(f"{request.param}-apis-gateway"))


def request_for(api: str, model: str, key: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers) of a streamed call of this API."""
    if api == "responses":
        return ("/responses", {"model": model, "input": PROMPT, "stream": True,
                               "max_output_tokens": MAX_OUTPUT},
                {"Authorization": f"Bearer {key}"})
    return ("/messages", {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                          "max_tokens": MAX_OUTPUT, "stream": True},
            {"x-api-key": key, "anthropic-version": "2023-06-01"})


def prompt_estimate(api: str, model: str) -> int:
    """The gateway's input estimate of request_for's body (what a hold knows of the input)."""
    _, body, _ = request_for(api, model, "key")
    info = fallback_model_info(model)
    if api == "responses":
        return estimate_responses_input(body, model=model, tokenizer=info.tokenizer)
    return estimate_messages_prompt(body, model=model, tokenizer=info.tokenizer)


def event_text(api: str, event: dict[str, Any]) -> str:
    """The output text a client reads in one event (what the gateway counts of it)."""
    kind = event.get("type", "")
    if api == "responses":
        return event.get("delta", "") if kind.endswith(".delta") else ""
    delta = event.get("delta") or {}
    if kind != "content_block_delta":
        return ""
    return delta.get("text", "") + delta.get("partial_json", "") + delta.get("thinking", "")


@dataclass
class Client:
    """One streaming client: the events it read, and the call's request id."""

    api: str
    request_id: str = ""
    status: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    headers_seen: bool = False

    @property
    def text(self) -> str:
        return "".join(event_text(self.api, e) for e in self.events)

    @property
    def chunks(self) -> int:
        return sum(1 for e in self.events if event_text(self.api, e))

    def ended_properly(self) -> bool:
        return any(e.get("type") in TERMINAL[self.api] for e in self.events)

    async def run(self, http: httpx.AsyncClient, url: str, key: str, model: str,
                  leave: Any = None) -> None:
        """Read the stream; `leave(self)` True: close the connection there."""
        path, body, headers = request_for(self.api, model, key)
        try:
            async with http.stream("POST", f"{url}{path}", json=body, headers=headers) as response:
                self.headers_seen = True
                self.status = response.status_code
                self.request_id = response.headers.get("x-request-id", "")
                if response.status_code != 200:
                    await response.aread()
                    self.events.append(response.json())
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        if leave is not None and leave(self):
                            return  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:
            self.error = exc


def stream(server: GatewayServer, t: TenantKey, api: str, model: str,
           leave: Any = None) -> Client:
    client = Client(api)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            await client.run(http, server.base_url, t.plaintext, model, leave)

    asyncio.run(go())
    return client


def only_row(django_db_blocker: Any, engine: QuotaEngine, t: TenantKey) -> UsageRecord:
    [row] = ledger_rows(django_db_blocker, engine, t)
    return row


def assert_row_is_the_bill(row: UsageRecord, bill: dict[str, int]) -> None:
    assert bill["requests"] == 1
    assert (row.input_tokens, row.output_tokens) == (bill["prompt_tokens"],
                                                     bill["completion_tokens"])
    assert (row.cached_input_tokens, row.cache_write_tokens, row.reasoning_tokens) == (
        bill["input_cached_tokens"], bill["input_cache_write_tokens"],
        bill["output_reasoning_tokens"])
    assert row.cost_micros == MOCK_PRICE.cost_of(row_usage(row))


def ended_once(engine: QuotaEngine, t: TenantKey) -> dict[str, Any]:
    """The one usage event of the tenant's one call, once its hold has ended; nothing pending."""
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=20)
    [event] = usage_events(engine, t.tag)
    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0
    assert counter.used == int(event["actual"]) <= int(event["held"])
    return event


# -- 1. the client leaves at each instant ---------------------------------------------------------


def leave_after_first_event(client: Client) -> bool:
    return len(client.events) == 1


def leave_mid_stream(client: Client) -> bool:
    return client.chunks == 5


def leave_after_final_event(client: Client) -> bool:
    return client.ended_properly()


async def leave_before_headers(server: GatewayServer, t: TenantKey, engine: QuotaEngine,
                               client: Client, model: str) -> None:
    """Send the call, and once its hold is made (admitted, waiting for the upstream's first
    byte), close the connection."""
    async with httpx.AsyncClient(timeout=30) as http:
        task = asyncio.create_task(client.run(http, server.base_url, t.plaintext, model))
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while not engine.open_hold_ids(t.tag) and loop.time() < end:
            await asyncio.sleep(0.02)
        assert engine.open_hold_ids(t.tag), "the call was never admitted"
        assert not client.headers_seen
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


INSTANTS = ("before_headers", "after_first_event", "mid_stream", "after_final_event")


@pytest.mark.parametrize("instant", INSTANTS)
@pytest.mark.parametrize("api", APIS)
def test_a_client_leaving_at_any_instant_is_charged_what_the_upstream_produced(
    upstream_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any, api: str, instant: str,
) -> None:
    t = make_tenant(requests_per_second=-1)
    base = unique_model(f"fx-leave-{api}")
    model = f"{base}{CLASS_FAULTS[api]}@chunk_ms=20@output_tokens=30"
    if instant == "before_headers":
        model += "@first_byte_ms=3000"
        client = Client(api)
        asyncio.run(leave_before_headers(upstream_gateway, t, engine, client, model))
        assert client.events == []
    else:
        leave = {"after_first_event": leave_after_first_event, "mid_stream": leave_mid_stream,
                 "after_final_event": leave_after_final_event}[instant]
        client = stream(upstream_gateway, t, api, model, leave)
        assert client.status == 200 and client.error is None
        assert client.ended_properly() is (instant == "after_final_event")

    event = ended_once(engine, t)
    assert event["outcome"] == "settled"
    # Right after the final event the gateway may have settled before it saw the client leave.
    expected = {("client_disconnected", 499)} | (
        {("complete", 200)} if instant == "after_final_event" else set())
    assert (event["event"]["outcome"], event["event"]["st"]) in expected
    # The upstream was read to its end: it produced (and billed) the whole answer, which is
    # what the tenant is charged, class by class.
    bill = billed(mock_upstream, base, SECRETS[api])
    produced = 30 + (4 if api == "responses" else 0)  # the text, and the reasoning before it
    assert bill["completion_tokens"] == produced
    assert (event["event"]["in"], event["event"]["out"]) == (bill["prompt_tokens"], produced)
    assert engine.counter(t.tag, "tenant").used == bill["total_tokens"]
    row = only_row(django_db_blocker, engine, t)
    assert row.request_id == event["request_id"]
    assert_row_is_the_bill(row, bill)
    assert row.cached_input_tokens == 2
    assert (row.reasoning_tokens if api == "responses" else row.cache_write_tokens) > 0


# -- 2. the upstream cuts the stream ---------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_an_upstream_cut_mid_stream_is_charged_what_was_relayed(
    upstream_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any, api: str, request: pytest.FixtureRequest,
) -> None:
    known_difference(request, "upstream_gateway", aiohttp=CUT_LOSES_LAST_EVENTS)
    t = make_tenant(requests_per_second=-1)
    base = unique_model(f"fx-cut-{api}")
    faults = "@cache_read_tokens=2@cache_write_tokens=1" if api == "messages" else ""
    model = f"{base}{faults}@cut=3"
    client = stream(upstream_gateway, t, api, model)
    assert client.status == 200
    assert client.text == "mock reply the" and not client.ended_properly()

    event = ended_once(engine, t)
    assert event["outcome"] == "settled"
    assert (event["event"]["outcome"], event["event"]["st"]) == ("upstream_broken_counted", 502)
    bill = billed(mock_upstream, base, SECRETS[api])
    assert (bill["requests"], bill["completion_tokens"]) == (1, 3)
    counted = count_stream_text(client.text, HEURISTIC)
    row = only_row(django_db_blocker, engine, t)
    if api == "messages":
        # message_start told the input side: charged exactly, classes included; the output is
        # the text relayed, or the last message_delta's cumulative output_tokens if more
        # (message_start's output_tokens is a placeholder, not a count).
        told_output = max([e["usage"]["output_tokens"] for e in client.events
                           if e["type"] == "message_delta"], default=0)
        assert (row.input_tokens, row.cached_input_tokens, row.cache_write_tokens) == (
            bill["prompt_tokens"], bill["input_cached_tokens"], bill["input_cache_write_tokens"])
        assert row.output_tokens == max(counted, told_output)
    else:
        # Nothing of the usage is told before the terminal event: the input estimate.
        assert row.input_tokens == prompt_estimate(api, model) >= bill["prompt_tokens"]
        assert row.output_tokens == counted
    assert row.output_tokens >= bill["completion_tokens"]
    assert (row.input_tokens, row.output_tokens) == (event["event"]["in"], event["event"]["out"])
    assert row.cost_micros == MOCK_PRICE.cost_of(row_usage(row))


# -- 3. an upstream that hangs or stalls: the call's deadline --------------------------------------


@pytest.fixture(scope="module", params=TRANSPORTS)
def deadline_gateway(request: pytest.FixtureRequest, provider_key: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A 1 s call deadline (6 s stale threshold; 1 + 0.5 drain + 2 x 0.5 socket timeout fits in
    its half), as tests/gateway/test_e2e_call_end.py starts it, on each upstream transport."""
    server = start_gateway(tmp_path_factory.mktemp(f"deadline-apis-{request.param}-gateway"),
                           workers=1, QUOTA_STALE_HOLD_SECONDS="6",
                           GATEWAY_CALL_DEADLINE_SECONDS="1", GATEWAY_STREAM_DRAIN_SECONDS="0.5",
                           REDIS_SOCKET_TIMEOUT="0.5", GATEWAY_UPSTREAM_TRANSPORT=request.param)
    yield server
    server.stop()


@pytest.mark.parametrize("api", APIS)
def test_an_upstream_that_hangs_is_a_504_in_the_apis_shape_and_releases_the_hold(
    deadline_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, api: str,
) -> None:
    t = make_tenant(requests_per_second=-1)
    base = unique_model(f"fx-hang-{api}")
    client = stream(deadline_gateway, t, api, f"{base}@hang")
    assert client.status == 504
    [body] = client.events
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "timeout_error"
    else:
        assert body["error"]["code"] == "upstream_error"
    event = ended_once(engine, t)
    assert (event["outcome"], event["event"]["outcome"], event["event"]["st"]) == (
        "released", "upstream_timeout", 504)
    assert engine.counter(t.tag, "tenant").used == 0
    assert engine.sweep(t.tag, stale_s=6).swept == ()
    assert billed(mock_upstream, base, SECRETS[api])["requests"] == 0


@pytest.mark.parametrize("api", APIS)
def test_a_stream_stalled_past_the_deadline_is_charged_what_was_relayed(
    deadline_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any, api: str,
) -> None:
    """The upstream sends its opening events, then nothing for 20 s: the deadline ends the
    client's stream, and the gateway closes the upstream, which bills the input alone."""
    t = make_tenant(requests_per_second=-1)
    base = unique_model(f"fx-stall-{api}")
    faults = "@cache_read_tokens=2" if api == "messages" else ""
    model = f"{base}{faults}@chunk_ms=20000@output_tokens=5"
    client = stream(deadline_gateway, t, api, model)
    assert client.status == 200 and client.text == "" and not client.ended_properly()

    event = ended_once(engine, t)
    assert (event["outcome"], event["event"]["outcome"], event["event"]["st"]) == (
        "settled", "deadline_counted", 504)
    assert engine.sweep(t.tag, stale_s=6).swept == ()
    assert wait_until(lambda: billed(mock_upstream, base, SECRETS[api])["requests"] == 1)
    bill = billed(mock_upstream, base, SECRETS[api])
    assert bill["completion_tokens"] == 0
    row = only_row(django_db_blocker, engine, t)
    if api == "messages":
        # The input side came in message_start: exact; no output was produced or relayed.
        assert_row_is_the_bill(row, bill)
    else:
        assert (row.input_tokens, row.output_tokens) == (prompt_estimate(api, model), 0)
        assert row.input_tokens >= bill["prompt_tokens"]


# -- 4. a worker killed mid-stream ----------------------------------------------------------------


@pytest.fixture
def own_mock_upstream() -> Iterator[tuple[MockUpstream, subprocess.Popen[bytes]]]:
    """A mock upstream process of this test's own, so the test can freeze it (SIGSTOP)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port", str(port)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until_ready("127.0.0.1", port, 15, alive=lambda: process.poll() is None)
        yield MockUpstream("127.0.0.1", port, process.terminate), process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
            process.wait(timeout=10)


async def eventually(predicate: Any, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


def test_a_worker_killed_mid_stream_is_swept_with_the_input_and_its_last_checkpoint(
    own_mock_upstream: tuple[MockUpstream, subprocess.Popen[bytes]], make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any, tmp_path: Path,
) -> None:
    """Three Responses and three Messages streams (50 ms a token) through one worker. Once
    each client has some of its answer the upstream freezes, so what each client received is
    final, and within a checkpoint interval each hold knows it. SIGKILL the worker and sweep:
    each row charges the input estimate plus exactly what its client received."""
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    mock, mock_process = own_mock_upstream
    t = make_tenant(plan="enterprise", requests_per_second=-1)
    models = {api: f"{unique_model(f'fx-kill-{api}')}@chunk_ms=50@output_tokens=200"
              for api in APIS}
    secrets = {api: f"sk-kill-{api}-{uuid.uuid4().hex}" for api in APIS}
    for api in APIS:
        committed(django_db_blocker, lambda api=api: create_provider_key(
            f"kill-{api}", base_url=mock.base_url, secret=secrets[api], models=[models[api]],
            kind="anthropic" if api == "messages" else "openai",
            tenant=Tenant.objects.get(pk=t.tenant_id), default_price=MOCK_PRICE))
    server = start_gateway(tmp_path, workers=1)  # started after the keys: its pool has them
    try:
        clients = [Client(api) for api in APIS for _ in range(3)]

        def hold(client: Client) -> dict[str, str]:
            return engine.client.hgetall(hold_key(t.tag, client.request_id))

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [asyncio.create_task(c.run(http, server.base_url, t.plaintext,
                                                   models[c.api])) for c in clients]
                assert await eventually(lambda: all(c.chunks >= 5 for c in clients), 60), \
                    [c.chunks for c in clients]
                os.kill(mock_process.pid, signal.SIGSTOP)  # nothing more comes from upstream

                def checkpoints_caught_up() -> bool:
                    return all((h := hold(c)).get("phase") == "streaming" and int(
                        h.get("progress", -1)) == count_stream_text(c.text, HEURISTIC)
                        for c in clients)

                assert await eventually(checkpoints_caught_up, 30), [
                    (hold(c).get("progress"), count_stream_text(c.text, HEURISTIC))
                    for c in clients]
                # With one worker, uvicorn serves in its own process: that is the worker.
                os.kill(server.process.pid, signal.SIGKILL)
                await asyncio.gather(*tasks)
                os.kill(mock_process.pid, signal.SIGCONT)

        asyncio.run(scenario())
        assert all(c.error is not None and not c.ended_properly() for c in clients)
        ids = {c.request_id for c in clients}
        assert set(engine.open_hold_ids(t.tag)) == ids  # nobody ended them

        swept = engine.sweep(t.tag, stale_s=0).swept
        assert {s.request_id for s in swept} == ids
        assert all(s.basis == "streaming" for s in swept)
        counter = engine.counter(t.tag, "tenant")
        assert counter.pending == 0
        assert counter.used == sum(s.charged for s in swept)

        rows = {r.request_id: r for r in ledger_rows(django_db_blocker, engine, t)}
        assert set(rows) == ids
        for client in clients:
            row = rows[client.request_id]
            assert (row.status, row.sweep_basis) == ("swept", "streaming")
            # The input the hold knew (the estimate), and exactly what the client received.
            assert row.input_tokens == prompt_estimate(client.api, models[client.api])
            assert row.output_tokens == count_stream_text(client.text, HEURISTIC)
            assert row.output_tokens >= client.chunks >= 5
            assert row.input_tokens + row.output_tokens <= row.held_tokens
        # The upstream billed what it produced before it noticed the closed connections (once
        # it runs again): the words each client received, and at most one more per stream (a
        # token due while it was frozen is sent to the dead connection first). A token the
        # worker never relayed is not in its checkpoint: the sweep cannot know it, the
        # reconciliation with the bill does.
        for api in APIS:
            mine = [c for c in clients if c.api == api]
            assert wait_until(lambda api=api, mine=mine: billed(
                mock, models[api].split("@")[0], secrets[api])["requests"] == len(mine))
            bill = billed(mock, models[api].split("@")[0], secrets[api])
            received = sum(c.chunks for c in mine)
            assert received <= bill["completion_tokens"] <= received + len(mine)
            assert bill["prompt_tokens"] <= sum(rows[c.request_id].input_tokens for c in mine)
    finally:
        server.stop()
