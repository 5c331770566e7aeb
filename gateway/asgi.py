"""A lean ASGI path for the gateway's endpoints, in front of Django's ASGI handler.

Django's ASGI handler runs every `MiddlewareMixin` hook and the `request_started` /
`request_finished` signal receivers through `sync_to_async`, which starts a thread per request:
measured, that was most of the gateway's per-request CPU. The /v1 views need none of it (they
authenticate API keys themselves, use no session, CSRF or messages, and do their database work on
their own threads), so their paths go straight to the views; everything else (admin, the
console, the management API) goes through Django as usual.

The disconnect handling follows Django's: the view runs in a task raced against
`http.disconnect`, and when the client leaves first the task is cancelled. A streaming answer is
then told so, and finishes reading the upstream for its usage in the background; likewise when
it reaches its call's deadline or sending it fails.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponseBase

from gateway.errors import bad_request

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
View = Callable[..., Awaitable[HttpResponseBase]]


class GatewayRouter:
    def __init__(self, django_app: ASGIHandler, routes: dict[str, View]) -> None:
        self.django_app = django_app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        view = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if view is None:
            await self.django_app(scope, receive, send)
            return
        handler = self.django_app
        try:
            body_file = await _read_body(scope, receive, settings.GATEWAY_MAX_BODY_BYTES)
        except RequestAborted:
            return
        if body_file is None:  # too large: refused before reading it, and before any auth
            refusal = bad_request(
                f"The request body is larger than {settings.GATEWAY_MAX_BODY_BYTES} bytes.",
                None, "request_too_large").response()
            refusal["x-request-id"] = f"req_{secrets.token_hex(12)}"
            await handler.send_response(refusal, send)
            return
        request, error_response = handler.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await handler.send_response(error_response, send)
            return
        sent: dict[str, HttpResponseBase] = {}

        async def process() -> None:
            response = await view(request)
            sent["response"] = response
            deadline = getattr(response, "tollgate_deadline", None)
            if deadline is None:
                await handler.send_response(response, send)
                return
            # A stream ends at its call's deadline (GATEWAY_CALL_DEADLINE_SECONDS) even when no
            # chunk comes to let the relay notice: a stalled upstream, or a client that stopped
            # reading while the relay waits to send. The hold then ends as if the client left.
            async with asyncio.timeout_at(deadline):
                await handler.send_response(response, send)

        tasks = [asyncio.create_task(handler.listen_for_disconnect(receive)),
                 asyncio.create_task(process())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if not task.done():
                task.cancel()
            try:
                await task
            except (asyncio.CancelledError, RequestAborted):
                pass
            except TimeoutError:
                log.warning("%s: the stream reached the call's deadline; cut", scope.get("path"))
            except Exception:  # noqa: BLE001 - e.g. sending to a socket that broke
                log.exception("sending the response of %s failed", scope.get("path"))
        response = sent.get("response")
        if response is not None:
            sending = tasks[1]
            if sending.cancelled() or sending.exception() is not None:
                # Not sent to the end (the client left, the deadline passed, the socket broke):
                # a stream finishes reading its upstream for the usage and settles by itself.
                client_gone = getattr(response, "tollgate_client_gone", None)
                if client_gone is not None:
                    client_gone()
            if not sending.cancelled():
                response.close()
        body_file.close()


async def _read_body(scope: Scope, receive: Receive, limit: int) -> IO[bytes] | None:
    """The request body, or None when it exceeds `limit` (checked before reading when the
    client says its length, and while reading a chunked one), so nobody can fill the disk."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    body = tempfile.SpooledTemporaryFile(max_size=1024 * 1024, mode="w+b")
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            body.close()
            raise RequestAborted
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            body.close()
            return None
        body.write(chunk)
        if not message.get("more_body", False):
            break
    body.seek(0)
    return body
