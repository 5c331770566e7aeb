"""A stopping gateway worker (gateway/shutdown.py, the router's lifespan and cancellation in
gateway/asgi.py, the uvicorn command in config/serve.py), in process. End to end, with a host
restarted under load: tests/gateway/test_e2e_many_hosts.py."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler
from django.http import StreamingHttpResponse

from gateway.asgi import GatewayRouter
from gateway.providers import ProviderPool
from gateway.runtime import GatewayRuntime
from gateway import shutdown
from gateway.shutdown import drain
from quotas.client import make_async_redis


class RecordingDatabase:
    """The runtime's database threads, recording the work given (the last-use flush)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def run(self, work: Any, *args: Any) -> None:
        self.calls.append((work.__name__, args))


def _runtime(redis_url: str) -> GatewayRuntime:
    return GatewayRuntime(
        engine=SimpleNamespace(client=make_async_redis(redis_url)),  # type: ignore[arg-type]
        http=None, transport=None, auth=None, catalog=None,  # type: ignore[arg-type]
        pool=ProviderPool([]), db=RecordingDatabase())  # type: ignore[arg-type]


def test_drain_awaits_the_calls_ends_and_what_they_detach_then_flushes_and_stops_the_loops(
    redis_url: str,
) -> None:
    ended: list[str] = []

    async def scenario() -> GatewayRuntime:
        runtime = _runtime(redis_url)
        loop_task = runtime.spawn(lambda: asyncio.sleep(3600))  # the listener, a flusher

        async def retried() -> None:
            await asyncio.sleep(0.2)
            ended.append("retried settle")

        async def settle() -> None:
            await asyncio.sleep(0.2)
            # Redis did not answer: the retry goes on in a task of its own (gateway/forward.py).
            runtime.detach(retried())
            ended.append("first attempt")

        runtime.detach(settle())
        runtime.used_keys = {7, 9}
        await drain(runtime, 10.0)
        assert loop_task.cancelled()
        await runtime.engine.client.aclose()
        return runtime

    runtime = asyncio.run(scenario())
    assert ended == ["first attempt", "retried settle"]
    assert not runtime.detached and not runtime.background
    [(work, args)] = runtime.db.calls  # type: ignore[attr-defined]
    assert work == "touch_last_used" and args[0] == {7, 9}


