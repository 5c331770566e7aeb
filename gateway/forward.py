"""Forwarding an admitted call upstream, streaming it back, and ending its hold exactly once.

Settle with the upstream's `usage` (prompt + completion tokens). If a stream breaks or the client
leaves after tokens were produced, charge what was produced: keep reading the upstream for the
usage event for a bounded time, else count the text received. Release only when the upstream
produced nothing (connection error, timeout before the first byte, an error status).

Ending a hold cannot be cancelled: the settle or release runs in a task of its own (kept in
`runtime.background`) that the request only awaits through `asyncio.shield`, so a client leaving
at any instant, even while the settle waits for a Redis connection, ends the hold exactly once.
One deadline (GATEWAY_CALL_DEADLINE_SECONDS) bounds the whole call from the reserve on. A call
still in flight after GATEWAY_CHECKPOINT_SECONDS tells its hold how far it got (see Checkpoints),
so a sweep after a crash charges what is known.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from gateway.admission import Admission, queue_ticket, reserve_meta
from gateway.auth import KeyContext
from gateway.bodies import Endpoint, ParsedBody
from gateway.circuit import NO_PROBE, circuit_for
from gateway.errors import (
    GatewayError,
    queue_timeout,
    upstream_client_error,
    upstream_error,
    upstream_unavailable,
)
from gateway.listener import publish_cooldown
from gateway.headers import QUEUE_WAIT_HEADER
from gateway.providers import Upstream
from gateway.runtime import GatewayRuntime
from gateway.tokens import count_stream_text
from quotas.engine import (
    CapacityWait,
    Hold,
    Phase,
    QuotaError,
    QuotaStoreUnavailable,
    ReleaseResult,
    SettleResult,
)
from quotas.waiting import QueueTimedOut, QueueTiming, wait_for_capacity

log = logging.getLogger(__name__)

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_BAD_KEY_COOLDOWN_S = 60.0
# Settle / release retries while Redis is unreachable: the first waits are short (a failover or
# a restart takes seconds), then the gap grows up to this cap.
_RETRY_FIRST_S = 0.2
_RETRY_CAP_S = 30.0
# Fail-open calls whose usage event waits for Redis to come back, per worker. Bounded: an outage
# of any length must not grow the worker's memory without end (the oldest are dropped, each one
# logged in full at ERROR, which is then the only record of it).
_UNMETERED_BACKLOG = 10_000

EndResult = SettleResult | ReleaseResult


def _ms_now() -> int:
    return int(time.time() * 1000)


@dataclass
class Call:
    """One admitted request on its way upstream and back."""

    runtime: GatewayRuntime
    ctx: KeyContext
    parsed: ParsedBody
    admission: Admission
    request_id: str
    started: float  # time.monotonic() when the request arrived
    headers: dict[str, str]  # rate / quota / request-id headers for the client
    upstream: Upstream | None = None
    relay: StreamRelay | None = None
    # Handed to an upstream's transport: from here on the upstream may have the call.
    sent: bool = False
    answered: bool = False  # the upstream's 200 headers arrived: it is producing the answer
    # On the event loop's clock (loop.time()): just after the reserve, and the call's deadline.
    reserved_at: float = field(init=False)
    deadline: float = field(init=False)
    started_ms: int = field(init=False)  # wall clock, for an unmetered call's usage event
    _end: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _checkpoints: Checkpoints | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.reserved_at = loop.time()
        self.deadline = self.reserved_at + settings.GATEWAY_CALL_DEADLINE_SECONDS
        self.started_ms = _ms_now()
        hold = self.admission.reservation.hold
        if hold is not None:
            self._checkpoints = Checkpoints(self, hold, loop, settings.GATEWAY_CHECKPOINT_SECONDS)

    @property
    def ended(self) -> bool:
        """The hold's end (settle or release) has begun; it finishes even if nobody awaits it."""
        return self._end is not None

    # -- ending the hold ------------------------------------------------------------------

    def _event(self, status: int, input_tokens: int, output_tokens: int, outcome: str) -> str:
        return json.dumps({
            "in": input_tokens, "out": output_tokens, "st": status, "outcome": outcome,
            "pk": self.upstream.id if self.upstream else None,
            "lat": round((time.monotonic() - self.started) * 1000),
            "stream": self.parsed.stream, "soft": self.admission.soft,
            "fb": self.admission.fallback_from,
        }, separators=(",", ":"))

    async def settle(self, input_tokens: int, output_tokens: int, *, status: int = 200,
                     outcome: str = "complete") -> None:
        """Charge the hold with this usage (the first end wins; later calls only wait for it)."""
        if self._end is None:
            event = self._event(status, input_tokens, output_tokens, outcome)
            self._begin_end(self._settle_hold(input_tokens, output_tokens, event))
        await self._wait_end()

    async def release(self, status: int, reason: str) -> None:
        """Free the hold unbilled: only when the upstream produced nothing."""
        if self._end is None:
            self._begin_end(self._release_hold(self._event(status, 0, 0, reason)))
        await self._wait_end()

    async def abort(self, status: int, reason: str) -> None:
        """End the hold after an unexpected error. Once the upstream has answered, what it
        produced is unknown here: charge the worst case held (input estimate plus the rest of
        the hold), as for a body that broke off. Before that, nothing was produced: release."""
        if self._end is not None:
            await self._wait_end()
        elif self.answered:
            est = self.admission.estimate
            granted = self.admission.reservation.granted
            await self.settle(est.prompt_tokens, max(0, granted - est.prompt_tokens),
                              status=status, outcome=reason)
        else:
            await self.release(status, reason)

    def _begin_end(self, work: Coroutine[Any, Any, None]) -> None:
        if self._checkpoints is not None:
            self._checkpoints.stop()
        self._end = self.runtime.detach(work)

    async def _wait_end(self) -> None:
        assert self._end is not None
        # Shielded: cancelling this request (its client left) leaves the end task running.
        await asyncio.shield(self._end)

    async def _settle_hold(self, input_tokens: int, output_tokens: int, event: str) -> None:
        hold = self.admission.reservation.hold
        if hold is None:
            log.error("FAIL-OPEN unmetered call %s of tenant %s: %s", self.request_id,
                      self.ctx.tenant_id, event)
            _unmetered_backlog().add(self.runtime, UnmeteredUsage(
                self.ctx.tenant_tag, self.request_id, input_tokens + output_tokens,
                self.started_ms, _ms_now(), reserve_meta(self.ctx, self.parsed,
                                                           self.admission.model), event))
            return
        # The price resolved at admission: the one the money hold and the ledger use.
        cost = self.admission.estimate.price.cost(input_tokens, output_tokens)
        engine = self.runtime.engine
        await self._end_hold(lambda: engine.settle(hold, input_tokens + output_tokens, event, cost))

    async def _release_hold(self, event: str) -> None:
        hold = self.admission.reservation.hold
        if hold is None:
            return  # fail-open: nothing was held, and nothing reached the upstream to record
        engine = self.runtime.engine
        await self._end_hold(lambda: engine.release(hold, event))

    async def _end_hold(self, operation: Callable[[], Awaitable[EndResult]]) -> None:
        if not await _try_end(operation, self.request_id):
            # The hold stays open; retry in the background rather than leave it to the sweep,
            # which can only charge an estimate.
            self.runtime.detach(_retry_end(operation, self.request_id, self._give_up_at()))

    def _give_up_at(self) -> float:
        """When retries of the end stop (loop clock): while the hold's record can still be found.
        Past the stale threshold the sweep may have ended the hold with an estimate (once Redis
        is back); a settle arriving then corrects it to the real usage, once, as long as the
        swept hold's tombstone lives (QUOTA_TOMBSTONE_SECONDS, which settings require to exceed
        the stale threshold). The margin covers the clocks' drift and the last attempt."""
        tombstone = float(self.runtime.engine.settings.tombstone_s)
        margin = max(1.0, 0.05 * tombstone) + settings.REDIS_SOCKET_TIMEOUT
        return self.reserved_at + tombstone - margin

    # -- the upstream -------------------------------------------------------------------------

    def payload(self) -> bytes:
        body = dict(self.parsed.body)
        body["model"] = self.admission.model
        cap = self.admission.output_cap
        if cap is not None:
            name = _output_cap_field(self.parsed.endpoint, self.admission.model, body)
            body.pop("max_tokens", None)
            body[name] = cap
        if self.parsed.stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()

    def request_for(self, upstream: Upstream, payload: bytes) -> httpx.Request:
        # What the client's build_request() makes (its default headers and timeouts, read once
        # in the runtime), without re-merging base URL, cookies and params on every call.
        runtime = self.runtime
        headers = {**runtime.upstream_headers, "Authorization": f"Bearer {upstream.secret}",
                   "Content-Type": "application/json", "X-Request-Id": self.request_id}
        return httpx.Request("POST", _upstream_url(upstream.base_url, self.parsed.endpoint.value),
                             content=payload, headers=headers,
                             extensions={"timeout": runtime.upstream_timeout})

    def response_headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(self.headers)
        if self.admission.fallback_from:
            headers["X-Tollgate-Fallback-Model"] = self.admission.model
        if self.admission.soft:
            headers["X-Tollgate-Soft-Limit"] = "exceeded"
        if not self.admission.metered:
            headers["X-Tollgate-Unmetered"] = "true"
        headers.update(extra or {})
        return headers

    def delivered_tokens(self) -> int:
        """Output tokens relayed so far (a stream's; 0 before its first chunk)."""
        return self.relay.delivered_tokens() if self.relay is not None else 0


