"""gateway/stored_responses.py piece by piece: the router's prefix routes, the path and method
rules answered before any key is checked, the conversation body checks and its context count, the
choice of key for a conversation, and one unmetered request to the mock upstream (served for real
by uvicorn) with its answers and failures mapped as the /v1 forwarder maps them. The whole flow
(ownership, forgetting, holds) is tested end to end in test_e2e_stored_responses.py."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.test import Client

from gateway import stored_responses
from gateway.asgi import GatewayRouter
from gateway.errors import GatewayError
from gateway.mock_upstream import MockUpstream, free_port, start_subprocess
from gateway.providers import ProviderPool, Upstream
from gateway.other_endpoints import UpstreamAnswer
from gateway.stored_responses import conversation_keys, conversation_tokens
from quotas.answers import AnswerKind


async def _exact(request: Any) -> str:
    return "exact"


async def _prefixed(request: Any, rest: str) -> str:
    return f"prefixed:{rest}"


def test_the_router_prefers_an_exact_path_and_passes_the_rest_of_a_prefixed_one() -> None:
    router = GatewayRouter(None, {"/v1/responses": _exact},  # type: ignore[arg-type]
                           {"/v1/responses/": _prefixed})
    exact = router._view("/v1/responses")
    prefixed = router._view("/v1/responses/resp_1/input_items")
    assert exact is _exact
    assert prefixed is not None
    assert asyncio.run(prefixed(None)) == "prefixed:resp_1/input_items"
    assert router._view("/v1/responsesX") is None
    assert router._view("/v1/other") is None


def test_every_stored_object_path_is_routed() -> None:
    from gateway.urls import direct_routes, prefix_routes

    assert direct_routes()["/v1/conversations"] is stored_responses.conversations
    prefixes = list(prefix_routes().items())
    ours = [("/v1/responses/", stored_responses.response_item),
            ("/v1/conversations/", stored_responses.conversation_item)]
    assert prefixes[:2] == ours  # before any catch-all of /v1/ (the first match serves)


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("put", "/v1/responses/resp_1", "DELETE, GET"),
    ("post", "/v1/responses/resp_1", "DELETE, GET"),
    ("get", "/v1/responses/resp_1/cancel", "POST"),
    ("delete", "/v1/responses/resp_1/input_items", "GET"),
    ("get", "/v1/conversations", "POST"),
    ("put", "/v1/conversations/conv_1", "GET, POST, DELETE"),
])
def test_a_wrong_method_is_a_json_405_before_any_key_is_checked(method: str, path: str,
                                                                allow: str) -> None:
    response = getattr(Client(), method)(path)
    assert response.status_code == 405
    assert response["Allow"] == allow
    assert response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", ["/v1/responses/resp_1/other", "/v1/responses/resp_1/cancel/x",
                                  "/v1/conversations/conv_1/other"])
def test_an_unknown_sub_resource_is_a_json_404(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_conversation_items_are_refused_as_unsupported() -> None:
    for path in ("/v1/conversations/conv_1/items", "/v1/conversations/conv_1/items/msg_1"):
        response = Client().get(path)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "unsupported_endpoint"
        assert "'input'" in error["message"]


def test_not_found_names_the_object_in_openais_shape() -> None:
    error = stored_responses.not_found(AnswerKind.RESPONSE, "resp_x")
    assert (error.status, error.code, error.type) == (404, "response_not_found",
                                                       "invalid_request_error")
    assert stored_responses.not_found(AnswerKind.CONVERSATION, "c").code == "conversation_not_found"


@pytest.mark.parametrize(("raw", "valid"), [
    ("resp_0123abc", True), ("conv-9_x", True), ("a" * 128, True), ("a" * 129, False),
    ("", False), ("resp_1 2", False), ("resp_1:x", False), ("résumé", False),
])
def test_ids_outside_the_alphabet_are_never_looked_up(raw: str, valid: bool) -> None:
    assert (stored_responses._valid_id(raw) is not None) is valid


@pytest.mark.parametrize(("body", "param"), [
    (b"[]", None), (b'{"items": "x"}', "items"), (b'{"items": [1]}', "items"),
    (b'{"metadata": [1]}', "metadata"), (b"{nope", None),
])
def test_a_bad_conversation_body_is_a_400(body: bytes, param: str | None) -> None:
    with pytest.raises(GatewayError) as refused:
        stored_responses._parse_conversation(body)
    assert (refused.value.status, refused.value.param) == (400, param)


@pytest.mark.parametrize(("body", "param"), [
    (b'{"items": [{"type": "item_reference", "id": "msg_1"}]}', "items[0]"),
    (b'{"items": [{"role": "user", "content": "hi"}, {"type": "message", "role": "user", '
     b'"content": [{"type": "input_file", "file_id": "file-1"}]}]}', "items[1].content[0].file_id"),
])
def test_a_conversation_cannot_start_with_objects_stored_at_the_provider(body: bytes,
                                                                         param: str) -> None:
    with pytest.raises(GatewayError) as refused:
        stored_responses._parse_conversation(body)
    assert (refused.value.status, refused.value.param, refused.value.code) == (
        400, param, "unsupported_parameter")


def test_a_conversation_body_may_be_empty_or_carry_items() -> None:
    assert stored_responses._parse_conversation(b"") == []
    assert stored_responses._parse_conversation(b"{}") == []
    items = [{"type": "message", "role": "user", "content": "hi"}]
    assert stored_responses._parse_conversation(
        b'{"items": [{"type": "message", "role": "user", "content": "hi"}], '
        b'"metadata": {"a": "b"}}') == items


def test_an_update_changes_metadata_only() -> None:
    stored_responses._metadata_only(b'{"metadata": {"k": "v"}}')
    with pytest.raises(GatewayError) as refused:
        stored_responses._metadata_only(b'{"metadata": {}, "items": []}')
    assert (refused.value.param, refused.value.code) == ("items", "unknown_parameter")


def test_a_conversations_context_counts_its_items() -> None:
    assert conversation_tokens([]) == 0
    one = [{"type": "message", "role": "user", "content": "plan a trip to Rome in May"}]
    two = one + [{"type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": "Rome in May is lovely " * 20}]}]
    assert conversation_tokens(one) >= 7  # at least its words
    assert conversation_tokens(two) > conversation_tokens(one) + 80


def _upstream(ident: int, *, models: frozenset[str] = frozenset(), tenant: int | None = None,
              kind: str = "openai", priority: int = 0, base_url: str = "http://127.0.0.1:9",
              secret: str = "sk-test") -> Upstream:
    return Upstream(ident, f"pk_{ident}", base_url, secret, None, None, priority, models,
                    tenant, kind)


def test_a_conversation_goes_to_an_openai_key_of_the_tenant_serving_every_model_first() -> None:
    pool = ProviderPool([
        _upstream(1, models=frozenset({"gpt-4o"}), priority=9),
        _upstream(2),
        _upstream(3, kind="anthropic"),
        _upstream(4, tenant=99),  # another tenant's
        _upstream(5, tenant=7, models=frozenset({"gpt-4o"})),  # this tenant's, a model list
    ])
    runtime = SimpleNamespace(pool=pool)
    ctx = SimpleNamespace(tenant_id=7)
    assert [u.id for u in conversation_keys(runtime, ctx)] == [2, 5, 1]  # type: ignore[arg-type]


# -- one request to the upstream ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    server = start_subprocess()
    yield server
    server.stop()


def _runtime(**upstream_headers: str) -> Any:
    return SimpleNamespace(transport=httpx.AsyncHTTPTransport(), upstream_headers=upstream_headers,
                           upstream_timeout={"connect": 2.0, "read": 10.0, "write": 10.0,
                                             "pool": 2.0})


def _send(runtime: Any, upstreams: list[Upstream], method: str, path: str, query: str = "",
          body: bytes | None = None) -> UpstreamAnswer:
    return asyncio.run(stored_responses._send(runtime, upstreams, method, path, query, body,
                                              "req_test"))


def _stored_response(mock: MockUpstream, secret: str) -> str:
    created = httpx.post(f"{mock.base_url}/responses",
                         headers={"Authorization": f"Bearer {secret}"},
                         json={"model": "gpt-4o", "input": "one two three"}, timeout=10)
    assert created.status_code == 200
    return str(created.json()["id"])


def test_a_request_reaches_the_key_with_its_secret_path_and_query(mock: MockUpstream) -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    response_id = _stored_response(mock, secret)
    upstream = _upstream(1, base_url=mock.base_url, secret=secret)
    answer = _send(_runtime(), [upstream], "GET", f"responses/{response_id}")
    assert (answer.status, answer.upstream) == (200, upstream)
    assert answer.content_type.startswith("application/json")
    assert f'"{response_id}"' in answer.body.decode()
    page = _send(_runtime(), [upstream], "GET", f"responses/{response_id}/input_items",
                 "order=asc&limit=1")
    assert b'"one two three"' in page.body
    # Another secret (another provider key) does not see it: the upstream's 404, in our words.
    with pytest.raises(GatewayError) as relayed:
        _send(_runtime(), [_upstream(2, base_url=mock.base_url, secret="sk-other")], "GET",
              f"responses/{response_id}")
    assert (relayed.value.status, relayed.value.type) == (404, "invalid_request_error")
    assert response_id not in relayed.value.message  # never the upstream's message


@pytest.mark.parametrize(("status", "answered"), [
    ("429", 429), ("401", 502), ("403", 502), ("500", 502), ("503", 502),
])
def test_upstream_failures_map_as_the_forwarder_maps_them(mock: MockUpstream, status: str,
                                                          answered: int) -> None:
    upstream = _upstream(1, base_url=mock.base_url)
    with pytest.raises(GatewayError) as failed:
        _send(_runtime(**{"X-Mock-Status": status}), [upstream], "GET", "responses/resp_any")
    assert failed.value.status == answered
    assert "Mock" not in failed.value.message


def test_a_conversation_create_passes_over_a_key_that_cannot_take_it(mock: MockUpstream) -> None:
    closed = _upstream(1, base_url=f"http://127.0.0.1:{free_port()}/v1")
    working = _upstream(2, base_url=mock.base_url, secret=f"sk-{uuid.uuid4().hex}")
    answer = _send(_runtime(), [closed, working], "POST", "conversations", body=b"{}")
    assert answer.upstream == working
    assert answer.body.startswith(b'{"id":"conv_')


def test_an_unreachable_key_is_a_502_and_a_slow_one_a_504(mock: MockUpstream,
                                                          settings: Any) -> None:
    closed = _upstream(1, base_url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(GatewayError) as unreachable:
        _send(_runtime(), [closed], "GET", "responses/resp_any")
    assert unreachable.value.status == 502
    settings.GATEWAY_CALL_DEADLINE_SECONDS = 0.3
    slow = _runtime(**{"X-Mock-First-Byte-Ms": "2000"})
    with pytest.raises(GatewayError) as late:
        _send(slow, [_upstream(1, base_url=mock.base_url)], "GET", "responses/resp_any")
    assert late.value.status == 504
