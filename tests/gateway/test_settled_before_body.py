"""A non-streamed answer's body leaves only once its hold is settled: `_complete` begins the
settle and answers at once, the router (gateway/asgi.py) sends the headers while the settle's
script runs and the body after it landed, and a view served by Django waits for it before
returning. So a client holding its answer holds a settled call, as with a stream (settled before
its last byte), and the settle's round trip overlaps the answer's making and its headers.

Over the session's real Redis, the settle held back by the test (tests/gateway/test_call_end.py's
HeldBackSettle) or the wait gated by an event.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponse
from django.test import RequestFactory

from gateway import views
from gateway.asgi import GatewayRouter
from gateway.forward import SETTLED_BEFORE_BODY, _complete
from tests.gateway.test_call_end import (
    HeldBackSettle,
    async_engine,
    counter,
    new_tenant,
    open_call,
    settled_background,
    usage_events,
)

ANSWER = {"id": "c1", "object": "chat.completion", "model": "gpt-4o",
          "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "hi"}}],
          "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
SCOPE = {"type": "http", "method": "POST", "path": "/v1/test", "raw_path": b"/v1/test",
         "query_string": b"", "headers": [(b"content-type", b"application/json")],
         "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "scheme": "http",
         "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}


def test_complete_answers_before_its_settle_lands_and_its_hook_waits_for_it() -> None:
    tenant = new_tenant()

    async def scenario() -> tuple[tuple[int, int], tuple[int, int], bytes]:
        engine = HeldBackSettle(async_engine())
        call = await open_call(engine, tenant, stream=False)
        response = await _complete(call, httpx.Response(200, content=json.dumps(ANSWER).encode()))
        await asyncio.wait_for(engine.entered.wait(), 10)  # the settle began
        settled = getattr(response, SETTLED_BEFORE_BODY)
        waiting = asyncio.create_task(settled())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the answer is made; its hold is not settled yet
        before = counter(tenant)
        engine.go.set()
        await asyncio.wait_for(waiting, 10)
        after = counter(tenant)  # read as the body would leave: settled
        await settled_background(call)
        return before, after, response.content

    before, after, body = asyncio.run(scenario())
    assert before == (0, 200)  # still the hold (test_call_end's HELD), nothing used
    assert after == (13, 0)
    assert json.loads(body) == ANSWER
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["in"], event["event"]["out"]) == ("settled", 9, 4)


def _gated_view(gate: asyncio.Event, entered: list[str]) -> Any:
    """A view whose answer's hold ends when the test opens `gate`: the end runs in a task of its
    own, awaited shielded (as Call.begin_settle and Call.settled do)."""
    async def settle() -> None:
        await gate.wait()
        entered.append("settled")

    async def view(request: Any) -> HttpResponse:
        ending = asyncio.ensure_future(settle())

        async def settled() -> None:
            entered.append("settle awaited")
            await asyncio.shield(ending)

        response = HttpResponse(b'{"ok": true}', content_type="application/json")
        setattr(response, SETTLED_BEFORE_BODY, settled)
        view.ending = ending  # type: ignore[attr-defined]  # referenced until it ends
        return response

    return view


class _Client:
    """One POST through the router, as uvicorn drives it: the messages sent to the client, who
    stays until `leave` is set."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()
        self._incoming = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive(self) -> dict[str, Any]:
        if self._incoming:
            return self._incoming.pop(0)
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def types(self) -> list[str]:
        return [message["type"] for message in self.sent]


async def _until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)


async def _serving(client: _Client, gate: asyncio.Event, entered: list[str]) -> asyncio.Task[None]:
    """The router serving the gated view, once its body waits for the settle."""
    router = GatewayRouter(ASGIHandler(), {"/v1/test": _gated_view(gate, entered)})
    serving = asyncio.create_task(router(SCOPE, client.receive, client.send))
    await _until(lambda: entered)
    return serving


def test_the_router_sends_the_headers_then_the_body_once_settled() -> None:
    client = _Client()
    entered: list[str] = []

    async def scenario() -> None:
        gate = asyncio.Event()
        serving = await _serving(client, gate, entered)
        assert client.types() == ["http.response.start"]  # headers only
        assert client.sent[0]["status"] == 200
        gate.set()
        await asyncio.wait_for(serving, 10)

    asyncio.run(scenario())
    assert entered == ["settle awaited", "settled"]
    assert client.types()[:2] == ["http.response.start", "http.response.body"]
    assert b"".join(m.get("body", b"") for m in client.sent[1:]) == b'{"ok": true}'