def _check_end(result: EndResult) -> None:
    if result.outcome in ("settled", "released"):
        return
    if result.outcome == "corrected":
        # The sweep had taken the hold (its gateway looked dead); the settle corrected its
        # charge to the real usage, once.
        log.warning("hold of %s had been swept: its charge was corrected to the real usage",
                    result.request_id)
        return
    log.error("hold of %s had already ended as %r: its usage is not counted again",
              result.request_id, result.outcome)


async def _try_end(operation: Callable[[], Awaitable[EndResult]], request_id: str) -> bool:
    """One attempt to end a hold; False only when Redis was unreachable (worth retrying). Any
    other failure is logged: the sweep then charges what the hold knows."""
    try:
        result = await operation()
    except QuotaStoreUnavailable:
        return False
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("ending the hold of %s failed", request_id)
        return True
    _check_end(result)
    return True


async def _retry_end(operation: Callable[[], Awaitable[EndResult]], request_id: str,
                     give_up_at: float) -> None:
    """Retry a settle / release that found Redis unreachable, with growing gaps, until just
    before the hold's record would be gone (past the stale threshold: a settle after the sweep
    corrects it; well past the call's deadline: DESIGN.md section 7)."""
    loop = asyncio.get_running_loop()
    delay = _RETRY_FIRST_S
    while (wait := min(delay, give_up_at - loop.time())) > 0:
        await asyncio.sleep(wait)
        if await _try_end(operation, request_id):
            return
        delay = min(delay * 2, _RETRY_CAP_S)
    log.error("could not end hold %s: Redis unreachable until its record could be gone; the "
              "sweep charges what the hold knows", request_id)


