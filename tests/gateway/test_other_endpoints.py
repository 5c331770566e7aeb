"""The rest of /v1 (gateway/other_endpoints.py) in-process: the path rules (JSON 404s in the
caller's API shape, unsupported endpoints, 405s) through Django's URL resolution, the model list
and lookup rules over a real catalog and provider pool, Anthropic's pagination, and
send_unmetered against the mock upstream (its failover, refusals and deadline)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.test import Client

from config.embedded import free_port
from gateway.catalog import Catalog, ModelInfo
from gateway.errors import GatewayError
from gateway.mock_upstream import MockUpstream, start_in_thread
from gateway.mock_upstream.app import api_key_id
from gateway import other_endpoints
from gateway.other_endpoints import (
    UNSUPPORTED_ENDPOINTS,
    anthropic_page,
    listed_models,
    model_found,
    send_unmetered,
    unsupported_endpoint,
    upstream_request,
)
from gateway.providers import KEY_BREAKER, ProviderPool, Upstream
from gateway.upstream_http import make_transport

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def _json_404(response: Any) -> dict[str, Any]:
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response["x-request-id"].startswith("req_")
    return response.json()


# -- path rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["get", "post", "delete", "put", "patch"])
@pytest.mark.parametrize("path", ["/v1/foo", "/v1", "/v1/", "/v1/chat/completions/extra",
                                  "/v1/models/", "/v1/filesystem", "/v1/audiobooks"])
def test_an_unknown_v1_path_is_openais_json_404(method: str, path: str) -> None:
    error = _json_404(getattr(Client(), method)(path))["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "unknown_url", None)
    assert error["message"].startswith(f"Unknown request URL: {method.upper()} {path}. ")


@pytest.mark.parametrize("headers,path", [
    (ANTHROPIC, "/v1/foo"),
    ({"x-api-key": "tgk_anything"}, "/v1/foo"),
    ({}, "/v1/messages/foo"),
    ({}, "/v1/messages/count_tokens/x"),
])
def test_an_anthropic_clients_unknown_path_is_anthropics_404(headers: dict[str, str],
                                                             path: str) -> None:
    response = Client().get(path, headers=headers)
    body = _json_404(response)
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["request_id"] == response["request-id"] == response["x-request-id"]


def test_a_long_path_is_cut_in_the_message() -> None:
    message = _json_404(Client().get("/v1/" + "a" * 10_000))["error"]["message"]
    assert len(message) < 1000 and "..." in message


@pytest.mark.parametrize("path", [
    "/v1/audio/speech", "/v1/audio/transcriptions", "/v1/images/generations", "/v1/images/edits",
    "/v1/files", "/v1/files/file-1/content", "/v1/uploads", "/v1/uploads/u1/parts",
    "/v1/batches", "/v1/batches/b1/cancel", "/v1/fine_tuning/jobs", "/v1/vector_stores",
    "/v1/vector_stores/vs_1/files", "/v1/assistants", "/v1/threads/t1/runs",
    "/v1/realtime/sessions", "/v1/realtime",
])
def test_an_unsupported_endpoint_is_refused_before_auth(path: str) -> None:
    # No key at all: the endpoint, not the key, is the reason.
    error = _json_404(Client().post(path, {}, content_type="application/json"))["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_endpoint")
    prefix = unsupported_endpoint(path)
    assert prefix in UNSUPPORTED_ENDPOINTS
    assert f"does not serve {prefix} yet" in error["message"]


def test_anthropics_message_batches_are_unsupported_in_its_shape() -> None:
    body = _json_404(Client().post("/v1/messages/batches", {}, content_type="application/json",
                                   headers=ANTHROPIC))
    assert body["error"]["type"] == "not_found_error"
    assert "does not serve /v1/messages/batches yet" in body["error"]["message"]


def test_unsupported_prefixes_match_whole_segments() -> None:
    assert unsupported_endpoint("/v1/files") == "/v1/files"
    assert unsupported_endpoint("/v1/files/x") == "/v1/files"
    assert unsupported_endpoint("/v1/filesx") is None
    assert unsupported_endpoint("/v1/messages") is None
    assert unsupported_endpoint("/v1/messages/batches/b1/results") == "/v1/messages/batches"


@pytest.mark.parametrize("method", ["post", "get"])
@pytest.mark.parametrize("path", ["/v1/responses/compact", "/v1/responses/input_tokens",
                                  "/v1/responses/input_tokens/x"])
def test_the_responses_endpoints_not_served_are_unsupported_not_a_405(method: str,
                                                                       path: str) -> None:
    # Under /v1/responses/ (a stored response's routes), yet not response ids: refused as
    # endpoints this gateway does not serve, before any key is checked.
    response = getattr(Client(), method)(path, {}, content_type="application/json")
    error = _json_404(response)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_endpoint")
    assert f"does not serve {path.rsplit('/x', 1)[0]} yet" in error["message"]


@pytest.mark.parametrize("method", ["post", "get"])
@pytest.mark.parametrize("path", [f"/{route}" for route in other_endpoints.BASE_URL_MISTAKES])
def test_an_endpoint_without_v1_says_which_base_url_to_set(method: str, path: str) -> None:
    response = getattr(Client(), method)(path, {}, content_type="application/json")
    body = _json_404(response)
    anthropic = path.startswith("/messages")
    message = body["error"]["message"]
    if anthropic:
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        assert body["request_id"] == response["request-id"]
    else:
        assert (body["error"]["type"], body["error"]["code"]) == (
            "invalid_request_error", "unknown_url")
    assert f"did you mean /v1{path}?" in message
    assert ("Set the SDK's base URL to http://testserver/v1 (the anthropic SDK: "
            "http://testserver)." in message)


def test_a_doubled_v1_says_which_base_url_to_set() -> None:
    body = _json_404(Client().post("/v1/v1/messages", {}, content_type="application/json",
                                   headers=ANTHROPIC))
    assert body["error"]["type"] == "not_found_error"
    assert ("did you mean /v1/messages? Set the SDK's base URL to http://testserver for the "
            "anthropic SDK" in body["error"]["message"])
    error = _json_404(Client().get("/v1/v1/models"))["error"]
    assert error["code"] == "unknown_url" and "did you mean /v1/models?" in error["message"]


def test_an_anthropic_client_without_v1_gets_anthropics_shape_anywhere() -> None:
    body = _json_404(Client().get("/models", headers=ANTHROPIC))
    assert body["error"]["type"] == "not_found_error"
    assert "did you mean /v1/models?" in body["error"]["message"]


def test_an_odd_host_header_is_not_echoed() -> None:
    request = SimpleNamespace(META={"HTTP_HOST": "evil.test/<script>"})
    assert other_endpoints._base(request) == "http://<host>"
    for host in ("gw.example.com", "localhost:8000", "[::1]:8000", "10.0.0.5"):
        request = SimpleNamespace(META={"HTTP_HOST": host})
        assert other_endpoints._base(request) == f"http://{host}"


def test_the_router_serves_the_paths_without_v1_itself() -> None:
    from gateway.urls import direct_routes

    routes = direct_routes()
    for route in other_endpoints.BASE_URL_MISTAKES:
        assert routes[f"/{route}"] is other_endpoints.missing_v1
    assert routes["/v1/chat/completions"] is not other_endpoints.missing_v1


@pytest.mark.parametrize(("body", "param"), [
    ({"container": "container_1"}, "container"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "file", "file_id": "file_1"}}]}]},
     "messages[0].content[0].source"),
])
def test_count_tokens_refuses_files_and_containers_stored_at_the_provider(
        body: dict[str, Any], param: str) -> None:
    full = {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(GatewayError) as refused:
        other_endpoints._check_count_body(full)
    assert (refused.value.status, refused.value.param, refused.value.code) == (
        400, param, "unsupported_parameter")
    # By URL, inline, a 1-hour cache or a server tool: counting them is free, so accepted.
    accepted = {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"},
         "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    assert other_endpoints._check_count_body(accepted) == "claude-haiku-4-5"


@pytest.mark.parametrize("path,allowed,headers,anthropic", [
    ("/v1/moderations", "POST", {}, False),
    ("/v1/messages/count_tokens", "POST", {}, True),
    ("/v1/models", "GET, HEAD", {}, False),
    ("/v1/models", "GET, HEAD", ANTHROPIC, True),
    ("/v1/models/gpt-4o", "GET, HEAD", {}, False),
    ("/v1/models/claude-haiku-4-5", "GET, HEAD", ANTHROPIC, True),
])
def test_a_wrong_method_on_a_known_path_is_a_json_405(path: str, allowed: str,
                                                      headers: dict[str, str],
                                                      anthropic: bool) -> None:
    method = "get" if allowed == "POST" else "delete"
    response = getattr(Client(), method)(path, headers=headers)
    assert (response.status_code, response["Allow"]) == (405, allowed)
    body = response.json()
    if anthropic:
        assert body["error"]["type"] == "invalid_request_error" and body["type"] == "error"
    else:
        assert body["error"]["code"] == "method_not_allowed"


# -- the model rules -------------------------------------------------------------------------------


def _info(name: str) -> ModelInfo:
    return ModelInfo(name, "heuristic", "chat", 200_000, 4_096, 64_000)


def _upstream(ident: int, kind: str, models: tuple[str, ...] = (),
              tenant_id: int | None = None, base_url: str = "http://127.0.0.1:1/v1",
              secret: str = "sk-x") -> Upstream:
    return Upstream(ident, f"pk_{ident}", base_url, secret, None, None,
                    models=frozenset(models), tenant_id=tenant_id, kind=kind)


def _runtime(pool: ProviderPool, transport: Any = None) -> Any:
    catalog = Catalog.of(_info(name) for name in ("claude-haiku-4-5", "claude-sonnet-4-5",
                                                  "gpt-4o", "gpt-4o-mini"))
    return SimpleNamespace(catalog=catalog, pool=pool, transport=transport,
                           upstream_headers={}, upstream_timeout={
                               "connect": 2.0, "read": 5.0, "write": 5.0, "pool": 2.0})


def _ctx(tenant_id: int = 1, allowed: frozenset[str] | None = None) -> Any:
    return SimpleNamespace(tenant_id=tenant_id,
                           allows=lambda model: allowed is None or model in allowed)


def test_each_api_lists_the_models_its_kind_of_key_serves() -> None:
    pool = ProviderPool([_upstream(1, "openai", ("gpt-4o", "gpt-4o-mini")),
                         _upstream(2, "anthropic", ("claude-haiku-4-5",)),
                         _upstream(3, "anthropic", ("claude-sonnet-4-5",), tenant_id=2)])
    runtime = _runtime(pool)
    assert listed_models(runtime, _ctx(), "openai") == ["gpt-4o", "gpt-4o-mini"]
    assert listed_models(runtime, _ctx(), "anthropic") == ["claude-haiku-4-5"]
    # Tenant 2's dedicated key adds its model for tenant 2 only.
    assert listed_models(runtime, _ctx(2), "anthropic") == ["claude-haiku-4-5",
                                                            "claude-sonnet-4-5"]
    limited = _ctx(allowed=frozenset({"gpt-4o-mini"}))
    assert listed_models(runtime, limited, "openai") == ["gpt-4o-mini"]
    assert model_found(runtime, _ctx(), "gpt-4o", "openai")
    assert not model_found(runtime, _ctx(), "gpt-4o", "anthropic")
    assert not model_found(runtime, limited, "gpt-4o", "openai")
    assert not model_found(runtime, _ctx(), "claude-sonnet-4-5", "anthropic")
    assert not model_found(runtime, _ctx(), "not in the catalog", "openai")
    assert not model_found(runtime, _ctx(), "gpt-5-unknown", "openai")


def test_anthropic_pages_walk_the_list_by_cursor() -> None:
    runtime = _runtime(ProviderPool([]))
    names = [f"m{i:02d}" for i in range(7)]
    first = anthropic_page(runtime, names, {"limit": "3"})
    assert [m["id"] for m in first["data"]] == ["m00", "m01", "m02"]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, "m00", "m02")
    assert first["data"][0]["type"] == "model" and first["data"][0]["created_at"].endswith("Z")
    second = anthropic_page(runtime, names, {"limit": "3", "after_id": "m02"})
    last = anthropic_page(runtime, names, {"limit": "3", "after_id": "m05"})
    assert [m["id"] for m in second["data"]] == ["m03", "m04", "m05"]
    assert ([m["id"] for m in last["data"]], last["has_more"]) == (["m06"], False)
    back = anthropic_page(runtime, names, {"limit": "2", "before_id": "m03"})
    assert ([m["id"] for m in back["data"]], back["has_more"]) == (["m01", "m02"], True)
    assert anthropic_page(runtime, names, {})["has_more"] is False  # 20 by default
    empty = anthropic_page(runtime, [], {})
    assert (empty["data"], empty["first_id"], empty["last_id"]) == ([], None, None)
    for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"},
                  {"after_id": "a", "before_id": "b"}):
        with pytest.raises(GatewayError) as info:
            anthropic_page(runtime, names, query)
        assert info.value.status == 400


def test_candidates_without_a_model_are_every_key_of_the_kind() -> None:
    pool = ProviderPool([_upstream(1, "openai", ("gpt-4o",)), _upstream(2, "openai"),
                         _upstream(3, "anthropic"), _upstream(4, "openai", tenant_id=9)])
    now = time.time()
    assert {u.id for u in pool.candidates(None, 1, now)} == {1, 2}
    assert {u.id for u in pool.candidates(None, 9, now)} == {1, 2, 4}
    assert [u.id for u in pool.candidates(None, 1, now, kind="anthropic")] == [3]
    pool.cool_down(2, now + 60)
    pool.open_breaker(1, "gpt-4o", now + 60)  # a model's breaker: no model, no effect
    assert [u.id for u in pool.candidates(None, 1, now)] == [1]
    pool.open_breaker(1, KEY_BREAKER, now + 60)  # the key's own breaker applies
    assert pool.candidates(None, 1, now) == []


# -- send_unmetered against the mock upstream ------------------------------------------------------


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    with start_in_thread() as upstream:
        yield upstream


@pytest.fixture
def faults(mock: MockUpstream) -> Iterator[Any]:
    keys: set[str] = set()

    def set_faults(key: str, **values: Any) -> None:
        keys.add(key)
        httpx.post(f"{mock.url}/mock/faults",
                   json={"key": key, "faults": values}).raise_for_status()

    yield set_faults
    for key in keys:
        set_faults(key)


def _requests(mock: MockUpstream, key: str) -> int:
    report = httpx.get(f"{mock.url}/mock/faults").json()
    return int(report["requests"].get(api_key_id(key), 0))


def _moderate(upstreams: list[Upstream]) -> Any:
    async def run() -> Any:
        runtime = _runtime(ProviderPool(upstreams), make_transport("native", max_connections=4))
        return await send_unmetered(runtime, upstreams, lambda upstream: upstream_request(
            runtime, upstream, "POST", "moderations",
            {"Authorization": f"Bearer {upstream.secret}"}, "req_test",
            b'{"input": ["one", "two"]}'))

    return asyncio.run(run())


def test_send_unmetered_passes_a_failing_key_to_the_next(mock: MockUpstream,
                                                         faults: Any) -> None:
    dead = _upstream(1, "openai", base_url=f"http://127.0.0.1:{free_port()}/v1")
    failing = _upstream(2, "openai", base_url=mock.base_url, secret="sk-unmetered-failing")
    refused = _upstream(3, "openai", base_url=mock.base_url, secret="sk-unmetered-refused")
    good = _upstream(4, "openai", base_url=mock.base_url, secret="sk-unmetered-good")
    faults(failing.secret, status=503)
    faults(refused.secret, status=401)
    answer = _moderate([dead, failing, refused, good])
    assert (answer.upstream.id, answer.status) == (4, 200)
    assert len(httpx.Response(200, content=answer.body).json()["results"]) == 2


def test_send_unmetered_client_errors_stop_at_once(mock: MockUpstream, faults: Any) -> None:
    bad = _upstream(1, "openai", base_url=mock.base_url, secret="sk-unmetered-400")
    good = _upstream(2, "openai", base_url=mock.base_url, secret="sk-unmetered-after-400")
    faults(bad.secret, status=400, leaky=True)
    before = _requests(mock, good.secret)
    with pytest.raises(GatewayError) as info:
        _moderate([bad, good])
    assert info.value.status == 400
    assert "organization" not in info.value.message.lower()  # never the provider's words
    assert _requests(mock, good.secret) == before


def test_send_unmetered_when_no_key_answers(mock: MockUpstream, faults: Any) -> None:
    limited = _upstream(1, "openai", base_url=mock.base_url, secret="sk-unmetered-429")
    failing = _upstream(2, "openai", base_url=mock.base_url, secret="sk-unmetered-500")
    faults(limited.secret, status=429, retry_after=9)
    faults(failing.secret, status=500)
    with pytest.raises(GatewayError) as info:
        _moderate([failing, limited])
    assert (info.value.status, info.value.retry_after_s) == (429, 9)
    with pytest.raises(GatewayError) as failed:
        _moderate([failing])
    assert failed.value.status == 502
    with pytest.raises(GatewayError) as none:
        _moderate([])
    assert none.value.status == 502


def test_send_unmetered_is_bounded_by_the_call_deadline(mock: MockUpstream, faults: Any,
                                                        settings: Any) -> None:
    settings.GATEWAY_CALL_DEADLINE_SECONDS = 0.5
    hanging = _upstream(1, "openai", base_url=mock.base_url, secret="sk-unmetered-hang")
    faults(hanging.secret, hang=True)
    started = time.monotonic()
    with pytest.raises(GatewayError) as info:
        _moderate([hanging])
    assert info.value.status == 504
    assert time.monotonic() - started < 3


# -- which key a moderation goes to ----------------------------------------------------------------


def _moderation(upstreams: list[Upstream], body: bytes, cooling: int | None = None) -> Any:
    async def run() -> Any:
        pool = ProviderPool(upstreams)
        if cooling is not None:
            pool.cool_down(cooling, time.time() + 60)
        runtime = _runtime(pool, make_transport("native", max_connections=4))
        request = SimpleNamespace(headers={})
        return await other_endpoints._moderate(runtime, _ctx(), request, body, "req_test")

    return asyncio.run(run())


def test_a_moderation_without_a_model_goes_to_the_key_serving_the_default(
        mock: MockUpstream) -> None:
    chat_only = _upstream(1, "openai", ("gpt-4o",), base_url=mock.base_url, secret="sk-m-chat")
    moderating = _upstream(2, "openai", ("omni-moderation-latest",), base_url=mock.base_url,
                           secret="sk-m-moderation")
    before = _requests(mock, moderating.secret)
    answer = _moderation([chat_only, moderating], b'{"input": "hello", "model": null}')
    assert answer.status_code == 200
    assert httpx.Response(200, content=answer.content).json()["model"] == "omni-moderation-latest"
    assert _requests(mock, moderating.secret) == before + 1


def test_a_moderation_without_a_model_takes_any_key_when_none_serves_the_default(
        mock: MockUpstream) -> None:
    chat_only = _upstream(1, "openai", ("gpt-4o",), base_url=mock.base_url, secret="sk-m-any")
    answer = _moderation([chat_only, _upstream(2, "anthropic", base_url=mock.base_url)],
                         b'{"input": ["a", "b"]}')
    assert len(httpx.Response(200, content=answer.content).json()["results"]) == 2
    with pytest.raises(GatewayError) as resting:
        _moderation([chat_only], b'{"input": "a"}', cooling=1)
    assert resting.value.status == 503
    with pytest.raises(GatewayError) as none:
        _moderation([_upstream(2, "anthropic", base_url=mock.base_url)], b'{"input": "a"}')
    assert none.value.status == 404


def test_a_moderation_naming_a_model_no_key_serves_is_404(mock: MockUpstream) -> None:
    chat_only = _upstream(1, "openai", ("gpt-4o",), base_url=mock.base_url, secret="sk-m-404")
    with pytest.raises(GatewayError) as info:
        _moderation([chat_only], b'{"input": "a", "model": "text-moderation-latest"}')
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    for body in (b'{"model": "x"}', b'"text"', b'{"input": "a", "model": 7}', b'{'):
        with pytest.raises(GatewayError) as bad:
            _moderation([chat_only], body)
        assert bad.value.status == 400, body