def test_a_client_leaving_while_the_body_waits_for_the_settle_gets_no_body_and_cancels_nothing(
) -> None:
    client = _Client()
    entered: list[str] = []

    async def scenario() -> None:
        gate = asyncio.Event()
        serving = await _serving(client, gate, entered)
        client.leave.set()  # the client leaves while the body waits
        await asyncio.wait_for(serving, 10)
        assert entered == ["settle awaited"]  # the router is done; the settle is not
        gate.set()
        await _until(lambda: len(entered) == 2)

    asyncio.run(scenario())
    assert entered == ["settle awaited", "settled"]  # the shielded wait ran to its end
    assert client.types() == ["http.response.start"]  # and no body was sent


@pytest.mark.django_db
def test_a_view_served_by_django_returns_only_once_settled(monkeypatch: pytest.MonkeyPatch,
                                                           ) -> None:
    """Through Django's own handler (the test client, WSGI) nothing sends the headers first: the
    view itself waits for the hold's end before returning the answer."""
    entered: list[str] = []

    async def scenario() -> tuple[bool, int]:
        gate = asyncio.Event()
        view = _gated_view(gate, entered)

        async def handle(endpoint: Any, request: Any, request_id: str, started: float,
                         obs: Any) -> HttpResponse:
            return await view(request)

        monkeypatch.setattr(views, "_handle", handle)
        request = RequestFactory().post("/v1/chat/completions", data=b"{}",
                                        content_type="application/json")
        serving = asyncio.create_task(views.chat_completions(request))
        await _until(lambda: entered)
        returned_early = serving.done()
        gate.set()
        response = await asyncio.wait_for(serving, 10)
        return returned_early, response.status_code

    returned_early, status = asyncio.run(scenario())
    assert not returned_early
    assert status == 200
    assert entered == ["settle awaited", "settled"]



def test_an_end_that_fails_is_logged_and_the_answer_still_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    """Call.settled raises only if cancelled: an end that failed (a bug; Redis' own failures
    are retried by _try_end) is logged, and the answer waiting for it is sent."""
    tenant = new_tenant()

    async def scenario() -> None:
        call = await open_call(async_engine(), tenant, stream=False)

        async def broken() -> None:
            raise RuntimeError("a bug in the end of the hold")

        call._begin_end(broken())
        await call.settled()  # returns

    with caplog.at_level("ERROR", logger="gateway.forward"):
        asyncio.run(scenario())
    assert any("ending the hold of" in record.getMessage() and record.exc_info
               for record in caplog.records)


def test_a_client_leaving_while_the_real_answer_waits_for_its_settle_is_charged_exactly_once(
) -> None:
    """The real answer through the router: the settle held back, the headers out, the client
    leaves before the body. The hold still ends once, with the upstream's own usage: used ==
    what the upstream produced, nothing pending, one usage event."""
    tenant = new_tenant()
    client = _Client()

    async def scenario() -> None:
        engine = HeldBackSettle(async_engine())
        call = await open_call(engine, tenant, stream=False)

        async def view(request: Any) -> HttpResponse:
            return await _complete(call, httpx.Response(
                200, content=json.dumps(ANSWER).encode()))

        router = GatewayRouter(ASGIHandler(), {"/v1/test": view})
        serving = asyncio.create_task(router(SCOPE, client.receive, client.send))
        await asyncio.wait_for(engine.entered.wait(), 10)  # the settle began, held back
        await _until(lambda: client.sent)
        assert client.types() == ["http.response.start"]
        assert counter(tenant) == (0, 200)  # nothing charged yet: the hold is still pending
        client.leave.set()
        await asyncio.wait_for(serving, 10)
        engine.go.set()
        await settled_background(call)

    asyncio.run(scenario())
    assert client.types() == ["http.response.start"]  # the body never left
    assert counter(tenant) == (13, 0)  # 9 + 4: the upstream's usage, pending back to 0
    [event] = usage_events(tenant)
    assert (event["outcome"], event["event"]["in"], event["event"]["out"]) == ("settled", 9, 4)