class Checkpoints:
    """Tells a hold how far its call got, so a sweep after a crash charges what is known
    (DESIGN.md invariant 3), without a Redis round trip for a short call.

    One timer per call, first due GATEWAY_CHECKPOINT_SECONDS after the reserve; a call that ends
    before then writes nothing (reserve and settle stay its only round trips). When due, once
    the call was handed to an upstream: a non-streamed call is marked `forwarded` once (the
    sweep then charges the whole hold: the upstream may have produced up to the cap); a stream
    is marked `streaming` with the output tokens relayed so far, then again every interval
    while that figure grows. The timer, not the arrival of chunks, drives it: a stream that
    stalls still has a checkpoint at most one interval behind what its client received. At most
    one write is in flight per call; one that fails (Redis away) is simply written at the next
    interval. Writes are fire-and-forget: a write landing after the settle is a no-op.
    """

    __slots__ = ("call", "hold", "loop", "interval", "timer", "writing", "written", "stopped")

    def __init__(self, call: Call, hold: Hold, loop: asyncio.AbstractEventLoop,
                 interval: float) -> None:
        self.call = call
        self.hold = hold
        self.loop = loop
        self.interval = interval
        self.writing: asyncio.Task[None] | None = None
        self.written: tuple[Phase, int] | None = None
        self.stopped = False
        self.timer: asyncio.TimerHandle | None = loop.call_at(call.reserved_at + interval,
                                                              self._due)

    def stop(self) -> None:
        self.stopped = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _due(self) -> None:
        self.timer = None
        if self.stopped:
            return
        call = self.call
        if call.sent and self.writing is None:
            if call.parsed.stream:
                mark = (Phase.STREAMING, call.delivered_tokens())
            else:
                mark = (Phase.FORWARDED, 0)
            if mark != self.written:
                self.writing = call.runtime.detach(self._write(*mark))
            elif not call.parsed.stream:
                return  # `forwarded` is all a non-streamed call has to tell
        self.timer = self.loop.call_at(self.loop.time() + self.interval, self._due)

    async def _write(self, phase: Phase, output_tokens: int) -> None:
        try:
            # The provider key it went to, so a swept hold's row can be reconciled with its bill.
            upstream = self.call.upstream.id if self.call.upstream is not None else None
            state = await self.call.runtime.engine.progress(self.hold, phase, output_tokens,
                                                            upstream)
        except QuotaError as exc:
            log.info("checkpoint of %s not written (%s); retried next interval",
                     self.call.request_id, exc)
        except Exception:  # noqa: BLE001 - a checkpoint must never break the call
            log.exception("checkpoint of %s failed", self.call.request_id)
        else:
            self.written = (phase, output_tokens)
            if state != "open":
                self.stop()  # ended or swept meanwhile: nothing left to tell
        finally:
            self.writing = None


