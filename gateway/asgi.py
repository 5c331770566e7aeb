"""A lean ASGI path for the gateway's endpoints, in front of Django's ASGI handler.

Django's ASGI handler runs every `MiddlewareMixin` hook and the `request_started` /
`request_finished` signal receivers through `sync_to_async`, which starts a thread per request:
measured, that was most of the gateway's per-request CPU. The /v1 views need none of it (they
authenticate API keys themselves, use no session, CSRF or messages, and do their database work on
their own threads), so their paths go straight to the views; everything else (admin, the
console, the management API) goes through Django as usual.

Every request body, on every path, is read under a deadline (REQUEST_BODY_TIMEOUT_SECONDS from
the headers: a client trickling its body gets a 408 and the connection is closed) and a size
limit checked before anything else runs: GATEWAY_MAX_BODY_BYTES on /v1 (read here, before auth),
REQUEST_MAX_BODY_BYTES on every path Django serves, whose handler would otherwise spool any body
to disk before a view could refuse it (413 by Content-Length without reading a byte, else as
soon as a chunked body passes the limit).

The disconnect handling follows Django's, in one task instead of two: the view runs in the
router's own task while a listener task waits for `http.disconnect`, and when the client leaves
first the view is cancelled (_ClientWatch). A streaming answer is then told so, and finishes
reading the upstream for its usage in the background; likewise when it reaches its call's
deadline or sending it fails.
"""
from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponseBase

from gateway import metrics
from gateway.deadlines import deadline_at
from gateway.errors import (
    GatewayError,
    body_not_received,
    body_too_large,
    new_request_id,
    refusal_of,
)
from gateway.forward import SETTLED_BEFORE_BODY
from gateway.observe import OTHER_ENDPOINT, Observation, count_other
from gateway.shutdown import drain_worker
from gateway.startup import flush_active_marks
from gateway.v1_request import v1_request
from quotas.loop_spin import loop_spin

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
View = Callable[..., Awaitable[HttpResponseBase]]


