"""Faults end to end: the gateway under uvicorn over real Redis and PostgreSQL, with the mock
upstream's fault injection (model-name suffixes), a client that leaves, a dead worker, a dead
quota store and bad bodies. After every fault the tenant's counters and usage stream must show
that the hold ended exactly once, with the right outcome and the exact amount.

The faults that reach the gateway through its upstream HTTP client (a client leaving mid-stream,
a cut stream, error statuses, silence before the first byte) run through each upstream transport
(GATEWAY_UPSTREAM_TRANSPORT): the end-to-end half of their contract with
tests/gateway/test_upstream_http.py."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from config import embedded
from config.embedded import free_port
from gateway.mock_upstream import MockUpstream, start_subprocess
from gateway.upstream_http import TRANSPORTS
from quotas.client import make_redis
from quotas.engine import QuotaEngine
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import billed, unique_model, usage_events
from tests.support.transports import (
    CUT_LOSES_LAST_EVENTS,
    known_difference,
    transport_gateway,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


# -- helpers -----------------------------------------------------------------------------------


def tenant_keys(engine: QuotaEngine, tag: str) -> list[str]:
    return list(engine.client.scan_iter(match=f"tg:{{t{tag}}}:*", count=1000))


def assert_released_once(engine: QuotaEngine, tag: str, reason: str, status: int) -> None:
    """Nothing charged, nothing pending, and exactly one `released` event with that reason."""
    counter = engine.counter(tag, "tenant")
    assert (counter.used, counter.pending) == (0, 0)
    assert engine.open_hold_ids(tag) == []
    events = usage_events(engine, tag)
    assert [(e["outcome"], e["event"].get("outcome"), e["event"].get("st")) for e in events] == [
        ("released", reason, status)]
    assert int(events[0]["held"]) > 0 and int(events[0]["actual"]) == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- gateways with their own settings (shared by the tests of this module) ---------------------


@pytest.fixture(scope="module")
def tight_gateway(provider_key: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """One worker, a 1 s upstream read timeout and a 2 KiB body limit."""
    server = start_gateway(tmp_path_factory.mktemp("tight-gateway"), workers=1,
                           GATEWAY_UPSTREAM_READ_TIMEOUT="1", GATEWAY_MAX_BODY_BYTES="2048")
    yield server
    server.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def upstream_gateway(request: pytest.FixtureRequest, provider_key: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A gateway on each upstream transport (tests/support/transports.py)."""
    yield from transport_gateway(request, tmp_path_factory.mktemp(f"{request.param}-gateway"))


