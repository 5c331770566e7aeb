"""What one /v1 call reports about itself: its request metrics (gateway/metrics.py), its spans
(gateway/tracing.py) and its access-log line (gateway/access_log.py).

An `Observation` is made once per call in gateway/views.py `_proxy`, filled in as the call goes
(plain attribute writes: the caller, the model, the refusal, the waits on the upstream), and
finished exactly once (`finish`, idempotent) when the answer's last byte is sent or the client
leaves: by gateway/asgi.py GatewayRouter, or, for a call served through Django (the test
client, WSGI), when Django closes the response. Its finish counts the call, its whole time and
the gateway's overhead (defined in gateway/metrics.py), ends the `gateway.request` span and
writes the access-log line when that is on.

The call's other figures are counted where they happen: holds, tokens, cost and the quota round
trips by gateway/forward.py `Call`, upstream errors and time to first byte by `_answer`.
The access line says what the call was charged: a call whose client's side ends before its
hold (a stream the client left, drained for its usage) writes it when the hold ends
(`hold_ended`), with the status and duration of the client's side.

Spans: only when `tracing.tracer()` is not None. `gateway.request` covers the whole call
(attributes tollgate.request_id, tollgate.endpoint, tollgate.model, tollgate.tenant,
tollgate.refusal, http.response.status_code); its children `quota.reserve` (the admission:
reserve, the plan's policy, a queue wait), `upstream.call` (one per attempt: the request handed
to the transport until the upstream's headers or failure), `quota.settle` / `quota.release`
(the round trip ending the hold, possibly after the request span ended: a stream whose client
left settles after its drain). With tracing off none is made and the hot path pays one
attribute read per place a span would start.
"""
from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gateway import access_log, metrics, request_context, tracing
from gateway.errors import GatewayError
from quotas.limits import QUEUE_TIMEOUT

_perf = time.perf_counter


# The attribute naming an unmetered /v1 endpoint's label (the path after /v1/, with {id} for an
# id) on its view, or on its answer when one view serves several paths (a model by id).
OTHER_ENDPOINT = "tollgate_other_endpoint"

V = TypeVar("V")


def other_endpoint(label: str) -> Callable[[V], V]:
    """Marks a view of an unmetered /v1 endpoint with its request metrics' `endpoint` label."""
    def mark(view: V) -> V:
        setattr(view, OTHER_ENDPOINT, label)
        return view

    return mark


def count_other(endpoint: str, status: int, refusal: str, seconds: float) -> None:
    """One call of an unmetered /v1 endpoint (gateway/other_endpoints.py, the stored objects of
    gateway/stored_responses.py, any other /v1 path), counted by gateway/asgi.py GatewayRouter:
    by endpoint, status and refusal, model "" (nothing is metered), and its whole time. No
    hold, tokens, upstream time or overhead: those figures are the metered calls'."""
    metrics.add(metrics.request_child(endpoint, status, refusal, metrics.NO_MODEL))
    metrics.observe(metrics.duration_child(endpoint, False), seconds)