def test_drain_gives_up_on_the_calls_ends_at_its_timeout_and_says_so(
    redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> tuple[float, bool]:
        runtime = _runtime(redis_url)
        stuck = runtime.detach(asyncio.sleep(3600))  # a settle retrying while Redis is away
        loop = asyncio.get_running_loop()
        began = loop.time()
        await drain(runtime, 0.3)
        took = loop.time() - began
        await runtime.engine.client.aclose()
        return took, stuck.cancelled()  # not finished: cancelled with the worker's loops

    with caplog.at_level(logging.ERROR, logger="gateway.shutdown"):
        took, cancelled = asyncio.run(scenario())
    assert cancelled  # its hold is left to the sweep, which charges what the hold knew
    assert took < 3600
    assert "1 calls' ends not done after 0.3 s" in caplog.text


def test_drain_stops_waiting_for_a_loop_that_ignores_its_cancellation_and_says_so(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's own task whose cancellation is dropped below it (Python 3.11's
    asyncio.wait_for did so to the listener) must not keep the worker from stopping."""
    monkeypatch.setattr(shutdown, "STOP_GRACE_SECONDS", 0.2)

    async def scenario() -> float:
        runtime = _runtime(redis_url)
        release = asyncio.Event()

        async def stubborn_loop() -> None:
            while not release.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    pass  # injected: the cancellation dropped

        stubborn = runtime.spawn(stubborn_loop)
        polite = runtime.spawn(lambda: asyncio.sleep(3600))
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        began = loop.time()
        draining = asyncio.ensure_future(drain(runtime, 1.0))
        await asyncio.wait([draining], timeout=30)
        took = loop.time() - began
        stopped_first = not stubborn.done()
        # Let it go (without the bound, this is what ends the drain: a failure, not a hang).
        release.set()
        stubborn.cancel()
        await stubborn
        await draining
        assert polite.cancelled() and stopped_first
        await runtime.engine.client.aclose()
        return took

    with caplog.at_level(logging.ERROR, logger="gateway.shutdown"):
        took = asyncio.run(scenario())
    assert took < 10
    assert ("stopping with 1 background tasks still running 0.2 s after they were "
            "cancelled: test_drain_stops_waiting_for_a_loop_that_ignores_its_cancellation_and_"
            "says_so.<locals>.scenario.<locals>.stubborn_loop") in caplog.text


def test_drain_waits_for_a_call_still_ending_to_detach_its_end(redis_url: str) -> None:
    """uvicorn sends the lifespan shutdown as soon as it has cancelled the calls past its
    graceful timeout; a cancelled call detaches its end (the stream's drain and settle) only as
    it finishes its cancellation. The drain waits for the router's calls first (it found no
    detached work and the hold stayed open: 1 run in 3 of the e2e test here)."""
    ended: list[str] = []

    async def scenario() -> None:
        runtime = _runtime(redis_url)

        async def settle() -> None:
            await asyncio.sleep(0.1)
            ended.append("settled")

        async def call() -> None:
            await asyncio.sleep(0.2)  # still running when the lifespan shutdown comes
            runtime.detach(settle())

        await drain(runtime, 5.0, {asyncio.ensure_future(call())})
        await runtime.engine.client.aclose()

    asyncio.run(scenario())
    assert ended == ["settled"]


def test_a_call_cancelled_by_the_servers_shutdown_ends_as_if_its_client_had_left() -> None:
    """uvicorn cancels the calls still running when its graceful shutdown times out: the
    router tells a stream its client is gone (it then drains for its usage and settles,
    detached, which the lifespan awaits), and the cancellation goes on."""
    gone: list[str] = []
    sent: list[dict[str, Any]] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"
        await asyncio.sleep(3600)  # a long stream
        yield b"data: [DONE]\n\n"

    async def view(request: Any) -> StreamingHttpResponse:
        response = StreamingHttpResponse(chunks(), content_type="text/event-stream")
        response.tollgate_client_gone = lambda: gone.append("gone")  # type: ignore[attr-defined]
        return response

    async def scenario() -> BaseException | None:
        incoming = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if incoming:
                return incoming.pop(0)
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        path = "/v1/test"
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
                 "scheme": "http", "http_version": "1.1", "root_path": "",
                 "asgi": {"version": "3.0"}}
        call = asyncio.ensure_future(GatewayRouter(ASGIHandler(), {path: view})(
            scope, receive, send))
        while not any(m.get("body") == b"data: {}\n\n" for m in sent):
            await asyncio.sleep(0.01)
        call.cancel()  # as uvicorn does at its graceful shutdown's timeout
        try:
            await call
        except BaseException as exc:  # noqa: BLE001 - what the router let through
            return exc
        return None

    raised = asyncio.run(scenario())
    assert isinstance(raised, asyncio.CancelledError)
    assert gone == ["gone"]


def test_the_lifespan_shutdown_writes_the_tally_before_and_after_draining_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []

    async def drained(calls: Any) -> None:
        order.append("drain")

    monkeypatch.setattr("gateway.asgi.drain_worker", drained)
    monkeypatch.setattr("gateway.asgi.metrics.flush", lambda: order.append("tally"))
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    router = GatewayRouter(ASGIHandler(), {}, on_shutdown=(lambda: order.append("hook"),))
    asyncio.run(router({"type": "lifespan"}, receive, send))
    assert order[:3] == ["tally", "drain", "tally"] and order[-1] == "hook"
    assert [m["type"] for m in sent] == ["lifespan.startup.complete",
                                         "lifespan.shutdown.complete"]


def test_the_gateway_command_passes_the_drain_to_uvicorn(settings: Any) -> None:
    from config.serve import gateway_command, gateway_stop_seconds

    settings.GATEWAY_SHUTDOWN_DRAIN_SECONDS = 45
    command = gateway_command("0.0.0.0", 8000, 4)
    flag = command.index("--timeout-graceful-shutdown")
    assert command[flag + 1] == "45"
    assert gateway_stop_seconds() > 2 * 45