@pytest.fixture(scope="module", params=TRANSPORTS)
def tight_upstream_gateway(request: pytest.FixtureRequest, provider_key: str,
                           tmp_path_factory: pytest.TempPathFactory
                           ) -> Iterator[GatewayServer]:
    """tight_gateway's 1 s upstream read timeout, on each upstream transport."""
    server = start_gateway(tmp_path_factory.mktemp(f"tight-{request.param}-gateway"),
                           workers=1, GATEWAY_UPSTREAM_READ_TIMEOUT="1",
                           GATEWAY_UPSTREAM_TRANSPORT=request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redisless_gateway(provider_key: str,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A gateway whose REDIS_URL points at a port where nothing listens."""
    server = start_gateway(tmp_path_factory.mktemp("redisless-gateway"), workers=1,
                           REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    yield server
    server.stop()


# -- 1. the client leaves mid-stream -------------------------------------------------------------


def test_client_disconnect_mid_stream_drains_the_upstream_and_settles_its_usage(
    upstream_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine,
) -> None:
    t = make_tenant()
    base = unique_model("fx-disconnect")
    body = {"model": f"{base}@chunk_ms=20@output_tokens=40", "stream": True,
            "messages": [{"role": "user", "content": "tell me a rather long story"}]}
    with httpx.Client(timeout=30) as http, http.stream(
        "POST", f"{upstream_gateway.base_url}/chat/completions", json=body,
        headers=auth(t.plaintext)
    ) as response:
        assert response.status_code == 200
        received = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                received.append(line)
                if len(received) == 3:
                    break
    # Leaving both blocks closed the connection with ~37 tokens still to come.
    assert len(received) == 3 and all("[DONE]" not in line for line in received)

    # The gateway keeps reading the upstream (bounded by GATEWAY_STREAM_DRAIN_SECONDS) for the
    # usage chunk, then settles.
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=15)
    [event] = usage_events(engine, t.tag)
    assert event["outcome"] == "settled"
    assert event["event"]["st"] == 499
    assert event["event"]["outcome"] == "client_disconnected"  # from the usage, not counted
    bill = billed(mock_upstream, base)
    # Drained to the end: the upstream produced (and billed) the whole answer.
    assert (bill["completion_tokens"], bill["requests"]) == (40, 1)
    counter = engine.counter(t.tag, "tenant")
    assert (counter.used, counter.pending) == (bill["total_tokens"], 0)
    assert (event["event"]["in"], event["event"]["out"]) == (bill["prompt_tokens"], 40)
    assert int(event["actual"]) == bill["total_tokens"] <= int(event["held"])


# -- 2. the upstream breaks the stream -----------------------------------------------------------


def test_upstream_cut_mid_stream_settles_the_counted_text(
    upstream_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
    engine: QuotaEngine, request: pytest.FixtureRequest,
) -> None:
    known_difference(request, "upstream_gateway", aiohttp=CUT_LOSES_LAST_EVENTS)
    t = make_tenant()
    base = unique_model("fx-cut")
    chunks = []
    try:
        client = client_for(upstream_gateway, t.plaintext, timeout=30)
        for chunk in client.chat.completions.create(
                model=f"{base}@cut=3", messages=[{"role": "user", "content": "stream please"}],
                stream=True):
            chunks.append(chunk)
    except (openai.APIError, httpx.HTTPError):
        pass  # ending the client's stream with an error is fine too
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "mock reply the"
    assert all(c.choices[0].finish_reason is None for c in chunks if c.choices)

    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [])
    bill = billed(mock_upstream, base)
    assert (bill["completion_tokens"], bill["requests"]) == (3, 1)
    counter = engine.counter(t.tag, "tenant")
    [event] = usage_events(engine, t.tag)
    assert event["outcome"] == "settled"
    assert (event["event"]["outcome"], event["event"]["st"]) == ("upstream_broken_counted", 502)
    # No usage chunk came: the prompt estimate plus the received text, counted by the tokenizer.
    assert event["event"]["out"] >= bill["completion_tokens"]
    assert counter.pending == 0
    assert counter.used == int(event["actual"]) == event["event"]["in"] + event["event"]["out"]
    assert 0 < counter.used <= int(event["held"])


def test_a_cut_stream_is_counted_even_when_the_client_asked_for_usage(
    upstream_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    request: pytest.FixtureRequest,
) -> None:
    known_difference(request, "upstream_gateway", aiohttp=CUT_LOSES_LAST_EVENTS)
    t = make_tenant()
    stream = client_for(upstream_gateway, t.plaintext).chat.completions.create(
        model="gpt-4o@cut=3", messages=[{"role": "user", "content": "count me"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)  # the gateway ends the client's stream where the upstream broke
    assert all(chunk.usage is None for chunk in chunks)  # no usage ever arrived
    [event] = usage_events(engine, t.tag)
    assert event["event"]["outcome"] == "upstream_broken_counted"
    assert event["event"]["out"] > 0  # the text the client received was counted
    assert engine.counter(t.tag, "tenant").pending == 0


# -- 3, 9. upstream error statuses before the body ----------------------------------------------


def test_upstream_500_is_502_and_releases_the_hold(
    upstream_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    with pytest.raises(openai.InternalServerError) as info:
        client_for(upstream_gateway, t.plaintext).chat.completions.create(
            model="gpt-4o@status=500", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 502
    assert info.value.code == "upstream_error"
    assert info.value.response.headers["x-request-id"].startswith("req_")
    assert_released_once(engine, t.tag, "upstream_status", 500)


def test_upstream_400_is_told_in_tollgate_words_and_releases_the_hold(
    upstream_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    with pytest.raises(openai.BadRequestError) as info:
        client_for(upstream_gateway, t.plaintext).chat.completions.create(
            model="gpt-4o@status=400", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400
    assert info.value.body["message"] == "The upstream provider rejected the request as invalid."
    assert info.value.type == "invalid_request_error"
    assert_released_once(engine, t.tag, "upstream_status", 400)


# -- 5. upstream timeout before the first byte ---------------------------------------------------


def test_upstream_timeout_before_the_first_byte_is_504_and_releases_the_hold(
    tight_upstream_gateway: GatewayServer, mock_upstream: MockUpstream,
    make_tenant: MakeTenant,
    engine: QuotaEngine,
) -> None:
    t = make_tenant()
    base = unique_model("fx-hang")
    with pytest.raises(openai.APIStatusError) as info:
        client_for(tight_upstream_gateway, t.plaintext, timeout=30).chat.completions.create(
            model=f"{base}@hang", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 504
    assert info.value.code == "upstream_error"
    assert_released_once(engine, t.tag, "upstream_timeout", 504)
    assert billed(mock_upstream, base)["requests"] == 0


# -- 4. upstream 429: the provider key cools down in every worker ------------------------------


@pytest.fixture
def isolated_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server of its own. A gateway on it shares no pub/sub with the session's gateways,
    so a cooldown it puts on the shared provider key (which serves every model, so it is tried
    after the dedicated one) cannot leak into other tests."""
    folder = Path(tmp_path_factory.mktemp("redis"))
    embedded.start_redis(folder, persistent=False)
    yield f"unix://{folder / 'redis.sock'}?db=0"
    embedded.stop_redis(folder)


def test_upstream_429_cools_the_key_in_every_worker_and_refuses_with_429_until_retry_after(
    isolated_redis: str, make_tenant: MakeTenant, django_db_blocker: Any,
    mock_upstream: MockUpstream, tmp_path: Path,
) -> None:
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    t = make_tenant(requests_per_second=-1)
    clean = unique_model("fx-cooldown")
    limited = f"{clean}@status=429@retry_after=2"
    secret = f"sk-dedicated-{uuid.uuid4().hex}"
    second = start_subprocess()
    server = None
    try:
        committed(django_db_blocker, lambda: create_provider_key(
            "cooldown", base_url=second.base_url, secret=secret, models=[limited, clean],
            tenant=Tenant.objects.get(pk=t.tenant_id)))
        # Started after the key exists, so its workers load it with their pool.
        server = start_gateway(tmp_path, workers=2, REDIS_URL=isolated_redis)
        engine = QuotaEngine(make_redis(isolated_redis))
        client = client_for(server, t.plaintext, timeout=30)
        messages = [{"role": "user", "content": "hi"}]

        with pytest.raises(openai.RateLimitError) as first:
            client.chat.completions.create(model=limited, messages=messages)
        cooled_at = time.monotonic()
        assert first.value.code == "rate_limit_exceeded"
        assert first.value.response.headers["retry-after"] == "2"
        assert "Every upstream provider key" in first.value.message

        # Within the Retry-After, whichever worker takes them, requests for a model that would
        # succeed are refused without reaching any upstream.
        refused: list[Any] = []
        for _ in range(4):
            try:
                client.chat.completions.create(model=clean, messages=messages)
                refused.append("ok")
            except openai.APIStatusError as exc:
                refused.append(exc)
        assert time.monotonic() - cooled_at < 2, "too slow to test the cooldown window"
        assert billed(second, clean, secret)["requests"] == 0
        assert billed(mock_upstream, clean)["requests"] == 0

        # Once the Retry-After has passed, the dedicated key is used again.
        time.sleep(max(0.0, cooled_at + 2.1 - time.monotonic()))
        completion = client.chat.completions.create(model=clean, messages=messages, max_tokens=3)
        bill = billed(second, clean, secret)
        assert bill["requests"] == 1 and bill["total_tokens"] == completion.usage.total_tokens

        counter = engine.counter(t.tag, "tenant")
        assert (counter.used, counter.pending) == (completion.usage.total_tokens, 0)
        assert engine.open_hold_ids(t.tag) == []
        events = usage_events(engine, t.tag)
        assert [e["outcome"] for e in events] == ["released"] * 5 + ["settled"]
        assert [e["event"]["outcome"] for e in events] == ["upstream_rate_limited"] * 5 + ["complete"]

        # Every key for the model is cooling down: that is a 429 with Retry-After, like the first.
        assert all(isinstance(r, openai.RateLimitError) for r in refused), refused
        for exc in refused:
            assert exc.code == "rate_limit_exceeded"
            assert 1 <= int(exc.response.headers["retry-after"]) <= 2
    finally:
        if server is not None:
            server.stop()
        second.stop()


# -- 6. the quota store is down -------------------------------------------------------------------


def test_redis_down_fails_closed_with_503_and_forwards_nothing(
    redisless_gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant
) -> None:
    t = make_tenant()
    base = unique_model("fx-noredis")
    with pytest.raises(openai.APIStatusError) as info:
        client_for(redisless_gateway, t.plaintext, timeout=30).chat.completions.create(
            model=base, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    assert info.value.code == "quota_store_unavailable"
    assert info.value.type == "server_error"
    assert billed(mock_upstream, base)["requests"] == 0

    ready = httpx.get(f"{redisless_gateway.url}/readyz", timeout=10)
    assert ready.status_code == 503
    assert ready.json()["status"] == "unavailable" and ready.json()["redis"] != "ok"
    assert ready.json()["database"] == "ok"
    assert httpx.get(f"{redisless_gateway.url}/healthz", timeout=10).status_code == 200


# -- 7. a worker dies with a hold open -------------------------------------------------------------


def test_worker_killed_mid_request_leaves_a_hold_the_sweep_releases(
    make_tenant: MakeTenant, engine: QuotaEngine, tmp_path: Path
) -> None:
    t = make_tenant()
    server = start_gateway(tmp_path, workers=2)
    try:
        outcome: list[BaseException | int] = []

        def call() -> None:
            try:
                outcome.append(httpx.post(
                    f"{server.base_url}/chat/completions", headers=auth(t.plaintext), timeout=30,
                    json={"model": "gpt-4o@first_byte_ms=15000",
                          "messages": [{"role": "user", "content": "hi"}]}).status_code)
            except httpx.HTTPError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        assert wait_until(lambda: engine.open_hold_ids(t.tag) != [])
        [request_id] = engine.open_hold_ids(t.tag)
        held = engine.counter(t.tag, "tenant").pending
        assert held > 0
        workers = server.worker_pids()
        assert workers
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        thread.join(timeout=15)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], httpx.HTTPError)

        # Nobody will end that hold now: it is still open until the sweep.
        assert engine.open_hold_ids(t.tag) == [request_id]
        assert usage_events(engine, t.tag) == []
        result = engine.sweep(t.tag, stale_s=0)
        assert [s.request_id for s in result.swept] == [request_id]
        counter = engine.counter(t.tag, "tenant")
        assert (counter.used, counter.pending) == (0, 0)
        assert engine.open_hold_ids(t.tag) == []
        events = usage_events(engine, t.tag)
        assert [(e["request_id"], e["outcome"], int(e["held"]), int(e["actual"]))
                for e in events] == [(request_id, "swept", held, 0)]
    finally:
        server.stop()


# -- 8. bad input: 400 in OpenAI's shape, before any reservation --------------------------------

HI = [{"role": "user", "content": "hi"}]

# (name, request arguments for client.post or for chat.completions.create, param, code)
BAD_BODIES = [
    ("malformed_json", {"content": b"{nope"}, None, None),
    ("empty_body", {"content": b""}, None, None),
    ("missing_messages", {"body": {"model": "gpt-4o"}}, "messages", None),
    ("messages_not_a_list", {"body": {"model": "gpt-4o", "messages": "hi"}}, "messages", None),
    ("message_without_role", {"create": {"messages": [{"content": "hi"}]}},
     "messages[0].role", None),
    ("max_tokens_not_an_integer", {"create": {"messages": HI, "max_tokens": "ten"}},
     "max_tokens", None),
    ("negative_max_tokens", {"create": {"messages": HI, "max_tokens": -5}}, "max_tokens", None),
    ("absurd_max_tokens", {"create": {"messages": HI, "max_tokens": 10**9}}, "max_tokens", None),
    ("n_zero", {"create": {"messages": HI, "n": 0}}, "n", None),
    ("stream_options_without_stream",
     {"create": {"messages": HI, "stream_options": {"include_usage": True}}},
     "stream_options", None),
    ("prompt_over_the_context_window",
     {"create": {"messages": [{"role": "user", "content": "hi " * 130_000}], "max_tokens": 5}},
     "messages", "context_length_exceeded"),
]


def _send_bad(client: openai.OpenAI, request: dict[str, Any]) -> None:
    if "create" in request:
        client.chat.completions.create(model="gpt-4o", **request["create"])
    else:
        client.post("/chat/completions", cast_to=httpx.Response,
                    options={"headers": {"Content-Type": "application/json"}},
                    **request)


def assert_untouched(engine: QuotaEngine, tag: str) -> None:
    assert engine.open_hold_ids(tag) == []
    counter = engine.counter(tag, "tenant")
    assert (counter.used, counter.pending) == (0, 0)
    assert usage_events(engine, tag) == []
    assert tenant_keys(engine, tag) == []  # not even a rate bucket was touched


@pytest.mark.parametrize(("request_args", "param", "code"),
                         [case[1:] for case in BAD_BODIES], ids=[case[0] for case in BAD_BODIES])
def test_bad_input_is_400_before_any_reservation(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    request_args: dict[str, Any], param: str | None, code: str | None,
) -> None:
    t = make_tenant(requests_per_second=-1)
    with pytest.raises(openai.BadRequestError) as info:
        _send_bad(client_for(gateway, t.plaintext, timeout=30), request_args)
    assert info.value.status_code == 400
    assert info.value.type == "invalid_request_error"
    assert info.value.param == param
    assert info.value.code == code
    assert info.value.message
    assert info.value.response.headers["x-request-id"].startswith("req_")
    assert_untouched(engine, t.tag)


def test_body_over_the_size_limit_is_400_before_any_reservation(
    tight_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant(requests_per_second=-1)
    client = client_for(tight_gateway, t.plaintext, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x" * 3000}], max_tokens=5)
    assert info.value.code == "request_too_large"
    assert info.value.type == "invalid_request_error"
    assert "2048" in info.value.message
    assert_untouched(engine, t.tag)
    # A body within the limit still goes through: the limit is the configured one.
    small = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert small.usage.completion_tokens == 2
    assert [e["outcome"] for e in usage_events(engine, t.tag)] == ["settled"]
    assert engine.counter(t.tag, "tenant").used == small.usage.total_tokens


def test_chunked_body_over_the_size_limit_is_400_in_openai_shape(
    tight_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    """Without a Content-Length (Transfer-Encoding: chunked) the size is known only once read."""
    t = make_tenant(requests_per_second=-1)
    body = json.dumps({"model": "gpt-4o", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "x" * 3000}]}).encode()
    response = httpx.post(f"{tight_gateway.base_url}/chat/completions", timeout=30,
                          headers={**auth(t.plaintext), "Content-Type": "application/json"},
                          content=iter([body[:1000], body[1000:]]))
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["x-request-id"].startswith("req_")
    assert_untouched(engine, t.tag)


def test_an_oversized_body_is_refused_before_authentication(gateway: GatewayServer) -> None:
    response = httpx.post(f"{gateway.base_url}/chat/completions", content=b"x" * (9 * 1024 * 1024),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400  # not 401: nothing was read or checked
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("model", ["gpt 4o", "gpt-4o\u00e9", "m" * 129])
def test_model_names_a_quota_key_cannot_carry_are_a_400(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine, model: str
) -> None:
    t = make_tenant()
    with pytest.raises(openai.BadRequestError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "model"
    assert engine.open_hold_ids(t.tag) == []