class GatewayRouter:
    """`routes`: exact paths -> view(request). `prefixes`: paths with an id in them (e.g.
    "/v1/responses/") -> view(request, rest=<the path after the prefix>), looked up only when no
    exact path matches (the hot path's lookup stays one dict access).

    It answers the ASGI lifespan protocol (Django's handler refuses it): at the shutdown of a
    uvicorn worker told to stop (after its last request) it writes the worker's metrics tally
    (gateway/metrics.py), then runs `on_shutdown` (config/asgi.py: the spans' flush when
    tracing). Exit hooks cannot do it there: uvicorn ends a worker by raising again the SIGTERM
    it handled, so the process dies of it and `atexit` never runs. Only the lifespan scope
    pays: a request's path through the router is unchanged."""

    def __init__(self, django_app: ASGIHandler, routes: dict[str, View],
                 prefixes: dict[str, View] | None = None,
                 on_shutdown: Sequence[Callable[[], None]] = ()) -> None:
        self.django_app = django_app
        self.routes = routes
        self.prefixes = tuple((prefixes or {}).items())
        self.on_shutdown = tuple(on_shutdown)
        # The /v1 calls in flight (their server tasks): a stopping worker's drain waits for
        # them first, since a call uvicorn cancelled detaches its end only once it has run its
        # cancellation (gateway/shutdown.py).
        self.calls: set[asyncio.Task[Any]] = set()

    def _view(self, path: str) -> View | None:
        view = self.routes.get(path)
        if view is not None:
            return view
        for prefix, prefixed in self.prefixes:
            if path.startswith(prefix):
                return functools.partial(prefixed, rest=path[len(prefix):])
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        view = self._view(scope.get("path", "")) if scope["type"] == "http" else None
        if view is None:
            if scope["type"] == "http":
                await _bounded_django(self.django_app, scope, receive, send)
            elif scope["type"] == "lifespan":
                await self._lifespan(receive, send)
            else:
                await self.django_app(scope, receive, send)
            return
        handler = self.django_app
        arrived = time.perf_counter()
        task = asyncio.current_task()
        if task is not None:
            self.calls.add(task)
            task.add_done_callback(self.calls.discard)
            # The loop's spin reads how many calls are in flight: it polls only for one.
            loop_spin(task.get_loop()).in_flight = self.calls
        try:
            body_file = await _read_body(scope, receive, settings.GATEWAY_MAX_BODY_BYTES,
                                         _body_deadline())
        except RequestAborted:
            return  # the client left mid-body: no call was made, none is counted
        except BodyRefused as refused:  # before any auth or parsing
            body_s = time.perf_counter() - arrived
            error = refused.error()
            request_id = new_request_id()
            await handler.send_response(_v1_refusal(error, request_id), send)
            _refused_before_view(view, error.status, error.refusal or "", request_id,
                                 (arrived, body_s))
            return
        body_s = time.perf_counter() - arrived
        request, error_response = v1_request(scope, body_file)
        if request is None:  # Django could not make a request of it (e.g. undecodable)
            body_file.close()
            request_id = error_response["x-request-id"] = new_request_id()
            await handler.send_response(error_response, send)
            _refused_before_view(view, error_response.status_code, "", request_id,
                                 (arrived, body_s))
            return
        # For the call's Observation (gateway/observe.py), which the view makes: when the call
        # arrived and how long its body took to come (the client's time, not the gateway's).
        request.tollgate_received = (arrived, body_s)
        sent: dict[str, HttpResponseBase] = {}

        async def process() -> None:
            response = await view(request)
            sent["response"] = response
            deadline = getattr(response, "tollgate_deadline", None)
            if deadline is None:
                settled = getattr(response, SETTLED_BEFORE_BODY, None)
                await _send_answer(handler, response,
                                   send if settled is None else _body_after(settled, send))
                return
            # A stream ends at its call's deadline (GATEWAY_CALL_DEADLINE_SECONDS) even when no
            # chunk comes to let the relay notice: a stalled upstream, or a client that stopped
            # reading while the relay waits to send. The hold then ends as if the client left.
            async with deadline_at(deadline):
                await handler.send_response(response, send)

        # The view runs in this task; a listener task cancels it when the client leaves first
        # (one task and no asyncio.wait per call: see _ClientWatch).
        watch = _ClientWatch(asyncio.current_task())
        listener = asyncio.create_task(handler.listen_for_disconnect(receive))
        listener.add_done_callback(watch.listener_done)
        sending = _Sending()
        try:
            await process()
        except asyncio.CancelledError:
            sending.cancelled = True
        except Exception as error:  # noqa: BLE001 - logged below, with the call's ids
            sending.error = error
        except BaseException:  # e.g. SystemExit: nothing more to do for this call
            listener.cancel()
            raise
        finally:
            watch.finish()
        # The metered views' Observation (None for the other paths): its ids go on the lines
        # below (Observation.with_ids binds them, whatever context the code runs in).
        observation = request.__dict__.get("tollgate_observation")
        if not listener.done():
            # Not awaited: that would take a turn of the loop before the call's last steps below,
            # ahead of the next request on this connection (about 10 us of a one-client call,
            # docs/benchmarks.md). Cancelled while it waits, it can only end cancelled; its end
            # is read when it comes all the same.
            listener.cancel()
            listener.add_done_callback(functools.partial(
                _log_failure, path=scope.get("path"), observation=observation))
        else:
            _log_failure(listener, scope.get("path"), observation)
        response = sent.get("response")
        if sending.error is not None:
            _log_sending_failure(sending.error, scope.get("path"), observation,
                                 answered=response is not None)
        # Finished here, once the answer's last byte is sent or the client left (before
        # close(), whose hook would count a cut stream as sent).
        if observation is not None:
            observation.finish(_sent_status(response, sending))
        elif (other := _other_endpoint(view, response)) is not None:
            count_other(other, _sent_status(response, sending), refusal_of(response),
                        time.perf_counter() - arrived)
        if response is not None:
            if sending.cancelled or sending.error is not None:
                # Not sent to the end (the client left, the deadline passed, the socket broke):
                # a stream finishes reading its upstream for the usage and settles by itself.
                client_gone = getattr(response, "tollgate_client_gone", None)
                if client_gone is not None:
                    client_gone()
            if not sending.cancelled:
                _close(response)
        sending.error = None  # its traceback holds this frame: no cycle left for the GC
        body_file.close()
        # uvicorn cancels a call still running when its graceful shutdown times out
        # (GATEWAY_SHUTDOWN_DRAIN_SECONDS): it ended above as if its client had left (a stream
        # drains for its usage and settles, detached: the lifespan shutdown awaits that,
        # gateway/shutdown.py), and the cancellation goes on.
        if watch.stopping():
            raise asyncio.CancelledError


    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                # The tally so far first (a drain that outlasts the process manager's patience
                # must not take the figures with it), then the calls' detached ends and the
                # buffered writes, bounded by GATEWAY_SHUTDOWN_DRAIN_SECONDS, whose figures go in
                # the tally written below.
                metrics.flush()
                try:
                    await drain_worker(self.calls)
                except Exception:  # noqa: BLE001 - the tally and the hooks still run
                    log.exception("draining the worker at shutdown failed")
                # The server serves nothing any more: the writes may block the loop (a metrics
                # write is a few mmap writes; the spans' export is bounded by its timeout).
                metrics.flush()
                await flush_active_marks()
                for hook in self.on_shutdown:
                    try:
                        hook()
                    except Exception:  # noqa: BLE001 - the next hook and the shutdown go on
                        log.exception("shutdown hook %r failed", hook)
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _send_answer(handler: ASGIHandler, response: HttpResponseBase, send: Send) -> None:
    """Django's send_response, in two messages for a whole answer: the headers, then the body
    in one piece. Django's builds the header list through its generic checks and slices the
    body into 64 KiB messages from a copy of it, work a /v1 answer never needs (its body is in
    memory already, and uvicorn writes a message as one piece whatever its size); measured in
    a one-client call, 22 us against 12 (docs/benchmarks.md, "the /v1 request made with less
    work"). A stream, or an answer with cookies (no /v1 answer sets any), goes Django's way.
    The answer declares its length: the client reads it without chunked framing (uvicorn frames
    a body of unknown length in chunks); not a 204 or 304, which must not (RFC 9110, 8.6)."""
    if response.streaming or response.cookies:
        await handler.send_response(response, send)
        return
    body = response.content
    headers = [(name.encode("ascii"), value.encode("latin1")) for name, value in response.items()]
    if response.status_code not in (204, 304) and not response.has_header("Content-Length"):
        headers.append((b"content-length", b"%d" % len(body)))
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _body_after(settled: Callable[[], Awaitable[None]], send: Send) -> Send:
    """`send`, whose first body message waits for `settled()`: the answer's headers go out (and
    the view's return, the headers' encoding) while its hold's end is in flight; the answer's
    body, only once the hold has ended. The wait is shielded (Call.settled): a client leaving
    meanwhile cancels this send, never the settle."""
    waiting = True

    async def sending(message: dict[str, Any]) -> None:
        nonlocal waiting
        if waiting and message["type"] == "http.response.body":
            waiting = False
            await settled()
        await send(message)

    return sending