@dataclass(frozen=True)
class UnmeteredUsage:
    """A fail-open call's usage event, for the ledger once Redis is back."""

    tenant: str
    request_id: str
    actual: int
    created_ms: int
    ended_ms: int
    meta: str
    event: str


class UnmeteredBacklog:
    """Appends fail-open calls' usage events to their tenants' usage streams (outcome
    `unmetered`) as soon as Redis answers again: one flushing task per worker, a bounded queue."""

    def __init__(self, limit: int) -> None:
        self.pending: deque[UnmeteredUsage] = deque()
        self.limit = limit
        self.flushing: asyncio.Task[None] | None = None

    def add(self, runtime: GatewayRuntime, usage: UnmeteredUsage) -> None:
        if len(self.pending) >= self.limit:
            lost = self.pending.popleft()
            log.error("FAIL-OPEN backlog full (%d): usage event of %s dropped: %s", self.limit,
                      lost.request_id, lost)
        self.pending.append(usage)
        if self.flushing is None:
            self.flushing = runtime.detach(self._flush(runtime))

    async def _flush(self, runtime: GatewayRuntime) -> None:
        delay = _RETRY_FIRST_S
        try:
            while self.pending:
                usage = self.pending[0]
                try:
                    await runtime.engine.append_unmetered(
                        usage.tenant, usage.request_id, actual=usage.actual,
                        created_ms=usage.created_ms, ended_ms=usage.ended_ms, meta=usage.meta,
                        event=usage.event)
                except QuotaStoreUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _RETRY_CAP_S)
                    continue
                except Exception:  # noqa: BLE001 - one bad event must not block the others
                    log.exception("usage event of unmetered call %s not recorded: %s",
                                  usage.request_id, usage)
                if self.pending and self.pending[0] is usage:
                    self.pending.popleft()
                delay = _RETRY_FIRST_S
        finally:
            self.flushing = None


_unmetered: UnmeteredBacklog | None = None


def _unmetered_backlog() -> UnmeteredBacklog:
    # One per worker process, like its runtime (one event loop).
    global _unmetered
    if _unmetered is None:
        _unmetered = UnmeteredBacklog(_UNMETERED_BACKLOG)
    return _unmetered


@functools.lru_cache(maxsize=1024)
def _upstream_url(base_url: str, path: str) -> httpx.URL:
    return httpx.URL(f"{base_url}/{path}")


def _output_cap_field(endpoint: Endpoint, model: str, body: dict[str, Any]) -> str:
    """The field that caps output upstream: the one the client used; else `max_tokens`, which
    every OpenAI-compatible server knows, except for OpenAI's reasoning models (o1, o3, ...),
    which accept only `max_completion_tokens`."""
    if endpoint is not Endpoint.CHAT:
        return "max_tokens"
    if "max_completion_tokens" in body:
        return "max_completion_tokens"
    if "max_tokens" in body:
        return "max_tokens"
    reasoning = len(model) > 1 and model[0] == "o" and model[1].isdigit()
    return "max_completion_tokens" if reasoning else "max_tokens"


