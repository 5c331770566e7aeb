"""A lean ASGI path for the gateway's endpoints, in front of Django's ASGI handler.

Django's ASGI handler runs every `MiddlewareMixin` hook and the `request_started` /
`request_finished` signal receivers through `sync_to_async`, which starts a thread per request:
measured, that was most of the gateway's per-request CPU. The /v1 views need none of it (they
authenticate API keys themselves, use no session, CSRF or messages, and do their database work on
their own threads), so their paths go straight to the views; everything else (admin, the
console, the management API) goes through Django as usual.

The disconnect handling follows Django's: the view runs in a task raced against
`http.disconnect`, and when the client leaves first the task is cancelled. A streaming answer is
then told so, and finishes reading the upstream for its usage in the background.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from django.core.handlers.asgi import ASGIHandler
from django.core.exceptions import RequestAborted
from django.http import HttpResponseBase

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
            body_file = await handler.read_body(receive)
        except RequestAborted:
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
        response = sent.get("response")
        if response is not None and not tasks[1].cancelled() and tasks[1].exception() is None:
            response.close()
        elif response is not None:
            client_gone = getattr(response, "tollgate_client_gone", None)
            if client_gone is not None:
                client_gone()
        body_file.close()