def _close(response: HttpResponseBase) -> None:
    """Django's HttpResponseBase.close() (its resource closers, the stream's and the metrics'),
    without the request_finished signal: like request_started, which this path never sends,
    its receivers (closing this thread's database connections and caches, resetting the
    URLconf) have nothing to undo on the event loop, where the /v1 views use neither; sending
    it was 2-3 % of a call's CPU."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:  # noqa: BLE001, S110 - as Django's close(): the others still run
            pass
    response._resource_closers.clear()
    response.closed = True


def _log_failure(task: asyncio.Task[None], path: str | None, observation: Observation | None,
                 ) -> None:
    """Log how the disconnect listener failed, if it did. Read from the task rather than
    re-raised by awaiting it: a re-raised exception's traceback holds the router's frame, which
    holds the task that holds the exception, a reference cycle per request (the listener ends
    with RequestAborted whenever a client leaves) left for the cyclic GC to find."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None or isinstance(error, RequestAborted):
        return
    if not isinstance(error, Exception):
        raise error
    _log_sending_failure(error, path, observation, answered=True)


def _log_sending_failure(error: Exception, path: str | None,
                         observation: Observation | None, *, answered: bool) -> None:
    """Log a failure of the view (`answered` False: it made no answer) or of sending its
    answer, with the call's ids when it is a metered call's."""
    if isinstance(error, RequestAborted):
        return
    if observation is not None:
        observation.with_ids(_log_error, error, path, answered)
    else:
        _log_error(error, path, answered)


def _log_error(error: Exception, path: str | None, answered: bool) -> None:
    if not answered:  # a bug in the view: the server sends its 500
        log.error("the view of %s failed; the server answers 500", path, exc_info=error)
    elif isinstance(error, TimeoutError):
        log.warning("%s: the stream reached the call's deadline; cut", path)
    else:  # e.g. sending to a socket that broke
        log.error("sending the response of %s failed", path, exc_info=error)


