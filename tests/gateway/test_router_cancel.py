"""The router (gateway/asgi.py) runs a /v1 view in its own task and a listener task cancels it
when the client leaves first (_ClientWatch). What a view and the server see must be what they saw
when the view ran in a task of its own raced against the listener:

- the client leaves while the view runs: the view is cancelled, the router returns normally and
  the call ends as a 499, with no cancellation left pending on the server's task;
- the server cancels the call (uvicorn's graceful shutdown timing out): the view is cancelled,
  ends as if its client had left, and the cancellation goes on to the server;
- both at once: the server's cancellation still goes on;
- the client leaves after the answer was sent: nothing is cancelled;
- a view that turns the cancellation into an answer: the router takes its own cancellation back
  and nothing is left pending."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponse

from gateway.asgi import GatewayRouter

PATH = "/v1/test"


class Client:
    """An ASGI client: its body, then `http.disconnect` once `leave()` is called."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.body_given = False

    def leave(self) -> None:
        self.left.set()

    async def receive(self) -> dict[str, Any]:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def _scope() -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": PATH, "raw_path": PATH.encode(),
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
            "scheme": "http", "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}


def _router(view: Any) -> GatewayRouter:
    return GatewayRouter(ASGIHandler(), {PATH: view})


class Recording:
    """A view that waits until released, recording whether it was cancelled."""

    def __init__(self, swallow: bool = False) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.swallow = swallow
        self.response: HttpResponse | None = None

    async def __call__(self, request: Any) -> HttpResponse:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            if not self.swallow:
                raise
            await asyncio.sleep(0)  # a view going on after it: an await must not be cut again
        self.response = HttpResponse(b'{"ok": true}', content_type="application/json")
        return self.response


def test_a_client_leaving_cancels_the_view_and_the_router_returns_normally() -> None:
    async def main() -> None:
        view, client = Recording(), Client()
        server = asyncio.create_task(_router(view)(_scope(), client.receive, client.send))
        await view.started.wait()
        client.leave()
        await server  # returns: no cancellation reaches the server
        assert view.cancelled
        assert server.cancelling() == 0
        assert client.sent == []  # no answer was made, none is sent

    asyncio.run(main())


def test_the_server_cancelling_a_call_cancels_the_view_and_goes_on() -> None:
    async def main() -> None:
        view, client = Recording(), Client()
        server = asyncio.create_task(_router(view)(_scope(), client.receive, client.send))
        await view.started.wait()
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        assert view.cancelled

    asyncio.run(main())


def test_the_server_cancelling_while_the_client_leaves_still_goes_on() -> None:
    async def main() -> None:
        view, client = Recording(), Client()
        server = asyncio.create_task(_router(view)(_scope(), client.receive, client.send))
        await view.started.wait()
        client.leave()
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        assert view.cancelled

    asyncio.run(main())


def test_a_client_leaving_after_the_answer_cancels_nothing() -> None:
    async def main() -> None:
        view, client = Recording(), Client()
        server = asyncio.create_task(_router(view)(_scope(), client.receive, client.send))
        await view.started.wait()
        view.release.set()
        await server
        client.leave()
        await asyncio.sleep(0)
        assert not view.cancelled
        assert client.sent[0]["status"] == 200 and client.sent[-1]["body"] == b'{"ok": true}'
        assert view.response is not None and view.response.closed

    asyncio.run(main())


def test_a_view_answering_despite_the_cancellation_leaves_none_pending() -> None:
    async def main() -> None:
        view, client = Recording(swallow=True), Client()
        server = asyncio.create_task(_router(view)(_scope(), client.receive, client.send))
        await view.started.wait()
        client.leave()
        await server
        assert view.cancelled
        assert server.cancelling() == 0
        # The answer was made after the client left: sent to the (gone) client as before.
        assert client.sent[0]["status"] == 200

    asyncio.run(main())
