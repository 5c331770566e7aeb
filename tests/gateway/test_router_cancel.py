"""The router (gateway/asgi.py) runs a /v1 view in its own task and a listener task cancels it
when the client leaves first (_ClientWatch). What a view and the server see must be what they saw
when the view ran in a task of its own raced against the listener, or better:

- the client leaves while the view runs: the view is cancelled, the router returns normally and
  the call ends as a 499, with no cancellation left pending on the server's task;
- the server cancels the call (uvicorn's graceful shutdown timing out): the view is cancelled,
  ends as if its client had left, and the cancellation goes on to the server;
- the server cancels while a view cancelled by its client's leaving is still cleaning up: the
  server's cancellation still goes on (the two-task router lost it);
- the client leaves while a view cancelled by the server is cleaning up: the clean-up is not cut
  by a second cancellation;
- the client leaves once the answer is sent: nothing is cancelled, the call ends as a 200;
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
    """An ASGI client: its body, then `http.disconnect` once `leave()` is called (with
    `leave_after_answer`, as soon as the answer's last byte is sent)."""

    def __init__(self, leave_after_answer: bool = False) -> None:
        self.left = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.body_given = False
        self.leave_after_answer = leave_after_answer

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
        if self.leave_after_answer and message["type"] == "http.response.body" \
                and not message.get("more_body"):
            self.leave()


class Observation:
    """What the router tells a metered call's Observation: the status the call ended with."""

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def finish(self, status: int) -> None:
        self.statuses.append(status)

    def with_ids(self, work: Any, *args: Any) -> None:
        work(*args)


class View:
    """A view that waits until released; cancelled, it records it, then cleans up for as long as
    `cleaning` is not set (an await a second cancellation would cut), and re-raises, or with
    `swallow` answers anyway."""

    def __init__(self, swallow: bool = False, slow_cleanup: bool = False) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cleaning = asyncio.Event()
        if not slow_cleanup:
            self.cleaning.set()
        self.cancels = 0
        self.cleaned = False
        self.swallow = swallow
        self.observation = Observation()
        self.response: HttpResponse | None = None

    async def __call__(self, request: Any) -> HttpResponse:
        request.tollgate_observation = self.observation
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancels += 1
            try:
                await self.cleaning.wait()
            except asyncio.CancelledError:
                self.cancels += 1
                raise
            self.cleaned = True
            if not self.swallow:
                raise
        self.response = HttpResponse(b'{"ok": true}', content_type="application/json")
        return self.response


def _scope() -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": PATH, "raw_path": PATH.encode(),
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
            "scheme": "http", "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}


async def _serving(view: View, client: Client) -> asyncio.Task[None]:
    """The router serving one call, once the view has started."""
    router = GatewayRouter(ASGIHandler(), {PATH: view})
    server = asyncio.create_task(router(_scope(), client.receive, client.send))
    await view.started.wait()
    return server


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_client_leaving_cancels_the_view_and_the_router_returns_normally() -> None:
    async def main() -> None:
        view, client = View(), Client()
        server = await _serving(view, client)
        client.leave()
        await server  # returns: no cancellation reaches the server
        assert view.cancels == 1 and view.cleaned
        assert server.cancelling() == 0
        assert view.observation.statuses == [499]
        assert client.sent == []  # no answer was made, none is sent

    asyncio.run(main())


def test_the_server_cancelling_a_call_cancels_the_view_and_goes_on() -> None:
    async def main() -> None:
        view, client = View(), Client()
        server = await _serving(view, client)
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        assert view.cancels == 1 and view.cleaned
        assert view.observation.statuses == [499]

    asyncio.run(main())


@pytest.mark.parametrize(("first", "then", "cancels"), [
    # The server's own cancellation goes on, cutting the clean-up short.
    ("client", "server", 2),
    # A client leaving adds no second cancellation: the clean-up finishes.
    ("server", "client", 1),
])
def test_a_second_end_while_the_view_cleans_up(first: str, then: str, cancels: int) -> None:
    async def main() -> None:
        view, client = View(slow_cleanup=True), Client()
        server = await _serving(view, client)
        ends = {"client": client.leave, "server": server.cancel}
        ends[first]()
        await _turns()
        assert view.cancels == 1  # the first end reached the view, which cleans up
        ends[then]()
        await _turns()
        view.cleaning.set()
        with pytest.raises(asyncio.CancelledError):
            await server
        assert view.cancels == cancels
        assert view.cleaned is (cancels == 1)
        assert view.observation.statuses == [499]

    asyncio.run(main())


def test_a_client_leaving_once_the_answer_is_sent_cancels_nothing() -> None:
    async def main() -> None:
        view, client = View(), Client(leave_after_answer=True)
        server = await _serving(view, client)
        view.release.set()
        await server  # the listener ends during the router's last steps: no cancellation
        assert server.cancelling() == 0 and view.cancels == 0
        assert client.sent[0]["status"] == 200 and client.sent[-1]["body"] == b'{"ok": true}'
        assert view.observation.statuses == [200]
        assert view.response is not None and view.response.closed

    asyncio.run(main())


def test_a_view_answering_despite_the_cancellation_leaves_none_pending() -> None:
    async def main() -> None:
        view, client = View(swallow=True), Client()
        server = await _serving(view, client)
        client.leave()
        await server
        assert view.cancels == 1 and view.cleaned
        assert server.cancelling() == 0
        # The answer was made after the client left: sent to the (gone) client as before.
        assert client.sent[0]["status"] == 200
        assert view.observation.statuses == [200]

    asyncio.run(main())
