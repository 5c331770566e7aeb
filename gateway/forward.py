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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from gateway.admission import Admission, queue_ticket, reserve_meta
from gateway.auth import KeyContext
from gateway.bodies import Endpoint, ParsedBody
from gateway.circuit import NO_PROBE, circuit_for
from gateway.deadlines import deadline_at, deadline_in
from gateway.dialects import Dialect, StreamReader, dialect_for
from gateway.errors import (
    Api,
    GatewayError,
    queue_timeout,
    upstream_client_error,
    upstream_error,
    upstream_unavailable,
)
from gateway import metrics
from gateway.listener import publish_cooldown
from gateway.headers import QUEUE_WAIT_HEADER, rate_headers
from gateway.observe import Observation, end_with_error
from gateway.providers import Upstream
from gateway.responses_context import remember_answer
from gateway.runtime import GatewayRuntime
from gateway.tokens import count_stream_text
from gateway.upstream_http import answer_arrived, encode_ahead, read_answer
from gateway.usage import Usage
from quotas.engine import (
    CapacityWait,
    Hold,
    PackedSettle,
    Phase,
    QuotaError,
    QuotaStoreUnavailable,
    ReleaseResult,
    SettleResult,
)
from quotas.waiting import QueueTimedOut, QueueTiming, wait_for_capacity

if TYPE_CHECKING:  # the script pool may be missing at run time (hiredis is optional)
    from quotas.script_pool import Sent

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
_perf = time.perf_counter

