"""The upstream request made while the reserve is in flight (gateway/forward.py Prepared): filled at
the event loop's next turn, for the key the pool would give the call without taking its turn;
used only when the admission kept the model and output cap asked for and the call, taking its
turn after the reserve, gets that very key; taken by one attempt. A fallback model, a hold
shrunk to the headroom, a key gone into cooldown or another call's turn in between: the request
is made as without it. Every request equals the one made without it, and the round robin is
the same with or without it (a refused call takes no turn)."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.http import HttpResponse

from gateway import views
from gateway.admission import Admission
from gateway.bodies import Endpoint, parse_body
from gateway.dialects import dialect_for
from gateway.forward import Call, Prepared, _answer, prepare_upstream, upstream_request_for
from gateway.observe import Observation
from gateway.providers import ProviderPool, Upstream
from gateway.runtime import GatewayRuntime
from gateway.upstream_http import _WIRE, TRANSPORTS, _encode, make_transport
from quotas.engine import Hold, Reservation

FIRST = Upstream(1, "pk_first", "http://first.invalid/v1", "sk-first", None, None, priority=2)
SECOND = Upstream(2, "pk_second", "http://second.invalid/v1", "sk-second", None, None)
BODY = {"model": "gpt-4o", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
REQUEST_ID = "req_" + "0" * 24
CTX = SimpleNamespace(tenant_id=5)


def _runtime(*upstreams: Upstream, transport: Any = None) -> GatewayRuntime:
    """A worker runtime with only what making upstream requests uses."""
    return GatewayRuntime(engine=None, http=None, transport=transport, auth=None,  # type: ignore[arg-type]
                          catalog=None, pool=ProviderPool(upstreams or (FIRST, SECOND)),
                          db=None,  # type: ignore[arg-type]
                          upstream_headers={"User-Agent": "tollgate-test"},
                          upstream_timeout={"connect": 1.0, "read": 2.0})


def _parsed() -> Any:
    return parse_body(Endpoint.CHAT, json.dumps(BODY).encode())


def _admission(model: str, cap: int | None) -> Admission:
    reservation = Reservation(admitted=True, request_id=REQUEST_ID, granted=120, counters=(),
                              refused=None, server_time_ms=0, hold=None)
    estimate = SimpleNamespace(output_cap=100, amount=120, prompt_tokens=20)
    return Admission(reservation, model, estimate, cap)  # type: ignore[arg-type]


def _call(runtime: GatewayRuntime, model: str, cap: int | None,
          prepared: Prepared | None) -> Call:
    return Call(runtime, CTX, _parsed(), _admission(model, cap), REQUEST_ID, 0.0,  # type: ignore[arg-type]
                prepared=prepared)


async def _prepared(runtime: GatewayRuntime) -> Prepared:
    prepared = prepare_upstream(runtime, CTX, _parsed(), 100, REQUEST_ID, {})  # type: ignore[arg-type]
    assert prepared.upstream is None  # nothing is made before the loop's next turn
    await asyncio.sleep(0)
    return prepared


def _taken(runtime: GatewayRuntime) -> Upstream:
    """The key a call that goes upstream takes (forward._answer: the pool's candidates)."""
    return runtime.pool.candidates("gpt-4o", 5, time.time())[0]


def _same_request(a: Any, b: Any) -> None:
    assert (a.method, a.url, a.headers.raw, a.content, a.extensions) == (
        b.method, b.url, b.headers.raw, b.content, b.extensions)


def _fresh(runtime: GatewayRuntime, upstream: Upstream, model: str, cap: int | None) -> Any:
    dialect = dialect_for(Endpoint.CHAT)
    return upstream_request_for(runtime, dialect, Endpoint.CHAT, REQUEST_ID, {}, upstream,
                                dialect.payload(_parsed(), model, cap))


def test_the_prepared_request_is_the_one_made_without_it_and_is_used_once() -> None:
    async def scenario() -> None:
        runtime = _runtime()
        prepared = await _prepared(runtime)
        assert prepared.upstream is FIRST
        call = _call(runtime, "gpt-4o", 100, prepared)
        payload = call.payload()
        assert payload is prepared.payload
        made = prepared.request
        upstream = _taken(runtime)
        first = call.request_for(upstream, payload)
        assert first is made and prepared.request is None  # used, and taken
        again = call.request_for(upstream, payload)  # a retry on the same key: its own request
        assert again is not first
        _same_request(first, _fresh(runtime, FIRST, "gpt-4o", 100))
        _same_request(again, first)
        assert call.request_for(SECOND, payload).url.host == "second.invalid"

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_the_prepared_request_is_encoded_ahead_as_its_send_would_encode_it(kind: str) -> None:
    # Its bytes too are made while the reserve runs (upstream_http.encode_ahead), for the native
    # transport only: the bytes its send would make of the same request, sent once.
    async def scenario() -> None:
        transport = make_transport(kind, max_connections=1)
        runtime = _runtime(transport=transport)
        prepared = await _prepared(runtime)
        ahead = prepared.request.__dict__.get(_WIRE)
        await transport.aclose()
        if kind != "native":
            assert ahead is None
            return
        assert ahead == await _encode(_fresh(runtime, FIRST, "gpt-4o", 100))
        assert ahead[1].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: first.invalid")

    asyncio.run(scenario())


@pytest.mark.parametrize(("model", "cap", "field", "sent"), [
    ("gpt-4o-mini", 100, "model", "gpt-4o-mini"),  # a fallback model
    ("gpt-4o", 40, "max_tokens", 40),  # a hold shrunk to the headroom: the smaller cap
])
def test_an_admission_changing_the_model_or_cap_gets_its_own_payload_and_request(
        model: str, cap: int, field: str, sent: Any) -> None:
    async def scenario() -> None:
        runtime = _runtime()
        prepared = await _prepared(runtime)
        call = _call(runtime, model, cap, prepared)
        payload = call.payload()
        assert json.loads(payload)[field] == sent
        request = call.request_for(FIRST, payload)
        assert request is not prepared.request
        _same_request(request, _fresh(runtime, FIRST, model, cap))

    asyncio.run(scenario())


def test_a_key_cooling_down_since_is_not_sent_the_prepared_request() -> None:
    async def scenario() -> None:
        runtime = _runtime()
        prepared = await _prepared(runtime)
        assert prepared.upstream is FIRST
        runtime.pool.cool_down(FIRST.id, time.time() + 60)  # e.g. a 429 seen by another call
        call = _call(runtime, "gpt-4o", 100, prepared)
        payload = call.payload()
        upstream = _taken(runtime)
        assert upstream is SECOND
        request = call.request_for(upstream, payload)
        assert request is not prepared.request and request.url.host == "second.invalid"
        _same_request(request, _fresh(runtime, SECOND, "gpt-4o", 100))

    asyncio.run(scenario())


def test_the_look_ahead_takes_no_round_robin_turn() -> None:
    """Two keys of equal rank take turns. Calls refused after their preparation (they never go
    upstream) take no turn, and the calls that go upstream still alternate, each sent the
    request prepared for the key it gets."""
    a = Upstream(3, "pk_a", "http://a.invalid/v1", "sk-a", None, None)
    b = Upstream(4, "pk_b", "http://b.invalid/v1", "sk-b", None, None)

    async def scenario() -> list[str]:
        runtime = _runtime(a, b)
        sent = []
        for index in range(6):
            prepared = await _prepared(runtime)
            if index % 2:
                continue  # refused by its reserve: prepared, never forwarded
            call = _call(runtime, "gpt-4o", 100, prepared)
            upstream = _taken(runtime)
            request = call.request_for(upstream, call.payload())
            assert request is not None and prepared.request is None  # the prepared one
            sent.append(upstream.public_id)
        return sent

    assert asyncio.run(scenario()) == ["pk_a", "pk_b", "pk_a"]


def test_a_call_whose_preparation_has_not_run_makes_everything_itself() -> None:
    async def scenario() -> None:
        runtime = _runtime()
        call = _call(runtime, "gpt-4o", 100, Prepared("gpt-4o", 100))  # its turn never came
        payload = call.payload()
        _same_request(call.request_for(FIRST, payload), _fresh(runtime, FIRST, "gpt-4o", 100))

    asyncio.run(scenario())


def test_no_key_for_the_model_prepares_nothing() -> None:
    async def scenario() -> None:
        prepared = await _prepared(_runtime(SECOND.__class__(9, "pk_x", "http://x.invalid/v1",
                                                             "sk-x", None, None,
                                                             models=frozenset({"other"}))))
        assert prepared.upstream is None and prepared.request is None

    asyncio.run(scenario())


@pytest.mark.parametrize("written_ahead", [False, True])
def test_the_view_prepares_the_request_while_the_reserve_is_in_flight(
        monkeypatch: Any, written_ahead: bool) -> None:
    """views._admit_and_forward: the preparation runs while admit waits for Redis, and the Call
    it forwards carries it. With the reserve written ahead by the view (runtime.send_reserve),
    its reply may be there before the task's first step, and the admission then goes on without
    the loop turning: the preparation is made at once, before admit."""
    seen: dict[str, Any] = {}
    written = object() if written_ahead else None

    async def admit(runtime: Any, ctx: Any, checked: Any, request_id: str, obs: Any,
                    request: Any = None, sent: Any = None) -> Admission:
        assert sent is written
        if sent is None:
            await asyncio.sleep(0)  # the reserve's round trip: the loop turns
        # else: the reply is there already, nothing turns the loop
        seen["while_reserving"] = seen["prepared_by"]()
        return _admission("gpt-4o", 100)

    async def forward(call: Call) -> HttpResponse:
        seen["call"] = call
        return HttpResponse(b"{}")

    real_prepare = views.prepare_upstream

    def prepare(*args: Any, **kwargs: Any) -> Prepared:
        prepared = real_prepare(*args, **kwargs)
        seen["prepared_by"] = lambda: prepared.upstream
        return prepared

    monkeypatch.setattr(views, "admit", admit)
    monkeypatch.setattr(views, "forward", forward)
    monkeypatch.setattr(views, "prepare_upstream", prepare)

    async def scenario() -> None:
        checked = SimpleNamespace(parsed=_parsed(), estimate=SimpleNamespace(output_cap=100))
        await views._admit_and_forward(_runtime(), CTX, checked, REQUEST_ID,  # type: ignore[arg-type]
                                       0.0, {}, None, Observation("chat/completions"),
                                       sent=written)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert seen["while_reserving"] is FIRST
    call = seen["call"]
    assert call.prepared is not None and call.prepared.upstream is FIRST
    assert call.payload() is call.prepared.payload


# A key's context as the rate headers read it: a tenant queueing over its quota, one bucket.
QUEUE_CTX = SimpleNamespace(tenant_id=5, limits=SimpleNamespace(over_quota_policy="queue"),
                            rates=(SimpleNamespace(capacity=10, period_ms=1000),))


def test_the_settle_and_the_rate_headers_are_made_while_the_upstream_answers() -> None:
    """forward._answer schedules Call.prepare_ahead as the request goes upstream: it runs while
    the answer is awaited (the loop turns), not before the request is written. It packs the
    settle, which the call's settle then carries (tests/gateway/test_call_end.py: what the
    settle sends), and makes the rate headers the answer is sent with."""
    seen: dict[str, Any] = {}
    hold = Hold("t1", REQUEST_ID, 120, ("tg:{t1}:q:tenant:d2026-12-03",))
    packed = object()

    class Transport:
        async def handle_async_request(self, request: Any) -> httpx.Response:
            seen["when_written"] = (call._packed_settle, call.headers)
            await asyncio.sleep(0)  # the upstream's wait: the loop turns
            seen["while_answering"] = (call._packed_settle, call.headers)
            return httpx.Response(200, content=b"{}")

    def packed_settle(of: Hold) -> object:
        seen["for"] = of
        return packed

    runtime = _runtime()
    client = SimpleNamespace(register_script=lambda text: None)  # the breakers make no call
    runtime.engine = SimpleNamespace(packed_settle=packed_settle, client=client)  # type: ignore[assignment]
    runtime.transport = Transport()  # type: ignore[assignment]
    reservation = Reservation(admitted=True, request_id=REQUEST_ID, granted=120, counters=(),
                              refused=None, server_time_ms=0, hold=hold, rate_remaining=(7,))
    admission = Admission(reservation, "gpt-4o", _admission("gpt-4o", 100).estimate, 100)
    call: Call

    async def scenario() -> None:
        nonlocal call
        call = Call(runtime, QUEUE_CTX, _parsed(), admission, REQUEST_ID, 0.0)  # type: ignore[arg-type]
        response = await _answer(call)
        assert response.status_code == 200

    asyncio.run(scenario())
    headers = {"x-tollgate-queue-wait-ms": "0", "x-ratelimit-limit-requests": "10",
               "x-ratelimit-remaining-requests": "7", "x-ratelimit-reset-requests": "300ms"}
    assert seen == {"when_written": (None, None), "while_answering": (packed, headers),
                    "for": hold}
