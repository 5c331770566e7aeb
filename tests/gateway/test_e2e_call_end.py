"""The end of a call end to end: gateways under uvicorn over the session's Redis and PostgreSQL,
the mock upstream's latency injection, a worker killed with SIGKILL, forced sweeps, the ledger
drain. Each hold ends once: by the gateway within the call's deadline, by the sweep charging what
the hold knew of a dead worker's streams, or by the sweep and then a late settle that corrects it
to the upstream's own usage record."""
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
import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from config.embedded import free_port
from gateway.mock_upstream import MockUpstream
from gateway.mock_upstream.server import wait_until_ready
from gateway.tokens import count_stream_text
from quotas.engine import QuotaEngine
from quotas.keys import hold_key
from tests.gateway.conftest import (
    ROOT,
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

HI = [{"role": "user", "content": "tell me a story"}]
# Models outside the catalog (a unique name, the mock's suffixes) are counted with the
# documented heuristic: the tokenizer the gateway's checkpoints and settle fallback use for them.
HEURISTIC = "heuristic"


# -- 1. the deadline ends the call before the sweep could ----------------------------------------


@pytest.fixture(scope="module")
def deadline_gateway(provider_key: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A 6 s stale threshold, which the default deadline does not fit in (start-up refuses it:
    tests/gateway/test_call_end.py), with a deadline that does: 1 + 0.5 drain + 2 x 0.5 socket
    timeout = 2.5 s <= 3 s."""
    server = start_gateway(tmp_path_factory.mktemp("deadline-gateway"), workers=1,
                           QUOTA_STALE_HOLD_SECONDS="6", GATEWAY_CALL_DEADLINE_SECONDS="1",
                           GATEWAY_STREAM_DRAIN_SECONDS="0.5", REDIS_SOCKET_TIMEOUT="0.5")
    yield server
    server.stop()


def assert_ended_by_the_gateway(engine: QuotaEngine, tag: str) -> dict[str, Any]:
    """The hold ended by the gateway's own settle or release; a sweep at the 6 s threshold finds
    nothing left to take."""
    assert wait_until(lambda: engine.open_hold_ids(tag) == [], timeout=15)
    [event] = usage_events(engine, tag)
    assert event["outcome"] in ("settled", "released")
    assert engine.sweep(tag, stale_s=6).swept == ()
    assert engine.counter(tag, "tenant").pending == 0
    return event


def test_the_deadline_answers_504_and_releases_a_call_whose_upstream_never_answers(
    deadline_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    t = make_tenant()
    with pytest.raises(openai.APIStatusError) as info:
        client_for(deadline_gateway, t.plaintext, timeout=30).chat.completions.create(
            model="gpt-4o@first_byte_ms=20000", messages=HI)
    assert info.value.status_code == 504
    event = assert_ended_by_the_gateway(engine, t.tag)
    assert (event["outcome"], event["event"]["outcome"], event["event"]["st"]) == (
        "released", "upstream_timeout", 504)
    assert engine.counter(t.tag, "tenant").used == 0


def stream_text(server: GatewayServer, key: str, model: str) -> tuple[str, bool]:
    """Read a stream to its end as a client would: the text received, and whether it ended
    properly ([DONE]) rather than being cut."""
    text, done = [], False
    try:
        with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "stream": True, "messages": HI},
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices") or ():
                        text.append((choice.get("delta") or {}).get("content") or "")
    except httpx.HTTPError:
        pass  # a stream cut mid-way (the connection dropped)
    return "".join(text), done


def test_the_deadline_cuts_a_slow_stream_and_charges_at_least_what_it_delivered(
    deadline_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    t = make_tenant()
    text, done = stream_text(deadline_gateway, t.plaintext,
                             "gpt-4o@chunk_ms=200@output_tokens=50")  # 10 s upstream
    assert not done and text  # cut: some of the answer, not all of it
    event = assert_ended_by_the_gateway(engine, t.tag)
    assert (event["outcome"], event["event"]["outcome"], event["event"]["st"]) == (
        "settled", "deadline_counted", 504)
    # At least what the client got; the gateway may have read a little more of the upstream
    # for its usage after the cut (bounded by GATEWAY_STREAM_DRAIN_SECONDS): produced, billed.
    assert 0 < count_stream_text(text, HEURISTIC) <= event["event"]["out"]
    used = event["event"]["in"] + event["event"]["out"]
    assert engine.counter(t.tag, "tenant").used == used == int(event["actual"]) <= int(event["held"])


def test_the_deadline_ends_a_stalled_stream_that_sends_nothing_more(
    deadline_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    """No chunk arrives to let the relay notice the deadline: the router ends the send."""
    t = make_tenant()
    text, done = stream_text(deadline_gateway, t.plaintext,
                             "gpt-4o@chunk_ms=20000@output_tokens=5")
    assert (text, done) == ("", False)
    event = assert_ended_by_the_gateway(engine, t.tag)
    assert (event["outcome"], event["event"]["outcome"], event["event"]["st"]) == (
        "settled", "deadline_counted", 504)
    assert event["event"]["out"] == 0  # the input was sent upstream: it is charged


# -- 2. a worker killed with 40 streams in flight -------------------------------------------------


@dataclass
class ClientStream:
    """One streaming client: what it received, and the request id the gateway gave the call."""

    request_id: str = ""
    text: list[str] = field(default_factory=list)
    chunks: int = 0  # content chunks received: the mock sends one token per chunk
    error: BaseException | None = None

    async def run(self, http: httpx.AsyncClient, url: str, key: str, model: str) -> None:
        try:
            async with http.stream("POST", url, headers={"Authorization": f"Bearer {key}"},
                                   json={"model": model, "stream": True, "max_tokens": 200,
                                         "messages": HI}) as response:
                assert response.status_code == 200, await response.aread()
                self.request_id = response.headers["x-request-id"]
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices") or ():
                            content = (choice.get("delta") or {}).get("content")
                            if content:
                                self.text.append(content)
                                self.chunks += 1
        except httpx.HTTPError as exc:
            self.error = exc

    def tokens(self) -> int:
        return count_stream_text("".join(self.text), HEURISTIC)


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


def test_a_worker_killed_with_40_streams_in_flight_is_swept_with_what_its_clients_received(
    own_mock_upstream: tuple[MockUpstream, subprocess.Popen[bytes]], make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any, tmp_path: Path,
) -> None:
    """40 streams (50 ms per token, 200 tokens) through one gateway worker. Once every client has
    some of its answer, the upstream freezes (SIGSTOP): what each client has received is then
    final, and within one checkpoint interval its hold knows it (the checkpoint timer fires
    even though no chunk arrives). SIGKILL the worker, sweep: each swept row charges the input
    plus exactly what that client received, never more than the hold."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    mock, mock_process = own_mock_upstream
    t = make_tenant(plan="enterprise", requests_per_second=-1)
    model = f"{unique_model('fx-kill')}@chunk_ms=50@output_tokens=200"
    committed(django_db_blocker, lambda: create_provider_key(
        "kill", base_url=mock.base_url, secret=f"sk-kill-{uuid.uuid4().hex}", models=[model],
        tenant=Tenant.objects.get(pk=t.tenant_id), default_price=Price(1_000_000, 2_000_000)))
    server = start_gateway(tmp_path, workers=1)  # started after the key: its pool has it
    assert server.worker_pids() == []  # one process, which serves every stream
    try:
        streams = [ClientStream() for _ in range(40)]

        def hold(stream: ClientStream) -> dict[str, str]:
            return engine.client.hgetall(hold_key(t.tag, stream.request_id))

        async def scenario() -> None:
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:
                tasks = [asyncio.create_task(s.run(http, f"{server.base_url}/chat/completions",
                                                   t.plaintext, model)) for s in streams]
                assert await eventually(lambda: all(s.chunks >= 10 for s in streams), 60), \
                    [s.chunks for s in streams]
                os.kill(mock_process.pid, signal.SIGSTOP)  # nothing more comes from upstream

                def checkpoints_caught_up() -> bool:
                    return all((h := hold(s)).get("phase") == "streaming"
                               and int(h.get("progress", -1)) == s.tokens() for s in streams)

                assert await eventually(checkpoints_caught_up, 30), [
                    (hold(s).get("progress"), s.tokens()) for s in streams]
                # With one worker, uvicorn serves in its own process: that is the worker.
                os.kill(server.process.pid, signal.SIGKILL)
                await asyncio.gather(*tasks)
                os.kill(mock_process.pid, signal.SIGCONT)

        asyncio.run(scenario())
        assert all(s.error is not None for s in streams)  # every stream died with its worker
        ids = {s.request_id for s in streams}
        assert set(engine.open_hold_ids(t.tag)) == ids  # nobody ended them

        swept = engine.sweep(t.tag, stale_s=0).swept
        assert {s.request_id for s in swept} == ids
        assert all(s.basis == "streaming" for s in swept)
        events = {e["request_id"]: e for e in usage_events(engine, t.tag)}
        assert {e["outcome"] for e in events.values()} == {"swept"}
        for stream in streams:
            event = events[stream.request_id]
            charged_out = int(event["out"])
            # What the client received, as the gateway counts it; at least the mock's own count
            # (one token per chunk), and never above the hold.
            assert charged_out == stream.tokens() >= stream.chunks >= 10
            assert int(event["in"]) > 0
            assert int(event["in"]) + charged_out == int(event["actual"]) <= int(event["held"])
        counter = engine.counter(t.tag, "tenant")
        assert counter.pending == 0
        assert counter.used == sum(int(e["actual"]) for e in events.values())

        moved = committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
        assert moved == 40
        rows = committed(django_db_blocker, lambda: {
            r.request_id: r for r in UsageRecord.objects.filter(tenant_id=t.tenant_id)})
        for stream in streams:
            row = rows[stream.request_id]
            assert (row.status, row.sweep_basis) == ("swept", "streaming")
            assert row.output_tokens == stream.tokens()
            assert row.input_tokens + row.output_tokens <= row.held_tokens
    finally:
        server.stop()


async def eventually(predicate: Any, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


# -- 3. a late settle after a forced sweep converges to the upstream's bill ----------------------


def test_a_late_settle_after_a_forced_sweep_converges_to_the_upstreams_usage(
    gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, django_db_blocker: Any,
) -> None:
    """The sweep takes 8 live streams' holds (as if their gateway looked dead) and charges their
    checkpoints; the streams go on, and each settle corrects the charge once: the counters and,
    after the drain, the ledger equal the mock upstream's own usage record token for token."""
    t = make_tenant(plan="enterprise", requests_per_second=-1)
    base = unique_model("fx-late")
    model = f"{base}@chunk_ms=100@output_tokens=40"  # about 4 s per stream
    streams = [ClientStream() for _ in range(8)]

    async def scenario() -> list[Any]:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(s.run(http, f"{gateway.base_url}/chat/completions",
                                               t.plaintext, model)) for s in streams]

            def checkpointed() -> bool:
                return all(s.request_id and int(engine.client.hget(
                    hold_key(t.tag, s.request_id), "progress") or 0) > 0 for s in streams)

            assert await eventually(checkpointed, 30)
            swept = engine.sweep(t.tag, stale_s=0).swept  # forced: the streams are alive
            await asyncio.gather(*tasks)
            return list(swept)

    swept = asyncio.run(scenario())
    assert len(swept) == 8 and all(s.basis == "streaming" for s in swept)
    assert all(s.error is None and s.chunks == 40 for s in streams)
    ids = {s.request_id for s in streams}
    assert wait_until(lambda: len(usage_events(engine, t.tag)) == 16)
    events = usage_events(engine, t.tag)
    assert sorted(e["outcome"] for e in events) == ["corrected"] * 8 + ["swept"] * 8
    assert {e["request_id"] for e in events} == ids

    bill = billed(mock_upstream, base)
    assert bill["requests"] == 8 and bill["completion_tokens"] == 8 * 40
    counter = engine.counter(t.tag, "tenant")
    assert (counter.used, counter.pending) == (bill["total_tokens"], 0)

    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    rows = committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id)))
    assert {r.request_id for r in rows} == ids
    assert sum(r.input_tokens for r in rows) == bill["prompt_tokens"]
    assert sum(r.output_tokens for r in rows) == bill["completion_tokens"]
    assert all(r.sweep_basis == "streaming" and r.swept_output_tokens is not None
               and r.corrected_at is not None for r in rows)