# The attribute of a non-streamed answer holding what its body waits for: the hold's end
# (Call.settled). The headers may go out before it; the body, the answer itself, never does, so
# a client holding its answer holds a settled call, as a stream's settles before its last byte.
SETTLED_BEFORE_BODY = "tollgate_settled"


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
    # Rate / quota headers for the client; None: made from the reservation when first needed
    # (rate_limit_headers), usually while the upstream answers (prepare_ahead).
    headers: dict[str, str] | None = None
    # The client's headers an upstream of this API is told (anthropic-version, anthropic-beta).
    client_headers: Mapping[str, str] = field(default_factory=dict)
    # The one provider key that may serve the call (a Responses call continuing a response
    # stored there: no other key knows it); None: any key of the model's kind.
    pinned: int | None = None
    # What the call reports (gateway/observe.py): made by the view; one of its own otherwise.
    obs: Observation | None = None
    # The upstream request made while the reserve was in flight (prepare_upstream), if any.
    prepared: Prepared | None = None
    upstream: Upstream | None = None
    relay: StreamRelay | None = None
    # Handed to an upstream's transport: from here on the upstream may have the call.
    sent: bool = False
    answered: bool = False  # the upstream's 200 headers arrived: it is producing the answer
    # On the event loop's clock (loop.time()): just after the reserve, and the call's deadline.
    reserved_at: float = field(init=False)
    deadline: float = field(init=False)
    started_ms: int = field(init=False)  # wall clock, for an unmetered call's usage event
    dialect: Dialect = field(init=False)
    # The upstream's id of the answer (a Responses or Messages id), once seen.
    answer_id: str | None = field(default=None, init=False)
    remembered: bool = field(default=False, init=False)
    _end: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _checkpoints: Checkpoints | None = field(default=None, init=False, repr=False)
    # The hold's settle packed ahead (prepare_settle), made while the upstream answers.
    _packed_settle: PackedSettle | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.dialect = dialect_for(self.parsed.endpoint)
        loop = asyncio.get_running_loop()
        self.reserved_at = loop.time()
        self.deadline = self.reserved_at + settings.GATEWAY_CALL_DEADLINE_SECONDS
        self.started_ms = _ms_now()
        reservation = self.admission.reservation
        obs = self.obs
        if obs is None:
            obs = self.obs = Observation(self.parsed.endpoint.value)
            obs.request_id = self.request_id
        # The model served (after a fallback, not the one asked), as a bounded label.
        obs.model = metrics.model_label(self.runtime.catalog, self.admission.model)
        if reservation.queue_wait_ms:
            obs.queued_s += reservation.queue_wait_ms / 1000
        obs.hold_pending = True  # until _begin_end's task ends it (Observation.hold_ended)
        hold = reservation.hold
        if hold is not None:
            metrics.add(metrics.HOLD_OPENED)
            self._checkpoints = Checkpoints(self, hold, loop, settings.GATEWAY_CHECKPOINT_SECONDS)

    @property
    def ended(self) -> bool:
        """The hold's end (settle or release) has begun; it finishes even if nobody awaits it."""
        return self._end is not None

    # -- ending the hold ------------------------------------------------------------------

    def _event(self, status: int, usage: Usage, outcome: str) -> str:
        return json.dumps({
            **usage.event_fields(), "st": status, "outcome": outcome,
            "pk": self.upstream.id if self.upstream else None,
            "lat": round((time.monotonic() - self.started) * 1000),
            "stream": self.parsed.stream, "soft": self.admission.soft,
            "fb": self.admission.fallback_from,
        }, separators=(",", ":"))

    def prepare_settle(self) -> None:
        """Pack the hold's settle but for its figures (quotas: packed_settle), for the settle
        to send at once after the answer. Scheduled just before the request goes upstream, so it
        runs while the worker waits for the answer, with nothing else to do at one client."""
        hold = self.admission.reservation.hold
        if hold is not None and self._end is None and self._packed_settle is None:
            self._packed_settle = self.runtime.engine.packed_settle(hold)

    def prepare_ahead(self) -> None:
        """What the answer needs that the upstream's answer does not decide, made while the
        upstream answers: the hold's settle packed (prepare_settle) and the rate headers.
        Scheduled just before the request goes upstream. At one client the worker waits idle
        for the upstream then, while the settle's wait is already filled by the answer's own
        work: the headers made there were on the call's path (docs/benchmarks.md, "the rate
        headers made while the upstream answers"). The answer's HttpResponse is not made
        ahead: that cost 4-7 % more worker CPU at 16 clients, twice measured."""
        self.prepare_settle()
        if self._end is None:
            self.rate_limit_headers()

    async def settle(self, usage: Usage, *, status: int = 200, outcome: str = "complete") -> None:
        """Charge the hold with this usage (the first end wins; later calls only wait for it).
        Its tokens and cost are counted once (at the loop's next turn, begin_settle), whether the
        hold's end reaches Redis now, on a retry, or never (a fail-open call's usage is real
        too)."""
        self.begin_settle(usage, status=status, outcome=outcome)
        await self._wait_end()

    def begin_settle(self, usage: Usage, *, status: int = 200, outcome: str = "complete") -> bool:
        """Start charging the hold with this usage (the first end wins), without waiting for
        it: its script is written to Redis now when it can be (a settle packed ahead and a free
        script connection: True), else sent at the event loop's next turn by the end's task.
        `settled()` waits for it."""
        if self._end is not None:
            return False
        event = self._event(status, usage, outcome)
        # The price resolved at admission: the one the money hold and the ledger use, each
        # token class at its own price.
        cost = self.admission.estimate.price.cost_of(usage)
        sent = self._send_settle(usage.total, event, cost)
        self._begin_end(self._settle_hold(usage, event, cost, sent))
        # Counted at the loop's next turn, after the end's script is sent: the tally then runs
        # while Redis does (nothing reads it before the answer is sent).
        asyncio.get_running_loop().call_soon(self._count_settled, usage, cost)
        return sent is not None

    def _send_settle(self, used: int, event: str, cost: int) -> Sent | None:
        """The hold's settle written to Redis at once (quotas: send_settle), its reply awaited
        by the end's task; None when it goes the usual way (no hold: fail-open; a traced call;
        nothing packed ahead; no free script connection)."""
        hold = self.admission.reservation.hold
        if hold is None or (self.obs is not None and self.obs.span is not None):
            return None  # traced: the settle's span holds its write, as the reserve's does
        try:
            return self.runtime.engine.send_settle(hold, used, event, cost, self._packed_settle)
        except Exception:  # noqa: BLE001 - the settle is then sent the usual way, which reports
            log.exception("writing the settle of %s at once failed; it goes the usual way",
                          self.request_id)
            return None

    def _count_settled(self, usage: Usage, cost: int) -> None:
        obs = self.obs
        assert obs is not None
        metrics.count_usage(obs.model, usage, cost, obs.tenant)
        obs.settled(usage.input_tokens, usage.output_tokens, cost)

    async def settled(self) -> None:
        """Wait for the hold's end begun earlier (shielded: see _wait_end). Raises only if
        cancelled: the answer waiting for it has been made, and an end that failed (a bug:
        _try_end logs Redis' own failures) is logged here and leaves the hold to the sweep,
        which charges what it knew."""
        try:
            await self._wait_end()
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("ending the hold of %s failed; its answer is sent", self.request_id)

    async def release(self, status: int, reason: str) -> None:
        """Free the hold unbilled: only when the upstream produced nothing."""
        if self._end is None:
            self._begin_end(self._release_hold(self._event(status, Usage(), reason)))
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
            await self.settle(Usage(est.prompt_tokens, max(0, granted - est.prompt_tokens)),
                              status=status, outcome=reason)
        else:
            await self.release(status, reason)

    def _begin_end(self, work: Coroutine[Any, Any, None]) -> None:
        if self._checkpoints is not None:
            self._checkpoints.stop()
        # Dropped: the checkpoints (the only reader of the relay's count) and a stream's relay
        # point back at this call, cycles the cyclic GC would otherwise have to find, pausing
        # the worker (a checkpoint write still in flight keeps its own reference).
        self._checkpoints = None
        self.relay = None
        self._end = self.runtime.detach(work)
        assert self.obs is not None
        self._end.add_done_callback(self.obs.hold_ended)  # its access line, if held back

    async def _wait_end(self) -> None:
        assert self._end is not None
        # Shielded: cancelling this request (its client left) leaves the end task running.
        await asyncio.shield(self._end)

    async def _settle_hold(self, usage: Usage, event: str, cost: int,
                           sent: Sent | None = None) -> None:
        """`sent`: the settle already written (begin_settle): its first attempt waits for that
        reply, its round trip timed from the write; a retry (Redis unreachable) sends it
        again."""
        hold = self.admission.reservation.hold
        if hold is None:
            log.error("FAIL-OPEN unmetered call %s of tenant %s: %s", self.request_id,
                      self.ctx.tenant_id, event)
            _unmetered_backlog().add(self.runtime, UnmeteredUsage(
                self.ctx.tenant_tag, self.request_id, usage.total,
                self.started_ms, _ms_now(), reserve_meta(self.ctx, self.parsed,
                                                           self.admission.model), event))
            return
        engine = self.runtime.engine
        used = usage.total
        packed = self._packed_settle
        first = sent

        def attempt() -> Awaitable[EndResult]:
            nonlocal first
            if first is not None:
                written, first = first, None
                return self._timed_end("quota.settle", metrics.REDIS_SETTLE, "settled", used,
                                       lambda: engine.settle(hold, used, event, cost, packed,
                                                             written), written)
            return self._timed_end("quota.settle", metrics.REDIS_SETTLE, "settled", used,
                                   lambda: engine.settle(hold, used, event, cost, packed))

        await self._end_hold(attempt)

    async def _release_hold(self, event: str) -> None:
        hold = self.admission.reservation.hold
        if hold is None:
            return  # fail-open: nothing was held, and nothing reached the upstream to record
        engine = self.runtime.engine
        await self._end_hold(lambda: self._timed_end(
            "quota.release", metrics.REDIS_RELEASE, "released", 0,
            lambda: engine.release(hold, event)))

    async def _timed_end(self, name: str, rtt: metrics.HistogramChild, ending: str, used: int,
                         operation: Callable[[], Awaitable[EndResult]],
                         written: Sent | None = None) -> EndResult:
        """One settle or release round trip: its latency, how it came back (holds settled,
        released, or ended already, and a settle above its hold), and its span when traced.
        Every attempt is measured (a retry after Redis came back too). `written`: its command,
        written before this (begin_settle): timed from that write to its reply's arrival
        (Sent.round_trip: the loop's reading of it, not this task's turn after it)."""
        obs = self.obs
        assert obs is not None
        span = obs.start_child(name) if obs.span is not None else None
        began = _perf()
        try:
            result = await operation()
        except BaseException as exc:
            if span is not None:
                end_with_error(span, exc)
            raise
        metrics.observe(rtt, _perf() - began if written is None else written.round_trip())
        metrics.count_hold_end(ending, result.outcome, used, result.held)
        if span is not None:
            span.set_attribute("tollgate.outcome", result.outcome)
            span.end()
        return result

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

    def _prepared(self) -> Prepared | None:
        """The prepared payload and request, if made for this admission's model and output cap
        (not a fallback model, not a hold shrunk to the headroom)."""
        prepared = self.prepared
        if (prepared is None or prepared.upstream is None
                or (prepared.model, prepared.cap) != (self.admission.model,
                                                      self.admission.output_cap)):
            return None
        return prepared

    def payload(self) -> bytes:
        prepared = self._prepared()
        if prepared is not None:
            return prepared.payload
        return self.dialect.payload(self.parsed, self.admission.model, self.admission.output_cap)

    def request_for(self, upstream: Upstream, payload: bytes) -> httpx.Request:
        prepared = self._prepared()
        # The key the call takes now (the pool's candidates, with this call's round-robin turn
        # and the cooldowns, breakers and keys of this moment) is the one it was made for: the
        # same object, so neither reloaded nor replaced since.
        if prepared is not None and prepared.request is not None \
                and prepared.upstream is upstream and prepared.payload is payload:
            request, prepared.request = prepared.request, None  # one attempt uses it
            return request
        return upstream_request_for(self.runtime, self.dialect, self.parsed.endpoint,
                                    self.request_id, self.client_headers, upstream, payload)

    def rate_limit_headers(self) -> dict[str, str]:
        if self.headers is None:
            self.headers = rate_headers(self.ctx, self.admission.reservation,
                                        anthropic=self.dialect.api is Api.ANTHROPIC)
        return self.headers

    def response_headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(self.rate_limit_headers())
        if self.admission.fallback_from:
            headers["X-Tollgate-Fallback-Model"] = self.admission.model
        if self.admission.soft:
            headers["X-Tollgate-Soft-Limit"] = "exceeded"
        if not self.admission.metered:
            headers["X-Tollgate-Unmetered"] = "true"
        headers.update(extra or {})
        return headers

    async def remember(self, usage: Usage) -> None:
        """A stored Responses answer is remembered (its provider key, its context size) before
        the client can ask for the next turn: awaited before the answer, or a stream's final
        event, is sent (one round trip, Responses calls only)."""
        if self.dialect.remembers and self.answer_id is not None and not self.remembered:
            self.remembered = True
            upstream = self.upstream.id if self.upstream is not None else None
            # Shielded: a client leaving during the write must not leave the response
            # unremembered (its next turn would be refused as unseen).
            await asyncio.shield(self.runtime.detach(remember_answer(
                self.runtime, self.ctx, self.parsed, self.answer_id, upstream, usage)))

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
            # The worker's task (spawn: no call's ids), not the call's that happened to start it.
            self.flushing = runtime.spawn(lambda: self._flush(runtime))

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