class Observation:
    """One call's report; see the module docstring."""

    __slots__ = ("arrived", "body_s", "cost_micros", "deferred", "done", "endpoint",
                 "hold_pending", "input_tokens", "key_id", "model", "output_tokens",
                 "queued_from", "queued_s", "refusal", "request_id", "span", "stream", "tenant",
                 "tenant_id", "upstream_from", "upstream_s", "upstream_waited")

    def __init__(self, endpoint: str, received: tuple[float, float] | None = None) -> None:
        """`received`: (perf_counter when the router took the request, seconds it spent reading
        the body), from gateway/asgi.py; None when Django serves the call (it starts here)."""
        self.endpoint = endpoint
        if received is None:
            self.arrived, self.body_s = _perf(), 0.0
        else:
            self.arrived, self.body_s = received
        self.request_id = ""
        self.model = metrics.NO_MODEL
        self.stream = False
        self.refusal = ""
        self.tenant: str | None = None  # the `tenant` label: only for opted-in tenants
        self.tenant_id: str | None = None  # public ids, for the span and the access log
        self.key_id: str | None = None
        self.upstream_s = 0.0  # waiting on upstreams (see gateway/metrics.py: overhead)
        self.upstream_waited = False  # handed to an upstream's transport at least once
        self.queued_s = 0.0  # an admitted call's queue waits
        # When the wait on an upstream, or in a queue, now in flight began (perf_counter); 0.0
        # when none is. A call can end for its client mid-wait (the client left, a stream cut
        # at its deadline) while the wait goes on: `finish` counts it up to that instant.
        self.upstream_from = 0.0
        self.queued_from = 0.0
        self.input_tokens = self.output_tokens = self.cost_micros = 0
        self.done = False
        # An admitted call's hold has not ended yet (gateway/forward.py Call: set when the call
        # is made, cleared by `hold_ended`); an access line written meanwhile would not know
        # the usage, so it is held back (`deferred`) until then.
        self.hold_pending = False
        self.deferred: tuple[int, float, float | None] | None = None
        self.span: Any = None
        tracer = tracing.tracer()
        if tracer is not None:
            # Back-dated to the arrival: the span is made once the view runs.
            started_ns = time.time_ns() - int((_perf() - self.arrived) * 1e9)
            self.span = tracer.start_span("gateway.request", start_time=started_ns,
                                          attributes={"tollgate.endpoint": endpoint})

    def caller(self, tenant_public_id: str, tenant_slug: str, key_public_id: str) -> None:
        """The API key is known (gateway/views.py _authenticate)."""
        self.tenant_id = tenant_public_id
        self.key_id = key_public_id
        self.tenant = metrics.tenant_label(tenant_public_id, tenant_slug)

    def upstream_wait(self) -> float:
        """A wait on an upstream begins now; returns its start, for `waited_upstream`."""
        began = self.upstream_from = _perf()
        return began

    def waited_upstream(self, seconds: float) -> None:
        """The wait on an upstream begun by `upstream_wait` ended after `seconds`."""
        self.upstream_s += seconds
        self.upstream_waited = True
        self.upstream_from = 0.0

    def settled(self, input_tokens: int, output_tokens: int, cost_micros: int) -> None:
        """The usage the call was settled with, for the access-log line."""
        self.input_tokens, self.output_tokens, self.cost_micros = (input_tokens, output_tokens,
                                                                   cost_micros)

    def hold_ended(self, _end: object = None) -> None:
        """The call's hold has ended (settled, released, or its end left to a retry; a
        done-callback of the end's task): an access line held back for the usage is written
        now. A stream whose client left ends here, once its drain has settled."""
        self.hold_pending = False
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            self.with_ids(self._log, *deferred)

    # -- the end ------------------------------------------------------------------------

    def finish(self, status: int) -> None:
        """The call ended for its client with `status` (the HTTP status sent; 499 when the
        client left before the end of the answer, 504 for a stream cut at its deadline).
        Only the first call counts."""
        if self.done:
            return
        self.done = True
        now = _perf()
        whole = now - self.arrived
        if self.upstream_from:  # ended for its client while the gateway waited on an upstream
            self.waited_upstream(now - self.upstream_from)
        if self.queued_from:  # ... or in a queue
            self.queued_s += now - self.queued_from
        endpoint = self.endpoint
        metrics.add(metrics.request_child(endpoint, status, self.refusal, self.model))
        metrics.observe(metrics.duration_child(endpoint, self.stream), whole)
        if self.refusal != QUEUE_TIMEOUT:
            own = whole - self.body_s - self.upstream_s - self.queued_s
            metrics.observe(metrics.overhead_child(endpoint), own if own > 0.0 else 0.0)
        if self.tenant is not None:
            metrics.add(metrics.tenant_request_child(self.tenant, endpoint, status))
        if self.span is not None:
            self._end_span(status)
        if access_log.enabled():
            # The client's side: its status, its time, the upstream's time within it (a wait
            # its leaving cut short goes on for the hold's end, not for this line).
            upstream_ms = self.upstream_s * 1000 if self.upstream_waited else None
            if self.hold_pending:
                # The client's side ended before the hold did (it left a stream, which drains
                # the upstream for its usage): the line waits for the settle's figures.
                self.deferred = (status, whole, upstream_ms)
            else:
                self.with_ids(self._log, status, whole, upstream_ms)

    def with_ids(self, work: Callable[..., None], *args: Any) -> None:
        """`work(*args)` in a context of its own holding this call's ids (request, tenant, key),
        for its log lines, wherever it runs: a call served by Django finishes when Django closes
        its response, on another thread, where the log format would find no request."""
        contextvars.Context().run(self._bound, work, args)

    def _bound(self, work: Callable[..., None], args: tuple[Any, ...]) -> None:
        if self.request_id:
            request_context.bind_request(self.request_id)
        if self.tenant_id is not None and self.key_id is not None:
            request_context.bind_caller(self.tenant_id, self.key_id)
        work(*args)

    def _log(self, status: int, whole: float, upstream_ms: float | None) -> None:
        access_log.log_request(
            endpoint=self.endpoint, model=self.model, status=status, refusal=self.refusal,
            duration_ms=whole * 1000, upstream_ms=upstream_ms,
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            cost_micros=self.cost_micros, stream=self.stream)

    # -- spans --------------------------------------------------------------------------

    def _end_span(self, status: int) -> None:
        span = self.span
        span.set_attribute("tollgate.request_id", self.request_id)
        span.set_attribute("tollgate.model", self.model)
        span.set_attribute("tollgate.stream", self.stream)
        span.set_attribute("http.response.status_code", status)
        if self.tenant_id is not None:
            span.set_attribute("tollgate.tenant", self.tenant_id)
        if self.refusal:
            span.set_attribute("tollgate.refusal", self.refusal)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def start_child(self, name: str, **attributes: Any) -> Any:
        """A child span of the call's, started now (None when not tracing); the caller ends
        it."""
        if self.span is None:
            return None
        tracer = tracing.tracer()
        if tracer is None:  # tracing turned off mid-call
            return None
        from opentelemetry.trace import set_span_in_context

        return tracer.start_span(name, context=set_span_in_context(self.span),
                                 attributes={"tollgate.request_id": self.request_id,
                                             **attributes})

    def child(self, name: str, **attributes: Any) -> _Child:
        """`start_child` as a context manager: ended on exit, an exception recorded on it as
        an error, except a refusal (a 4xx GatewayError: status left UNSET, tollgate.refusal).
        Only for a traced call (check `span` first: the untraced path pays nothing)."""
        return _Child(self.start_child(name, **attributes))


class _Child:
    """`Observation.child`'s context manager. A class, not @contextmanager: contextlib sets
    `__traceback__` on the exception it lets through, which a frozen dataclass exception
    refuses (GatewayError: a traced call refused in its reserve answered 500)."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def __enter__(self) -> Any:
        return self.span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: Any) -> bool:
        if self.span is not None:
            if exc is None:
                self.span.end()
            elif isinstance(exc, GatewayError) and exc.status < 500:
                # A refusal (429 over quota, 403 model not allowed...) is the answer the call
                # gets, not a failure of the server: as OpenTelemetry's conventions leave a 4xx
                # server span's status UNSET, the span ends so, saying why in tollgate.refusal.
                self.span.set_attribute("tollgate.refusal", exc.refusal or exc.code or "")
                self.span.end()
            else:
                end_with_error(self.span, exc)
        return False


def end_with_error(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    span.end()