def _usage_tokens(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    if prompt < 0 or completion < 0:
        return None  # nonsense from the upstream: count what we saw instead
    return prompt, completion


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(1.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def _upstream_failure(response: httpx.Response, body: bytes) -> GatewayError:
    """A client error of the upstream is told in Tollgate's words, keeping its status, type,
    code and param (never its message: it may name the provider's organisation, deployments
    or URLs); a server error becomes our 502."""
    if response.status_code < 500:
        return upstream_client_error(response.status_code, body)
    return upstream_error(502, f"The upstream provider failed with HTTP {response.status_code}.")


def _content_text(content: Any) -> str:
    """The text of a message's `content`: a string, or a list of content parts (`{"type":
    "text", "text": ...}`, `output_text`, `refusal`, or bare strings); other parts (images,
    audio) carry no text we can count."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            for name in ("text", "refusal"):
                value = part.get(name)
                if isinstance(value, str):
                    texts.append(value)
    return "".join(texts)


def _str_field(mapping: dict[str, Any], name: str) -> str:
    value = mapping.get(name)
    return value if isinstance(value, str) else ""


def _text_of(endpoint: Endpoint, data: dict[str, Any]) -> str:
    """The output text of an answer or a stream chunk, for counting its tokens when the
    upstream sent no usage. Never raises: any JSON shape yields the text it holds, if any."""
    choices = data.get("choices")
    if not isinstance(choices, list):
        return ""
    parts: list[str] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if endpoint is not Endpoint.CHAT:
            parts.append(_str_field(choice, "text"))
            continue
        message = choice.get("message") or choice.get("delta")
        if not isinstance(message, dict):
            continue
        parts.append(_content_text(message.get("content")))
        # Also billed as output: a refusal, and the reasoning text some servers stream.
        for name in ("refusal", "reasoning_content", "reasoning"):
            parts.append(_str_field(message, name))
        calls = message.get("tool_calls")
        functions = [call.get("function") for call in calls if isinstance(call, dict)] \
            if isinstance(calls, list) else []
        functions.append(message.get("function_call"))  # the legacy single call
        for function in functions:
            if isinstance(function, dict):
                parts.append(_str_field(function, "name"))
                parts.append(_str_field(function, "arguments"))
    return "".join(parts)


async def forward(call: Call) -> HttpResponse | StreamingHttpResponse:
    """Send the call to an upstream and answer the client; the hold ends exactly once."""
    deadline = asyncio.timeout_at(call.deadline)
    try:
        async with deadline:
            answer = await _answer(call)
    except TimeoutError:
        if not deadline.expired():
            raise
        # Waiting for capacity, a connection or the first byte took the whole deadline: the
        # upstream produced nothing we could relay.
        await call.release(504, "upstream_timeout" if call.sent else "deadline")
        raise upstream_error(504, "The upstream provider did not answer within the gateway's "
                             "deadline.") from None
    call.answered = True
    if call.parsed.stream:
        return StreamRelay(call, answer).response()
    return await _complete(call, answer)


async def _answer(call: Call, taken: Upstream | None = None) -> httpx.Response:
    """The first upstream answer worth relaying (a 200); every other outcome releases the hold
    and raises the matching GatewayError (a client error in Tollgate's words). `taken`: the one
    upstream to try, whose capacity the call already took (after waiting in its queue)."""
    runtime = call.runtime
    payload = call.payload()
    model = call.admission.model
    now = time.time()
    candidates = [taken] if taken else runtime.pool.candidates(model, call.ctx.tenant_id, now)
    circuit = circuit_for(runtime)
    last_429: httpx.Response | None = None
    refused_key = False  # an upstream refused a provider key (401 / 403)
    capacity_wait_ms: int | None = None
    short: list[tuple[int, Upstream]] = []  # keys without capacity now: (retry ms, key)
    for upstream in candidates:
        ticket = NO_PROBE
        # None (a dict lookup) unless a breaker of this key is past its cool-down.
        due = runtime.pool.breakers_due(upstream.id, model, now)
        if due:
            probe = await circuit.admit(upstream, model, due)
            if probe is None:
                continue  # other calls hold its probe slots
            ticket = probe
        try:
            if (upstream.rpm_capacity or upstream.tpm_capacity) and upstream is not taken:
                # Behind the key's waiters (CapacityWait(): the gate only), in the same call.
                got = await runtime.engine.take_capacity(
                    upstream.id, upstream.rpm_capacity, upstream.tpm_capacity,
                    call.admission.reservation.granted, CapacityWait())
                if not got.taken:
                    capacity_wait_ms = min(got.retry_after_ms, capacity_wait_ms or 10**9)
                    short.append((got.retry_after_ms, upstream))
                    continue
            call.upstream = upstream
            request = call.request_for(upstream, payload)
            call.sent = True
            try:
                # Straight to the transport: the client's cookie, auth and redirect layers cost a
                # measurable share of a request and do nothing for an API call.
                response = await runtime.transport.handle_async_request(request)
            except _CONNECT_ERRORS:
                log.warning("provider key %s unreachable; trying the next", upstream.public_id)
                await circuit.report(upstream, model, ticket, transport_failed=True)
                continue
            except httpx.TimeoutException:
                await circuit.report(upstream, model, ticket, transport_failed=True)
                await call.release(504, "upstream_timeout")
                raise upstream_error(504, "The upstream provider did not answer in time.") from None
            except httpx.HTTPError as exc:
                await circuit.report(upstream, model, ticket, transport_failed=True)
                await call.release(502, "upstream_error")
                raise upstream_error(502, f"The upstream provider failed: {exc}") from None

            status = response.status_code
            if status < 400 and not ticket:
                circuit.ok(upstream, model)  # no round trip: flushed in batches
            elif status < 400 or status >= 500 or ticket:
                # A failure, or a probe's result (a 4xx probe answered: the upstream is up).
                await circuit.report(upstream, model, ticket, server_failed=status >= 500)
            if response.status_code == 429:
                await response.aclose()
                last_429 = response
                await publish_cooldown(runtime, upstream.id, time.time() + _retry_after(response))
                continue
            if response.status_code in (401, 403):
                # The provider key itself is refused: not the tenant's fault and not theirs to see
                # (the upstream's message may name the key). Rest it and try the next one.
                await response.aclose()
                log.error("provider key %s refused by its upstream (HTTP %s): cooling it down for "
                          "%s s", upstream.public_id, response.status_code, _BAD_KEY_COOLDOWN_S)
                await publish_cooldown(runtime, upstream.id, time.time() + _BAD_KEY_COOLDOWN_S)
                refused_key = True
                continue
            if response.status_code >= 400:
                try:
                    body = await response.aread()
                except httpx.HTTPError:
                    body = b""
                await response.aclose()
                await call.release(response.status_code, "upstream_status")
                raise _upstream_failure(response, body)
            return response
        finally:
            # A probe slot this attempt neither reported nor will (no capacity, the client
            # left, an error): handed back now, not a lease (the call deadline) later. A plain
            # call (NO_PROBE) costs nothing here.
            circuit.give_back(upstream, model, ticket)

    if short and last_429 is None and not refused_key and taken is None:
        waited_for = await _wait_for_capacity(call, short)
        if waited_for is not None:
            return await _answer(call, waited_for)
    if refused_key and last_429 is None:
        await call.release(502, "upstream_refused_key")
        raise upstream_error(502, "The upstream refused the gateway's provider key; the operators "
                             "have been alerted.")
    cooling = _cooldown_left(runtime, call)
    resting = runtime.pool.breaker_wait(model, call.ctx.tenant_id, time.time())
    if resting is not None and last_429 is None:
        # Keys skipped with an open breaker: 503 until the first one half-opens (or, when
        # sooner, a cooling key is back).
        await call.release(503, "upstream_unavailable")
        wait = resting if cooling is None else min(resting, cooling)
        raise upstream_unavailable(max(1, math.ceil(wait)))  # counted by views.py
    if capacity_wait_ms is not None and cooling is None and last_429 is None:
        cooling = max(1, math.ceil(capacity_wait_ms / 1000))
    if last_429 is not None or cooling is not None:
        await call.release(429, "upstream_rate_limited")
        retry_after = int(_retry_after(last_429)) if last_429 is not None else cooling
        raise GatewayError(429, "Every upstream provider key for this model is rate limited; "
                           "retry shortly.", "requests", "rate_limit_exceeded", None, retry_after)
    await call.release(502, "no_upstream")
    raise upstream_error(502, "No upstream provider for this model could be reached.")


async def _wait_for_capacity(call: Call, short: list[tuple[int, Upstream]]) -> Upstream | None:
    """Every key tried lacked RPM / TPM capacity: a call whose plan queues waits in the queue
    of the key with capacity soonest (lua/provider_take.lua, "Queue": plan priority, then
    arrival, across tenants) for what is left of its queue timeout. The key, once its capacity
    is taken; None when the plan does not queue (the caller answers 429 as before); 429
    queue_timeout (hold released, refusal counted) when the time runs out."""
    runtime, ctx = call.runtime, call.ctx
    ticket = queue_ticket(runtime, ctx)
    already_ms = call.admission.reservation.queue_wait_ms
    left_s = ctx.limits.queue_timeout_seconds - already_ms / 1000
    if ticket is None or left_s <= 0:
        return None
    retry_ms, upstream = min(short, key=lambda item: item[0])
    lease = settings.TOLLGATE_QUEUE_HEAD_LEASE_MS
    wait = CapacityWait(call.request_id, ticket.priority,
                        runtime.engine.clock.now_ms() + int(left_s * 1000) + 1000, lease)
    timing = QueueTiming(left_s, settings.TOLLGATE_QUEUE_HEAD_RETRY_MS, lease)
    try:
        result, waited_ms = await wait_for_capacity(
            runtime.engine, runtime.waiting, upstream.id, upstream.rpm_capacity,
            upstream.tpm_capacity, call.admission.reservation.granted, wait, timing)
    except asyncio.CancelledError:
        # Its client left while it waited (views.py cancels a waiting call): end the hold,
        # detached, since nobody else will.
        runtime.detach(call.release(499, "client_gone"))
        raise
    except QueueTimedOut as timed_out:
        await call.release(429, "queue_timeout")
        # Counted by views.py, like every refusal the forward answers with.
        raise queue_timeout("capacity of the upstream provider", timed_out.waited_ms / 1000,
                            max(1, math.ceil(retry_ms / 1000))) from None
    if not result.taken:
        return None
    call.headers[QUEUE_WAIT_HEADER] = str(already_ms + waited_ms)
    return upstream


def _cooldown_left(runtime: GatewayRuntime, call: Call) -> int | None:
    """Seconds until the first key for this call leaves its cooldown; None if none cools."""
    now = time.time()
    waits = [
        until - now for key_id, until in runtime.pool.cooldowns().items()
        if until > now and (upstream := runtime.pool.get(key_id)) is not None
        and upstream.serves(call.admission.model) and upstream.usable_by(call.ctx.tenant_id)
    ]
    return max(1, math.ceil(min(waits))) if waits else None


async def _complete(call: Call, response: httpx.Response) -> HttpResponse:
    try:
        async with asyncio.timeout_at(call.deadline):
            body = await response.aread()
    except (httpx.HTTPError, TimeoutError):
        # Headers arrived but the body did not (or not within the deadline): the upstream may
        # have produced and billed tokens we cannot see, so charge the worst case we held.
        await response.aclose()
        await call.abort(504, "upstream_broken")
        raise upstream_error(504, "The upstream provider stopped answering mid-response.") from None
    await response.aclose()
    try:
        tokens, outcome = _body_usage(call, body)
    except Exception:  # noqa: BLE001 - the answer is here: it must be charged whatever happened
        log.exception("counting the answer of %s failed; charging its size", call.request_id)
        tokens = (call.admission.estimate.prompt_tokens,
                  count_stream_text(body.decode("utf-8", "replace"),
                                    call.admission.estimate.info.tokenizer))
        outcome = "gateway_error_counted"
    await call.settle(*tokens, outcome=outcome)
    return HttpResponse(body, status=200, content_type="application/json",
                        headers=call.response_headers())


def _body_usage(call: Call, body: bytes) -> tuple[tuple[int, int], str]:
    """The usage of a whole answer: the upstream's, else its text counted."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    tokens = _usage_tokens(data.get("usage"))
    if tokens is not None:
        return tokens, "complete"
    text = _text_of(call.parsed.endpoint, data)
    counted = count_stream_text(text, call.admission.estimate.info.tokenizer)
    return (call.admission.estimate.prompt_tokens, counted), "no_usage"


class _DeadlinePassed(Exception):
    """The call's deadline passed mid-stream."""


class StreamRelay:
    """Pass SSE events through as they arrive; capture usage; end the hold exactly once."""

    def __init__(self, call: Call, response: httpx.Response) -> None:
        self.call = call
        call.relay = self
        self.upstream = response
        self.buffer = b""
        self.usage: tuple[int, int] | None = None
        # Events that may carry output text, parsed only when needed: for a checkpoint (the new
        # ones since the last) or for a settle without usage.
        self.text_events: list[bytes] = []
        self.texts: list[str] = []  # the text of text_events[:len(texts)]
        self.counted = 0  # output tokens in `texts`, as checkpoints count them
        self.handed_off = False
        # One iterator over the upstream body, shared by the relay and the drain; a read in
        # flight when the client leaves is not cancelled with it (see _next_chunk).
        self.chunks = response.aiter_raw()
        self.reading: asyncio.Future[bytes] | None = None

    async def _next_chunk(self) -> bytes | None:
        """The next raw chunk of the upstream body, None at its end. Shielded: cancelling the
        client's side must not break the upstream stream the drain still has to read."""
        if self.reading is None:
            self.reading = asyncio.ensure_future(self.chunks.__anext__())
        reading = self.reading
        try:
            return await asyncio.shield(reading)
        except StopAsyncIteration:
            return None
        finally:
            if reading.done():
                self.reading = None

    def response(self) -> StreamingHttpResponse:
        response = StreamingHttpResponse(self.relay(), content_type="text/event-stream",
                                         headers=self.call.response_headers())
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        # gateway.asgi calls this when the client leaves before the stream has ended, and
        # stops sending at the deadline (a stalled upstream or a client that stopped reading).
        response.tollgate_client_gone = self.client_gone  # type: ignore[attr-defined]
        response.tollgate_deadline = self.call.deadline  # type: ignore[attr-defined]
        return response

    def client_gone(self) -> None:
        """Finish reading the upstream for its usage in a task of its own, then settle."""
        if self.call.ended or self.handed_off:
            return
        self.handed_off = True
        # The router also ends a stream this way when it reaches the call's deadline.
        if asyncio.get_running_loop().time() >= self.call.deadline:
            status, outcome = 504, "deadline"
        else:
            status, outcome = 499, "client_disconnected"
        self.call.runtime.detach(self._drain(status, outcome))

    def _inspect(self, event: bytes) -> bytes | None:
        """The event to send to the client (None: drop it), recording usage on the way."""
        if b'"usage"' not in event or b'"usage":null' in event:
            self.text_events.append(event)
            return event
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            try:
                data = json.loads(payload)
            except ValueError:
                return event
            if not isinstance(data, dict):
                return event
            tokens = _usage_tokens(data.get("usage"))
            if tokens is not None:
                self.usage = tokens
            if self.call.parsed.include_usage:
                if data.get("choices"):
                    self.text_events.append(event)  # counted if the usage never arrives
                return event
            if not data.get("choices"):
                return None  # the extra usage chunk the client did not ask for
            data.pop("usage", None)
            self.text_events.append(event)
            return b"data: " + json.dumps(data, separators=(",", ":")).encode()
        return event

    def _events(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk
        if b"\r\n" in self.buffer:
            self.buffer = self.buffer.replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        return events

    def _event_text(self, event: bytes) -> str:
        texts = []
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                data = json.loads(payload)
            except ValueError:
                continue  # not JSON: no text a client could have read as output either
            if isinstance(data, dict):
                texts.append(_text_of(self.call.parsed.endpoint, data))
        return "".join(texts)

    def _new_text(self) -> str:
        """The text of the events not parsed yet (each event is parsed once)."""
        start = len(self.texts)
        new = [self._event_text(event) for event in self.text_events[start:]]
        self.texts.extend(new)
        return "".join(new)

    def delivered_tokens(self) -> int:
        """Output tokens relayed so far, for a checkpoint: the new events' text, counted with
        the tokenizer the settle's fallback uses, added to the previous count."""
        new = self._new_text()
        if new:
            self.counted += count_stream_text(new, self.call.admission.estimate.info.tokenizer)
        return self.counted

    def _received_tokens(self) -> int:
        self._new_text()
        return count_stream_text("".join(self.texts), self.call.admission.estimate.info.tokenizer)

    async def _settle_produced(self, status: int, outcome: str) -> None:
        """Settle with the upstream's usage, else with the text counted; never raises before
        the settle has begun."""
        if self.usage is not None:
            await self.call.settle(*self.usage, status=status, outcome=outcome)
            return
        try:
            output = self._received_tokens()
        except Exception:  # noqa: BLE001 - a counting bug must not leave the hold open
            log.exception("counting the stream of %s failed; charging its size",
                          self.call.request_id)
            output = count_stream_text(b"".join(self.text_events).decode("utf-8", "replace"),
                                       self.call.admission.estimate.info.tokenizer)
        await self.call.settle(self.call.admission.estimate.prompt_tokens, output,
                               status=status, outcome=f"{outcome}_counted")

    async def relay(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = self.call.deadline
        try:
            while (chunk := await self._next_chunk()) is not None:
                for event in self._events(chunk):
                    out = self._inspect(event)
                    if out is not None:
                        yield out + b"\n\n"
                if loop.time() > deadline:
                    raise _DeadlinePassed
            await self._settle_produced(200, "complete")
        except _DeadlinePassed:
            await self._settle_produced(504, "deadline")
        except httpx.HTTPError:
            # The upstream broke mid-stream: charge what was produced, end the client's stream.
            await self._settle_produced(502, "upstream_broken")
        except Exception:  # noqa: BLE001 - whatever broke, what was relayed is charged
            log.exception("relaying the stream of %s failed", self.call.request_id)
            await self._settle_produced(500, "gateway_error")
        finally:
            if self.call.ended:
                if self.reading is not None:
                    self.reading.add_done_callback(_collect)
                await self.upstream.aclose()
            else:
                self.client_gone()  # closed or cancelled mid-stream

    async def _drain(self, status: int, outcome: str) -> None:
        try:
            async with asyncio.timeout(settings.GATEWAY_STREAM_DRAIN_SECONDS):
                while (chunk := await self._next_chunk()) is not None:
                    for event in self._events(chunk):
                        self._inspect(event)
        except (httpx.HTTPError, TimeoutError):
            pass  # the upstream broke or took too long: settle what we have seen
        except Exception:  # noqa: BLE001 - whatever happened, the hold must still end
            log.exception("draining the stream of %s failed", self.call.request_id)
        finally:
            if self.reading is not None:
                # The drain gave up on a read still in flight; closing the response ends it
                # with an error nobody awaits. Collect it so asyncio does not log it as lost.
                self.reading.add_done_callback(_collect)
            try:
                await self._settle_produced(status, outcome)
            finally:
                await self.upstream.aclose()


def _collect(future: asyncio.Future[bytes]) -> None:
    if not future.cancelled():
        future.exception()