def upstream_request(url: httpx.URL, payload: bytes, headers: Mapping[str, str],
                     extensions: dict[str, Any]) -> httpx.Request:
    """`httpx.Request("POST", url, content=payload, headers=headers, extensions=extensions)`:
    the same request (method, URL, headers in the same order, body, extensions), with the two
    headers httpx adds for a body in memory (Host first, unless given; Content-Length last,
    unless given) added here instead. httpx's own build looks every header up again in its
    case-insensitive list and builds that list twice: a few percent of a call's CPU.
    tests/gateway/test_upstream_request.py holds it equal to httpx's."""
    names = {name.lower() for name in headers}
    raw: list[tuple[str | bytes, str | bytes]] = list(headers.items())
    if payload and "content-length" not in names:
        raw.append(("Content-Length", str(len(payload))))
    first: list[tuple[str | bytes, str | bytes]] = []
    if "host" not in names and url.host:
        first.append((b"Host", url.netloc))
    if not payload and "content-length" not in names and "transfer-encoding" not in names:
        first.append((b"Content-Length", b"0"))
    if first:
        raw[:0] = first
    request = httpx.Request("POST", url, headers=raw, stream=httpx.ByteStream(payload),
                            extensions=extensions)
    request.read()  # as httpx does for a body in memory: request.content is set
    return request


