"""A non-streamed answer's response made while the upstream answers (gateway/forward.py
Call.prepare_answer, a loop callback scheduled as the request is sent): the answer is that very
response with the upstream's body, its headers those made without it; without one, the answer
is made as before; a later attempt (after a 429 on the first key) prepares its own; a stream
prepares none."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import redis.asyncio

from gateway import forward
from gateway.admission import Admission
from gateway.bodies import Endpoint, parse_body
from gateway.forward import Call
from gateway.providers import ProviderPool, Upstream
from gateway.runtime import GatewayRuntime
from quotas.engine import Reservation

FIRST = Upstream(1, "pk_first", "http://first.invalid/v1", "sk-first", None, None, priority=2)
SECOND = Upstream(2, "pk_second", "http://second.invalid/v1", "sk-second", None, None)
REQUEST_ID = "req_" + "1" * 24
CTX = SimpleNamespace(tenant_id=5, limits=SimpleNamespace(show_rate_headers=False))
ANSWER = b'{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}'


def _runtime(transport: Any) -> GatewayRuntime:
    # The engine's client only for the circuit's breaker store: a plain call makes no round trip.
    return GatewayRuntime(engine=SimpleNamespace(client=redis.asyncio.Redis()),  # type: ignore[arg-type]
                          http=None,  # type: ignore[arg-type]
                          transport=transport, auth=None, catalog=None,  # type: ignore[arg-type]
                          pool=ProviderPool((FIRST, SECOND)), db=None,  # type: ignore[arg-type]
                          upstream_headers={"User-Agent": "tollgate-test"},
                          upstream_timeout={"connect": 1.0, "read": 2.0})


def _call(runtime: GatewayRuntime, stream: bool = False, fallback: str | None = None) -> Call:
    body = {"model": "gpt-4o", "max_tokens": 100, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}
    reservation = Reservation(admitted=True, request_id=REQUEST_ID, granted=120, counters=(),
                              refused=None, server_time_ms=0, hold=None)
    estimate = SimpleNamespace(output_cap=100, amount=120, prompt_tokens=20)
    admission = Admission(reservation, "gpt-4o-mini" if fallback else "gpt-4o",
                          estimate, 100, fallback_from=fallback)  # type: ignore[arg-type]
    call = Call(runtime, CTX, parse_body(Endpoint.CHAT, json.dumps(body).encode()),  # type: ignore[arg-type]
                admission, REQUEST_ID, 0.0)
    call.headers = {"x-ratelimit-remaining-tokens": "880"}  # what rate_headers made
    return call


def test_the_answer_is_the_prepared_response_with_the_body_and_the_same_headers() -> None:
    async def scenario() -> None:
        plain = _call(_runtime(None), fallback="gpt-4o")
        made = plain.answer(ANSWER)  # nothing prepared: made now
        call = _call(_runtime(None), fallback="gpt-4o")
        call.prepare_answer()
        shell = call.answer_shell
        assert shell is not None
        answer = call.answer(ANSWER)
        assert answer is shell and call.answer_shell is None  # taken once
        assert answer.content == made.content == ANSWER
        assert answer.status_code == made.status_code == 200
        assert list(answer.items()) == list(made.items())
        assert answer["X-Tollgate-Fallback-Model"] == "gpt-4o-mini"
        assert answer["x-ratelimit-remaining-tokens"] == "880"
        again = call.answer(ANSWER)  # a second answer is its own response
        assert again is not answer and again.content == ANSWER

    asyncio.run(scenario())


class Upstreams:
    """A transport answering each request after a turn of the event loop (the upstream's wait),
    noting the call's prepared response at that moment; the first key answers 429."""

    def __init__(self) -> None:
        self.call: Call | None = None
        self.during_wait: list[tuple[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert self.call is not None
        await asyncio.sleep(0)
        self.during_wait.append((request.url.host, self.call.answer_shell))
        if request.url.host == "first.invalid":
            return httpx.Response(429, headers={"retry-after": "1"}, request=request)
        return httpx.Response(200, content=ANSWER, request=request)


def _forwarded(stream: bool) -> tuple[Call, Upstreams, httpx.Response]:
    upstreams = Upstreams()

    async def scenario() -> tuple[Call, httpx.Response]:
        runtime = _runtime(upstreams)
        call = upstreams.call = _call(runtime, stream=stream)
        cooled: list[int] = []

        async def cooldown(runtime: Any, key_id: int, until: float) -> None:
            cooled.append(key_id)

        original = forward.publish_cooldown
        forward.publish_cooldown = cooldown  # type: ignore[assignment]
        try:
            response = await forward._answer(call)
        finally:
            forward.publish_cooldown = original  # type: ignore[assignment]
        assert cooled == [FIRST.id]
        return call, response

    call, response = asyncio.run(scenario())
    return call, upstreams, response


def test_each_attempt_of_a_plain_call_prepares_its_answer_while_the_upstream_answers() -> None:
    call, upstreams, response = _forwarded(stream=False)
    assert response.status_code == 200
    (first_host, first), (second_host, second) = upstreams.during_wait
    assert (first_host, second_host) == ("first.invalid", "second.invalid")
    assert first is not None and second is not None and second is not first
    assert call.answer(ANSWER) is second


def test_a_stream_prepares_no_answer() -> None:
    call, upstreams, _ = _forwarded(stream=True)
    assert [shell for _, shell in upstreams.during_wait] == [None, None]
    assert call.answer_shell is None
