"""The router (gateway/asgi.py) closes a /v1 response as Django's close() does, but without the
request_finished signal, as it never sends request_started: the response's resource closers run
(once, each, even after one fails), it is marked closed, and no receiver of the signal runs."""
from __future__ import annotations

import asyncio
from typing import Any

from django.core.handlers.asgi import ASGIHandler
from django.core.signals import request_finished
from django.http import HttpResponse

from gateway.asgi import GatewayRouter


def _exchange(path: str) -> tuple[dict[str, Any], Any, Any, list[dict[str, Any]]]:
    """A POST of `path` for the router: its scope, receive (the body, then a client that stays
    until the router is done), send, and the messages sent."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # the client stays until the router is done
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "scheme": "http", "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}
    return scope, receive, send, sent


def _serve(view: Any, path: str = "/v1/test") -> list[dict[str, Any]]:
    """One POST through the router in front of Django's ASGI handler; the messages sent."""
    scope, receive, send, sent = _exchange(path)
    asyncio.run(GatewayRouter(ASGIHandler(), {path: view})(scope, receive, send))
    return sent


def test_a_v1_response_is_closed_without_the_request_finished_signal() -> None:
    closed: list[str] = []
    finished: list[Any] = []
    answered: list[HttpResponse] = []

    def failing() -> None:
        closed.append("failing")
        raise RuntimeError("a closer that fails does not stop the others")

    async def view(request: Any) -> HttpResponse:
        response = HttpResponse(b'{"ok": true}', content_type="application/json")
        response._resource_closers.extend([failing, lambda: closed.append("second")])
        answered.append(response)
        return response

    def receiver(**kwargs: Any) -> None:
        finished.append(kwargs)

    request_finished.connect(receiver)
    try:
        sent = _serve(view)
    finally:
        request_finished.disconnect(receiver)
    assert sent[0]["status"] == 200 and sent[-1]["body"] == b'{"ok": true}'
    assert closed == ["failing", "second"]
    assert answered[0].closed and answered[0]._resource_closers == []
    assert finished == []


def test_the_disconnect_listener_is_cancelled_without_a_wait_and_ends_cancelled(
        caplog: Any) -> None:
    # The router does not await the listener it cancels once the answer is sent (a loop turn
    # ahead of the call's last steps and of the next request, docs/benchmarks.md): when the
    # router returns the listener is still ending; at the loop's next turn it has ended
    # cancelled (it waits for a disconnect that never came), and nothing is logged of it.
    path = "/v1/test"
    scope, receive, send, _ = _exchange(path)

    async def view(request: Any) -> HttpResponse:
        return HttpResponse(b"{}", content_type="application/json")

    async def scenario() -> None:
        before = asyncio.all_tasks()
        await GatewayRouter(ASGIHandler(), {path: view})(scope, receive, send)
        listeners = list(asyncio.all_tasks() - before)
        assert len(listeners) == 1 and not listeners[0].done()
        await asyncio.sleep(0)
        assert listeners[0].cancelled()

    with caplog.at_level("WARNING"):
        asyncio.run(scenario())
    assert caplog.records == []