def upstream_request_for(runtime: GatewayRuntime, dialect: Dialect, endpoint: Endpoint,
                         request_id: str, client_headers: Mapping[str, str], upstream: Upstream,
                         payload: bytes) -> httpx.Request:
    """The request to `upstream`: what the client's build_request() makes (its default headers
    and timeouts, read once in the runtime), without re-merging base URL, cookies and params on
    every call."""
    headers = {**runtime.upstream_headers,
               **dialect.upstream_headers(upstream.secret, client_headers),
               "Content-Type": "application/json", "X-Request-Id": request_id}
    return upstream_request(_upstream_url(upstream.base_url, endpoint.value), payload, headers,
                            {"timeout": runtime.upstream_timeout})


@dataclass
class Prepared:
    """The upstream request a call will most likely send: the model and output cap it asked
    for, to the key the pool would give it now. Made while the call's reserve is in flight, when
    the worker has nothing else to do (docs/benchmarks.md, "Issue 16 item 3: using the waits").
    Used only if the admission kept that model and cap, and the call, taking its turn from the
    pool after the reserve, gets that very key (Call.request_for): a key gone into cooldown,
    an opened breaker, a reloaded pool or another call's turn in between, and the request is
    made again as without it."""

    model: str
    cap: int | None
    payload: bytes = b""
    upstream: Upstream | None = None  # None: nothing made (not yet, or no key)
    request: httpx.Request | None = None  # for `upstream`; taken by the first attempt