def _sent_status(response: HttpResponseBase | None, sending: _Sending) -> int:
    """How the call ended for its client: the status sent, else 499 (the client left before the
    answer's end, or sending to it failed), 504 (a stream cut at the call's deadline), or 500
    (the view raised: no answer was made, the server sends its 500)."""
    if sending.cancelled:
        return 499
    if response is None:
        return 500  # the view raised: the server answers 500 (uvicorn's)
    if sending.error is None:
        return response.status_code
    return 504 if isinstance(sending.error, TimeoutError) else 499


class _Sending:
    """How the view and the sending of its answer ended: cancelled (the client left, or the
    server stopping), an error raised (a socket that broke, a stream's deadline), or neither."""

    __slots__ = ("cancelled", "error")

    def __init__(self) -> None:
        self.cancelled = False
        self.error: Exception | None = None


class _ClientWatch:
    """Cancels the router's task when the disconnect listener ends while the view still runs:
    the client left (or sent what no client sends after its body). It replaces a second task
    for the view and an `asyncio.wait` racing the two (11 us of a one-client call inside the
    worker, docs/benchmarks.md). The router's code after the view now runs in the view's
    context (its request ids bound).

    `finish()`, once the view has ended however it did, takes back this watch's own
    cancellation (Task.uncancel), so that only a cancellation from elsewhere (uvicorn stopping
    the call at its graceful shutdown's timeout) is left to go on. The view always receives the
    cancellation before it ends: cancel() is called only while it runs, and a task is always
    resumed with a cancellation requested while it waited or was about to resume."""

    __slots__ = ("task", "running", "cancelled_it")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.running = True
        self.cancelled_it = False

    def listener_done(self, _listener: asyncio.Task[None]) -> None:
        # Not when the server is cancelling the call already: the view is ending, and a second
        # cancellation would cut its clean-up short (as before, when the router cancelled the
        # listener first).
        if self.running and self.task is not None and self.task.cancelling() == 0:
            self.cancelled_it = True
            self.task.cancel()

    def finish(self) -> None:
        """The view has ended: no more cancelling; this watch's own is taken back."""
        self.running = False
        if self.cancelled_it and self.task is not None:
            self.task.uncancel()

    def stopping(self) -> bool:
        """A cancellation other than this watch's is pending: the server stops the call."""
        return self.task is not None and self.task.cancelling() > 0


class BodyRefused(Exception):
    """A request body refused while reading it: larger than its limit (`too_large`), or not
    all there by the read deadline (`timeout`, a client trickling it: slowloris)."""

    def __init__(self, reason: str, limit: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.limit = limit

    def error(self) -> GatewayError:
        """The refusal in OpenAI's shape (/v1's answer); its message is what every path says."""
        if self.reason == "timeout":
            return body_not_received(settings.REQUEST_BODY_TIMEOUT_SECONDS)
        return body_too_large(self.limit)


def _body_deadline() -> float:
    """When the body must be complete (loop clock): REQUEST_BODY_TIMEOUT_SECONDS from now."""
    return asyncio.get_running_loop().time() + settings.REQUEST_BODY_TIMEOUT_SECONDS


def _declared_too_large(scope: Scope, limit: int) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.isdigit() and int(value) > limit
    return False


async def _receive_by(receive: Receive, deadline: float, limit: int) -> dict[str, Any]:
    try:
        async with deadline_at(deadline):
            return await receive()
    except TimeoutError:
        raise BodyRefused("timeout", limit) from None


async def _read_body(scope: Scope, receive: Receive, limit: int, deadline: float) -> IO[bytes]:
    """The request body; BodyRefused when it exceeds `limit` (checked before reading when the
    client says its length, and while reading a chunked one), so nobody can fill the memory or
    the disk, or when it is not complete by `deadline`, so nobody can hold a worker's request
    open by trickling it."""
    if _declared_too_large(scope, limit):
        raise BodyRefused("too_large", limit)
    message = await _receive_by(receive, deadline, limit)
    if message["type"] == "http.disconnect":
        raise RequestAborted
    chunk = message.get("body", b"")
    if len(chunk) > limit:
        raise BodyRefused("too_large", limit)
    if not message.get("more_body", False) and len(chunk) <= _SPOOL_BYTES:
        # The whole body in one message (a usual call): where the spooled file below would
        # keep it too, without its wrapper.
        return io.BytesIO(chunk)
    body = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES, mode="w+b")
    size = len(chunk)
    try:
        body.write(chunk)
        while message.get("more_body", False):
            message = await _receive_by(receive, deadline, limit)
            if message["type"] == "http.disconnect":
                raise RequestAborted
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyRefused("too_large", limit)
            body.write(chunk)
    except BaseException:
        body.close()
        raise
    body.seek(0)
    return body


