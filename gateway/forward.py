"""Forwarding an admitted call upstream, streaming it back, and ending its hold exactly once.

Settle with the upstream's `usage` (prompt + completion tokens). If a stream breaks or the client
leaves after tokens were produced, charge what was produced: keep reading the upstream for the
usage event for a bounded time, else count the text received. Release only when the upstream
produced nothing (connection error, timeout before the first byte, an error status).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from gateway.admission import Admission
from gateway.auth import KeyContext
from gateway.bodies import Endpoint, ParsedBody
from gateway.catalog import cost_micros
from gateway.errors import GatewayError, upstream_error
from gateway.listener import publish_cooldown
from gateway.providers import Upstream
from gateway.runtime import GatewayRuntime
from gateway.tokens import count_stream_text
from quotas.engine import QuotaStoreUnavailable

log = logging.getLogger(__name__)

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_BAD_KEY_COOLDOWN_S = 60.0


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
    ended: bool = field(default=False)

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
        if self.ended:
            return
        self.ended = True
        hold = self.admission.reservation.hold
        event = self._event(status, input_tokens, output_tokens, outcome)
        if hold is None:
            log.error("FAIL-OPEN unmetered call %s of tenant %s: %s", self.request_id,
                      self.ctx.tenant_id, event)
            return
        cost = cost_micros(self.admission.estimate.price, input_tokens, output_tokens)
        await self._end(lambda: self.runtime.engine.settle(hold, input_tokens + output_tokens,
                                                          event, cost))

    async def release(self, status: int, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        hold = self.admission.reservation.hold
        if hold is None:
            return  # fail-open: nothing was held
        event = self._event(status, 0, 0, reason)
        await self._end(lambda: self.runtime.engine.release(hold, event))

    async def _end(self, operation) -> None:  # type: ignore[no-untyped-def]
        try:
            result = await operation()
        except QuotaStoreUnavailable:
            # The hold stays open; retry in the background rather than leave it to the sweep,
            # which would release it unbilled.
            self.runtime.spawn(lambda: _retry_end(operation, self.request_id))
            return
        if result.outcome not in ("settled", "released"):
            log.error("hold of %s had already ended as %r: its usage is not counted again",
                      self.request_id, result.outcome)

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


@functools.lru_cache(maxsize=1024)
def _upstream_url(base_url: str, path: str) -> httpx.URL:
    return httpx.URL(f"{base_url}/{path}")


async def _retry_end(operation, request_id: str) -> None:  # type: ignore[no-untyped-def]
    for delay in (0.2, 0.5, 1, 2, 5, 10, 20):
        await asyncio.sleep(delay)
        try:
            await operation()
            return
        except QuotaStoreUnavailable:
            continue
    log.error("could not end hold %s: Redis unreachable; the sweep will release it", request_id)


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


def _upstream_failure(response: httpx.Response, body: bytes) -> GatewayError | HttpResponse:
    """A client error of the upstream is passed through (it is OpenAI-shaped and about the
    request); a server error becomes our 502."""
    if response.status_code < 500:
        return HttpResponse(body, status=response.status_code,
                            content_type=response.headers.get("content-type", "application/json"))
    return upstream_error(502, f"The upstream provider failed with HTTP {response.status_code}.")


def _text_of(endpoint: Endpoint, data: dict[str, Any]) -> str:
    parts: list[str] = []
    for choice in data.get("choices") or ():
        if endpoint is Endpoint.CHAT:
            message = choice.get("message") or choice.get("delta") or {}
            parts.append(message.get("content") or "")
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                parts.append(function.get("name") or "")
                parts.append(function.get("arguments") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def forward(call: Call) -> HttpResponse | StreamingHttpResponse:
    runtime = call.runtime
    payload = call.payload()
    candidates = runtime.pool.candidates(call.admission.model, call.ctx.tenant_id, time.time())
    last_429: httpx.Response | None = None
    refused_key = False  # an upstream refused a provider key (401 / 403)
    capacity_wait_ms: int | None = None
    for upstream in candidates:
        if upstream.rpm_capacity or upstream.tpm_capacity:
            taken = await runtime.engine.take_capacity(
                upstream.id, upstream.rpm_capacity, upstream.tpm_capacity,
                call.admission.reservation.granted)
            if not taken.taken:
                capacity_wait_ms = min(taken.retry_after_ms, capacity_wait_ms or 10**9)
                continue
        call.upstream = upstream
        request = call.request_for(upstream, payload)
        try:
            # Straight to the transport: the client's cookie, auth and redirect layers cost a
            # measurable share of a request and do nothing for an API call.
            response = await runtime.transport.handle_async_request(request)
        except _CONNECT_ERRORS:
            log.warning("provider key %s unreachable; trying the next", upstream.public_id)
            continue
        except httpx.TimeoutException:
            await call.release(504, "upstream_timeout")
            raise upstream_error(504, "The upstream provider did not answer in time.") from None
        except httpx.HTTPError as exc:
            await call.release(502, "upstream_error")
            raise upstream_error(502, f"The upstream provider failed: {exc}") from None

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
            failure = _upstream_failure(response, body)
            if isinstance(failure, GatewayError):
                raise failure
            for name, value in call.response_headers().items():
                failure[name] = value
            return failure
        if call.parsed.stream:
            return StreamRelay(call, response).response()
        return await _complete(call, response)

    if refused_key and last_429 is None:
        await call.release(502, "upstream_refused_key")
        raise upstream_error(502, "The upstream refused the gateway's provider key; the operators "
                             "have been alerted.")
    cooling = _cooldown_left(runtime, call)
    if capacity_wait_ms is not None and cooling is None and last_429 is None:
        cooling = max(1, math.ceil(capacity_wait_ms / 1000))
    if last_429 is not None or cooling is not None:
        await call.release(429, "upstream_rate_limited")
        retry_after = int(_retry_after(last_429)) if last_429 is not None else cooling
        raise GatewayError(429, "Every upstream provider key for this model is rate limited; "
                           "retry shortly.", "requests", "rate_limit_exceeded", None, retry_after)
    await call.release(502, "no_upstream")
    raise upstream_error(502, "No upstream provider for this model could be reached.")


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
        async with asyncio.timeout(settings.GATEWAY_UPSTREAM_TOTAL_TIMEOUT):
            body = await response.aread()
    except (httpx.HTTPError, TimeoutError):
        # Headers arrived but the body did not: the upstream may have produced and billed
        # tokens we cannot see, so charge the worst case we held rather than nothing.
        await response.aclose()
        est = call.admission.estimate
        await call.settle(est.prompt_tokens, call.admission.reservation.granted - est.prompt_tokens,
                          status=504, outcome="upstream_broken")
        raise upstream_error(504, "The upstream provider stopped answering mid-response.") from None
    await response.aclose()
    try:
        data = json.loads(body)
    except ValueError:
        data = {}
    tokens = _usage_tokens(data.get("usage")) if isinstance(data, dict) else None
    if tokens is None:
        info = call.admission.estimate.info
        text = _text_of(call.parsed.endpoint, data) if isinstance(data, dict) else ""
        tokens = (call.admission.estimate.prompt_tokens, count_stream_text(text, info.tokenizer))
        await call.settle(*tokens, outcome="no_usage")
    else:
        await call.settle(*tokens)
    return HttpResponse(body, status=200, content_type="application/json",
                        headers=call.response_headers())


class StreamRelay:
    """Pass SSE events through as they arrive; capture usage; end the hold exactly once."""

    def __init__(self, call: Call, response: httpx.Response) -> None:
        self.call = call
        self.upstream = response
        self.buffer = b""
        self.usage: tuple[int, int] | None = None
        self.text_events: list[bytes] = []  # parsed only when no usage arrives
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
        # gateway.asgi calls this when the client leaves before the stream has ended.
        response.tollgate_client_gone = self.client_gone  # type: ignore[attr-defined]
        return response

    def client_gone(self) -> None:
        """Finish reading the upstream for its usage in a task of its own, then settle."""
        if self.call.ended or self.handed_off:
            return
        self.handed_off = True
        self.call.runtime.spawn(self._drain)

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

    def _received_tokens(self) -> int:
        text = []
        for event in self.text_events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    try:
                        text.append(_text_of(self.call.parsed.endpoint, json.loads(line[5:])))
                    except (ValueError, AttributeError):
                        continue
        return count_stream_text("".join(text), self.call.admission.estimate.info.tokenizer)

    async def _settle_produced(self, status: int, outcome: str) -> None:
        if self.usage is not None:
            await self.call.settle(*self.usage, status=status, outcome=outcome)
        else:
            await self.call.settle(self.call.admission.estimate.prompt_tokens,
                                   self._received_tokens(), status=status,
                                   outcome=f"{outcome}_counted")

    async def relay(self):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + settings.GATEWAY_UPSTREAM_TOTAL_TIMEOUT
        try:
            while (chunk := await self._next_chunk()) is not None:
                for event in self._events(chunk):
                    out = self._inspect(event)
                    if out is not None:
                        yield out + b"\n\n"
                if time.monotonic() > deadline:
                    raise TimeoutError
            await self._settle_produced(200, "complete")
        except (httpx.HTTPError, TimeoutError):
            # The upstream broke mid-stream: charge what was produced, end the client's stream.
            await self._settle_produced(502, "upstream_broken")
        finally:
            if self.call.ended:
                await self.upstream.aclose()
            else:
                self.client_gone()  # closed or cancelled mid-stream

    async def _drain(self) -> None:
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
            await self.upstream.aclose()
            await self._settle_produced(499, "client_disconnected")


def _collect(future: asyncio.Future[bytes]) -> None:
    if not future.cancelled():
        future.exception()