def prepare_upstream(runtime: GatewayRuntime, ctx: KeyContext, parsed: ParsedBody,
                     output_cap: int | None, request_id: str,
                     client_headers: Mapping[str, str], at_once: bool = False) -> Prepared:
    """A Prepared, filled at the event loop's next turn: call it just before awaiting the
    reserve, whose script is then in flight. `at_once`: filled now, the reserve's script being
    in flight already (written ahead): its reply may be there by the next turn, and the call
    would then make its request before the look ahead had made it."""
    prepared = Prepared(parsed.model, output_cap)
    if at_once:
        # As a loop callback's would, a failure here is logged and leaves nothing prepared: the
        # caller must go on to wait for its reserve's reply (the call then makes its request
        # itself and fails there, its hold released), never leave it unread.
        try:
            _prepare(prepared, runtime, ctx, parsed, request_id, client_headers)
        except Exception:  # noqa: BLE001 - see above
            log.exception("preparing the upstream request of %s failed", request_id)
    else:
        asyncio.get_running_loop().call_soon(_prepare, prepared, runtime, ctx, parsed,
                                             request_id, client_headers)
    return prepared


def _prepare(prepared: Prepared, runtime: GatewayRuntime, ctx: KeyContext, parsed: ParsedBody,
             request_id: str, client_headers: Mapping[str, str]) -> None:
    dialect = dialect_for(parsed.endpoint)
    # A look ahead: the turn stays the call's, taken in _answer only if it goes upstream (a
    # refused call takes none, a fallback one its own model's).
    candidates = runtime.pool.candidates(prepared.model, ctx.tenant_id, time.time(),
                                         kind=dialect.provider_kind, take_turn=False)
    if not candidates:
        return
    payload = dialect.payload(parsed, prepared.model, prepared.cap)
    request = upstream_request_for(runtime, dialect, parsed.endpoint, request_id,
                                   client_headers, candidates[0], payload)
    encode_ahead(runtime.transport, request)  # its bytes too: its send is then a write
    prepared.request = request
    prepared.payload = payload
    prepared.upstream = candidates[0]


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(1.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def _upstream_failed(obs: Observation, upstream: Upstream, kind: str, began: float,
                     span: Any, exc: BaseException) -> None:
    """An attempt that got no answer from the upstream: counted by kind, its wait is the
    upstream's, its span ends in error."""
    obs.waited_upstream(_perf() - began)
    metrics.upstream_error(upstream.public_id, kind)
    if span is not None:
        end_with_error(span, exc)


def _upstream_failure(response: httpx.Response, body: bytes) -> GatewayError:
    """A client error of the upstream is told in Tollgate's words, keeping its status, type,
    code and param (never its message: it may name the provider's organisation, deployments
    or URLs); a server error becomes our 502."""
    if response.status_code < 500:
        return upstream_client_error(response.status_code, body)
    return upstream_error(502, f"The upstream provider failed with HTTP {response.status_code}.")


async def forward(call: Call) -> HttpResponse | StreamingHttpResponse:
    """Send the call to an upstream and answer the client; the hold ends exactly once."""
    deadline = deadline_at(call.deadline)
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
    if taken is not None:
        candidates = [taken]
    else:
        # Only keys of the API's kind (an Anthropic key cannot answer a chat completion).
        candidates = runtime.pool.candidates(model, call.ctx.tenant_id, now,
                                             kind=call.dialect.provider_kind)
        if call.pinned is not None:
            candidates = [upstream for upstream in candidates if upstream.id == call.pinned]
    circuit = circuit_for(runtime)
    obs = call.obs
    assert obs is not None
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
            span = (obs.start_child("upstream.call", **{"tollgate.provider_key": upstream.public_id})
                    if obs.span is not None else None)
            began = obs.upstream_wait()
            asyncio.get_running_loop().call_soon(call.prepare_ahead)
            try:
                # Straight to the transport: the client's cookie, auth and redirect layers cost a
                # measurable share of a request and do nothing for an API call.
                response = await runtime.transport.handle_async_request(request)
            except _CONNECT_ERRORS as exc:
                _upstream_failed(obs, upstream, "connect", began, span, exc)
                log.warning("provider key %s unreachable; trying the next", upstream.public_id)
                await circuit.report(upstream, model, ticket, transport_failed=True)
                continue
            except httpx.TimeoutException as exc:
                _upstream_failed(obs, upstream, "timeout", began, span, exc)
                await circuit.report(upstream, model, ticket, transport_failed=True)
                await call.release(504, "upstream_timeout")
                raise upstream_error(504, "The upstream provider did not answer in time.") from None
            except httpx.HTTPError as exc:
                _upstream_failed(obs, upstream, "transport", began, span, exc)
                await circuit.report(upstream, model, ticket, transport_failed=True)
                await call.release(502, "upstream_error")
                raise upstream_error(502, f"The upstream provider failed: {exc}") from None
            except BaseException as exc:  # cancelled: the client left, or the call's deadline
                obs.waited_upstream(_perf() - began)
                if span is not None:
                    end_with_error(span, exc)
                raise
            waited = _perf() - began
            obs.waited_upstream(waited)
            metrics.observe(metrics.ttfb_child(obs.endpoint), waited)
            status = response.status_code
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                span.end()
            if status >= 400:
                metrics.upstream_error(upstream.public_id, metrics.status_kind(status))
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
                began = obs.upstream_wait()
                try:
                    body = await read_answer(response)
                except httpx.HTTPError:
                    body = b""
                obs.waited_upstream(_perf() - began)
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
    resting = runtime.pool.breaker_wait(model, call.ctx.tenant_id, time.time(),
                                        kind=call.dialect.provider_kind)
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
    obs = call.obs
    assert obs is not None
    # Left set if the wait is cancelled: the call's end counts the wait up to then.
    obs.queued_from = _perf()
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
    obs.queued_from = 0.0
    if not result.taken:
        return None
    obs.queued_s += waited_ms / 1000
    call.rate_limit_headers()[QUEUE_WAIT_HEADER] = str(already_ms + waited_ms)
    return upstream


def _cooldown_left(runtime: GatewayRuntime, call: Call) -> int | None:
    """Seconds until the first key for this call leaves its cooldown; None if none cools."""
    now = time.time()
    waits = [
        until - now for key_id, until in runtime.pool.cooldowns().items()
        if until > now and (upstream := runtime.pool.get(key_id)) is not None
        and upstream.serves(call.admission.model) and upstream.usable_by(call.ctx.tenant_id)
        and upstream.speaks(call.dialect.provider_kind)
    ]
    return max(1, math.ceil(min(waits))) if waits else None


async def _complete(call: Call, response: httpx.Response) -> HttpResponse:
    obs = call.obs
    assert obs is not None
    began = obs.upstream_wait()
    try:
        if answer_arrived(response):  # nothing to wait for: no timer to arm
            body = await read_answer(response)
        else:
            async with deadline_at(call.deadline):
                body = await read_answer(response)
    except (httpx.HTTPError, TimeoutError):
        # Headers arrived but the body did not (or not within the deadline): the upstream may
        # have produced and billed tokens we cannot see, so charge the worst case we held.
        obs.waited_upstream(_perf() - began)
        if call.upstream is not None:
            metrics.upstream_error(call.upstream.public_id, "broken")
        await response.aclose()
        await call.abort(504, "upstream_broken")
        raise upstream_error(504, "The upstream provider stopped answering mid-response.") from None
    obs.waited_upstream(_perf() - began)
    await response.aclose()
    try:
        usage, outcome = _body_usage(call, body)
    except Exception:  # noqa: BLE001 - the answer is here: it must be charged whatever happened
        log.exception("counting the answer of %s failed; charging its size", call.request_id)
        usage = Usage(call.admission.estimate.prompt_tokens,
                      count_stream_text(body.decode("utf-8", "replace"),
                                        call.admission.estimate.info.tokenizer))
        outcome = "gateway_error_counted"
    # The settle's script goes to Redis first; the answer is made while Redis runs it, and its
    # body leaves only once the hold is settled (SETTLED_BEFORE_BODY: the router sends the
    # headers meanwhile, gateway/asgi.py; served by Django, the view waits for it).
    if not call.begin_settle(usage, outcome=outcome):
        await asyncio.sleep(0)  # the settle's task takes its turn: its script is sent now
    await call.remember(usage)
    response = HttpResponse(body, status=200, content_type="application/json",
                            headers=call.response_headers())
    setattr(response, SETTLED_BEFORE_BODY, call.settled)
    return response


def _body_usage(call: Call, body: bytes) -> tuple[Usage, str]:
    """The usage of a whole answer: the upstream's, else its text counted."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    dialect = call.dialect
    call.answer_id = dialect.answer_id(data)
    usage = dialect.answer_usage(data)
    if usage is not None:
        return usage, "complete"
    text = dialect.answer_text(call.parsed, data)
    counted = count_stream_text(text, call.admission.estimate.info.tokenizer)
    return Usage(call.admission.estimate.prompt_tokens, counted), "no_usage"


class _DeadlinePassed(Exception):
    """The call's deadline passed mid-stream."""


class StreamRelay:
    """Pass SSE events through as they arrive; capture usage; end the hold exactly once."""

    def __init__(self, call: Call, response: httpx.Response) -> None:
        self.call = call
        call.relay = self
        self.upstream = response
        self.buffer = b""
        # The API's reader: the usage when it comes, and the events that may carry output text
        # (reader.text_events), parsed only when needed: for a checkpoint (the new ones since
        # the last) or for a settle without usage.
        self.reader: StreamReader = call.dialect.stream_reader(call.parsed)
        self.text_events = self.reader.text_events
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
            # The read's exception (StopAsyncIteration at the end) has this frame in its
            # traceback: without this reference back to the read, each stream would leave a
            # reference cycle for the cyclic GC.
            del reading

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
        return self.reader.inspect(event)

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
                texts.append(self.reader.event_text(data))
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
        reader = self.reader
        self.call.answer_id = reader.response_id
        if reader.usage is not None:
            await self.call.settle(reader.usage, status=status, outcome=outcome)
            await self.call.remember(reader.usage)
            return
        try:
            output = self._received_tokens()
        except Exception:  # noqa: BLE001 - a counting bug must not leave the hold open
            log.exception("counting the stream of %s failed; charging its size",
                          self.call.request_id)
            output = count_stream_text(b"".join(self.text_events).decode("utf-8", "replace"),
                                       self.call.admission.estimate.info.tokenizer)
        # What the upstream told before it stopped (a Messages stream's input side and output
        # so far), else the input estimate; the output never below the text relayed.
        admission = self.call.admission
        est = admission.estimate
        # The most output the upstream could have produced: the cap it was given, else what
        # the hold leaves after the input estimate.
        worst = (admission.output_cap * self.call.parsed.choices
                 if admission.output_cap is not None
                 else max(0, admission.reservation.granted - est.prompt_tokens))
        usage = reader.known(est.prompt_tokens, output, worst)
        await self.call.settle(usage, status=status, outcome=f"{outcome}_counted")
        await self.call.remember(usage)

    async def relay(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = self.call.deadline
        obs = self.call.obs
        assert obs is not None
        try:
            while True:
                # The waits for the upstream's next chunk are the upstream's time, not the
                # gateway's (gateway/metrics.py: overhead).
                began = obs.upstream_from = _perf()
                chunk = await self._next_chunk()
                obs.upstream_s += _perf() - began
                obs.upstream_from = 0.0
                if chunk is None:
                    break
                for event in self._events(chunk):
                    out = self._inspect(event)
                    if self.reader.usage is not None and self.reader.response_id is not None \
                            and self.call.dialect.remembers and not self.call.remembered:
                        # The final event of a stored response: remembered before the client
                        # has it and can ask for the next turn.
                        self.call.answer_id = self.reader.response_id
                        await self.call.remember(self.reader.usage)
                    if out is not None:
                        yield out + b"\n\n"
                if loop.time() > deadline:
                    raise _DeadlinePassed
            await self._settle_produced(200, "complete")
        except _DeadlinePassed:
            await self._settle_produced(504, "deadline")
        except httpx.HTTPError:
            # The upstream broke mid-stream: charge what was produced, end the client's stream.
            if self.call.upstream is not None:
                metrics.upstream_error(self.call.upstream.public_id, "broken")
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
            async with deadline_in(settings.GATEWAY_STREAM_DRAIN_SECONDS):
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