# A body up to this size is kept in memory, a larger one spooled to a temporary file.
_SPOOL_BYTES = 1024 * 1024


def _v1_refusal(error: GatewayError, request_id: str) -> HttpResponseBase:
    """A refused /v1 body in OpenAI's shape; the connection is closed after it (the rest of the
    body is not worth reading)."""
    response = error.response()
    response["x-request-id"] = request_id
    response["Connection"] = "close"
    return response


def _other_endpoint(view: View, response: HttpResponseBase | None) -> str | None:
    """The request metrics' label of a call of an unmetered /v1 endpoint: its answer's, else its
    view's (a prefix route's view is a partial of it); None for a path not counted (the health
    checks) and for the metered endpoints (their Observation counts them)."""
    label = getattr(response, OTHER_ENDPOINT, None)
    if label is None:
        label = getattr(getattr(view, "func", view), OTHER_ENDPOINT, None)
    return label


def _refused_before_view(view: View, status: int, refusal: str, request_id: str,
                         received: tuple[float, float]) -> None:
    """A metered call (views.py marks their views with their endpoint) refused before its view
    ran is counted and access-logged like the refusals before reading its body that the view
    makes (model "", no caller); `received` as the Observation takes it. Only on this path:
    nothing is added to an accepted call."""
    endpoint = getattr(view, "tollgate_endpoint", None)
    if endpoint is None:
        other = _other_endpoint(view, None)
        if other is not None:  # an unmetered /v1 endpoint; the health checks are not counted
            count_other(other, status, refusal, time.perf_counter() - received[0])
        return
    observation = Observation(endpoint, received)
    observation.request_id = request_id
    observation.refusal = refusal
    observation.finish(status)


class _BoundedReceive:
    """Django's handler reads (and spools to disk) the whole body before any view runs, with
    no limit of its own: this receive() ends the body at REQUEST_MAX_BODY_BYTES or at the read
    deadline by telling Django the client left, and records why, so the router answers."""

    __slots__ = ("deadline", "done", "limit", "receive", "refused", "size")

    def __init__(self, receive: Receive, deadline: float, limit: int) -> None:
        self.receive = receive
        self.deadline = deadline
        self.limit = limit
        self.size = 0
        self.done = False  # the body is complete: from here on only disconnects are awaited
        self.refused: BodyRefused | None = None

    async def __call__(self) -> dict[str, Any]:
        if self.done:
            return await self.receive()
        if self.refused is not None:
            return {"type": "http.disconnect"}
        try:
            message = await _receive_by(self.receive, self.deadline, self.limit)
        except BodyRefused as refused:
            self.refused = refused
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                self.refused = BodyRefused("too_large", self.limit)
                return {"type": "http.disconnect"}
            self.done = not message.get("more_body", False)
        return message


async def _bounded_django(django_app: ASGIHandler, scope: Scope, receive: Receive,
                          send: Send) -> None:
    """Admin, the console and the management API through Django, with a size limit and a read
    deadline on every body: too large by its Content-Length is refused before reading it."""
    limit = settings.REQUEST_MAX_BODY_BYTES
    if _declared_too_large(scope, limit):
        await _send_refusal(scope, send, BodyRefused("too_large", limit))
        return
    bounded = _BoundedReceive(receive, _body_deadline(), limit)
    await django_app(scope, bounded, send)
    if bounded.refused is not None:  # Django saw a disconnect and answered nothing
        await _send_refusal(scope, send, bounded.refused)


async def _send_refusal(scope: Scope, send: Send, refused: BodyRefused) -> None:
    """413 or 408 in the caller's format: the management API's `{"detail": ...}`, else plain
    text; then the connection is closed."""
    # The words of /v1's refusal (_v1_refusal), with this format's status: 413, not /v1's 400.
    status = 408 if refused.reason == "timeout" else 413
    message = refused.error().message
    if scope.get("path", "").startswith("/api/"):
        body, kind = json.dumps({"detail": message}).encode(), b"application/json"
    else:
        body, kind = message.encode(), b"text/plain; charset=utf-8"
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", kind), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
