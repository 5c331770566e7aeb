"""The rest of /v1 end to end, with the official openai and anthropic SDKs against the gateway
under uvicorn (4 workers), real Redis and PostgreSQL and the mock upstream: models by id and in
Anthropic's shape, moderations and count_tokens passed through unmetered, unknown paths and
unsupported endpoints as JSON 404s the SDKs raise as NotFoundError."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.mock_upstream import MockUpstream
from quotas.engine import QuotaEngine
from quotas.windows import WindowKind
from tests.gateway.conftest import (
    ANTHROPIC_MOCK_SECRET,
    GatewayServer,
    MakeTenant,
    TenantKey,
    client_for,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "count these five words"}]


def anthropic_for(server: GatewayServer, key: str, **options: Any) -> anthropic.Anthropic:
    # The SDK appends /v1/... itself: its base URL is the gateway's root.
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, **options)


def assert_unmetered(engine: QuotaEngine, t: TenantKey) -> None:
    """Nothing was held or charged: no reserve ever ran for the tenant."""
    counter = engine.counter(t.tag, "tenant", WindowKind.DAY)
    assert (counter.used, counter.pending) == (0, 0)
    assert engine.open_hold_ids(t.tag) == []


@pytest.fixture
def anthropic_key_faults(mock_upstream: MockUpstream) -> Iterator[Any]:
    """Set faults on the session's anthropic-kind provider key; healed after the test."""
    def set_faults(**faults: Any) -> None:
        httpx.post(f"{mock_upstream.url}/mock/faults",
                   json={"key": ANTHROPIC_MOCK_SECRET, "faults": faults}).raise_for_status()

    yield set_faults
    set_faults()


# -- models ---------------------------------------------------------------------------------------


def test_openai_models_retrieve(gateway: GatewayServer, make_tenant: MakeTenant) -> None:
    client = client_for(gateway, make_tenant().plaintext)
    model = client.models.retrieve("gpt-4o")
    assert (model.id, model.object, model.owned_by) == ("gpt-4o", "model", "tollgate")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model-anywhere")
    assert info.value.code == "model_not_found"
    limited = client_for(gateway, make_tenant(
        key_options={"allowed_models": ["gpt-4o-mini"]}).plaintext)
    assert limited.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError):
        limited.models.retrieve("gpt-4o")  # exists, but not for this key: as if it did not


def test_models_need_a_key(gateway: GatewayServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        client_for(gateway, "tgk_nope").models.retrieve("gpt-4o")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_for(gateway, "tgk_nope").models.list()


def test_anthropic_models_list_and_retrieve(gateway: GatewayServer,
                                            make_tenant: MakeTenant) -> None:
    t = make_tenant()
    client = anthropic_for(gateway, t.plaintext)
    models = list(client.models.list())
    assert models and all(m.type == "model" and m.display_name == m.id for m in models)
    # Auto-pagination with small pages walks the same list (after_id cursors).
    assert [m.id for m in client.models.list(limit=2)] == [m.id for m in models]
    # The session's anthropic-kind key serves every model, like its openai-kind key.
    openai_ids = [m.id for m in client_for(gateway, t.plaintext).models.list()]
    assert [m.id for m in models] == openai_ids
    raw = httpx.get(f"{gateway.base_url}/models", params={"limit": 1},
                    headers={"x-api-key": t.plaintext, "anthropic-version": "2023-06-01"})
    page = raw.json()
    assert raw.status_code == 200 and raw.headers["request-id"].startswith("req_")
    assert set(page) == {"data", "has_more", "first_id", "last_id"}
    assert page["has_more"] is True and page["first_id"] == page["last_id"] == models[0].id
    assert set(page["data"][0]) >= {"type", "id", "display_name", "created_at"}

    one = client.models.retrieve("gpt-4o-mini")
    assert (one.id, one.type) == ("gpt-4o-mini", "model")
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model-anywhere")
    limited = anthropic_for(gateway, make_tenant(
        key_options={"allowed_models": ["gpt-4o-mini"]}).plaintext)
    assert [m.id for m in limited.models.list()] == ["gpt-4o-mini"]


# -- moderations ----------------------------------------------------------------------------------


def test_moderations_pass_through_unmetered(gateway: GatewayServer, make_tenant: MakeTenant,
                                            engine: QuotaEngine) -> None:
    t = make_tenant()
    client = client_for(gateway, t.plaintext)
    one = client.moderations.create(input="a friendly sentence")
    assert len(one.results) == 1 and one.results[0].flagged is False
    # The default model, named for the upstream since the session's key serves every model.
    assert one.model == "omni-moderation-latest"
    two = client.moderations.create(model="omni-moderation-latest",
                                    input=["first text", "second text"])
    assert len(two.results) == 2
    assert_unmetered(engine, t)


def test_moderations_allow_list_and_bad_input(gateway: GatewayServer, make_tenant: MakeTenant,
                                              engine: QuotaEngine) -> None:
    t = make_tenant(key_options={"allowed_models": ["gpt-4o-mini"]})
    client = client_for(gateway, t.plaintext)
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.moderations.create(model="omni-moderation-latest", input="hello")
    assert info.value.code == "model_not_allowed"
    # Naming no model, the allow-list has nothing to refuse.
    assert len(client.moderations.create(input="hello").results) == 1
    response = httpx.post(f"{gateway.base_url}/moderations", json={"model": "x"},
                          headers={"Authorization": f"Bearer {t.plaintext}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input"
    response = httpx.post(f"{gateway.base_url}/moderations", content=b"[1, 2]",
                          headers={"Authorization": f"Bearer {t.plaintext}"})
    assert response.status_code == 400
    assert_unmetered(engine, t)


# -- count_tokens ----------------------------------------------------------------------------------


def test_count_tokens_is_the_upstreams_count_unmetered(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    mock_upstream: MockUpstream,
) -> None:
    t = make_tenant()
    body = {"model": "claude-sonnet-4-5", "system": "be brief", "messages": MESSAGES}
    direct = httpx.post(f"{mock_upstream.base_url}/messages/count_tokens", json=body,
                        headers={"x-api-key": ANTHROPIC_MOCK_SECRET,
                                 "anthropic-version": "2023-06-01"})
    assert direct.status_code == 200
    counted = anthropic_for(gateway, t.plaintext).messages.count_tokens(**body)
    assert counted.input_tokens == direct.json()["input_tokens"] > 0
    # Authorization: Bearer works too, and a client naming no version gets the default one.
    bearer = anthropic.Anthropic(base_url=gateway.url, auth_token=t.plaintext, max_retries=0)
    assert bearer.messages.count_tokens(**body).input_tokens == counted.input_tokens
    plain = httpx.post(f"{gateway.base_url}/messages/count_tokens", json=body,
                       headers={"x-api-key": t.plaintext})
    assert plain.status_code == 200 and plain.json() == direct.json()
    assert plain.headers["request-id"] == plain.headers["x-request-id"]
    assert_unmetered(engine, t)


def test_count_tokens_errors_in_anthropics_shape(gateway: GatewayServer,
                                                 make_tenant: MakeTenant) -> None:
    t = make_tenant(key_options={"allowed_models": ["claude-haiku-4-5"]})
    client = anthropic_for(gateway, t.plaintext)
    with pytest.raises(anthropic.PermissionDeniedError):
        client.messages.count_tokens(model="claude-sonnet-4-5", messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model="claude-haiku-4-5", messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_for(gateway, "tgk_nope").messages.count_tokens(
            model="claude-haiku-4-5", messages=MESSAGES)
    # The upstream's own validation, passed on in Tollgate's words: a bad content block.
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="claude-haiku-4-5", messages=[
            {"role": "user", "content": [{"type": "text"}]}])


def test_count_tokens_upstream_failures(gateway: GatewayServer, make_tenant: MakeTenant,
                                        anthropic_key_faults: Any) -> None:
    client = anthropic_for(gateway, make_tenant().plaintext)
    anthropic_key_faults(status=429, retry_after=7)
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.count_tokens(model="claude-haiku-4-5", messages=MESSAGES)
    assert limited.value.response.headers["retry-after"] == "7"
    anthropic_key_faults(status=500)
    with pytest.raises(anthropic.InternalServerError) as failed:
        client.messages.count_tokens(model="claude-haiku-4-5", messages=MESSAGES)
    assert failed.value.status_code == 502
    anthropic_key_faults()
    assert client.messages.count_tokens(model="claude-haiku-4-5",
                                        messages=MESSAGES).input_tokens > 0


# -- unknown paths and unsupported endpoints ------------------------------------------------------


def test_unknown_paths_are_json_404s(gateway: GatewayServer, make_tenant: MakeTenant) -> None:
    client = client_for(gateway, make_tenant().plaintext)
    with pytest.raises(openai.NotFoundError) as info:
        client.get("/foo", cast_to=httpx.Response)
    assert info.value.code == "unknown_url"
    assert "GET /v1/foo" in info.value.message
    for method, path in (("GET", "/v1/foo"), ("POST", "/v1/chat/completions/x"), ("GET", "/v1"),
                         ("DELETE", "/v1/models/"), ("GET", "/v1/" + "x" * 5000)):
        response = httpx.request(method, f"{gateway.url}{path}")  # no key needed for a 404
        assert response.status_code == 404, path
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "unknown_url"
        assert len(response.content) < 1000
    # Wrong methods on known paths stay JSON 405s.
    for path in ("/v1/moderations", "/v1/chat/completions"):
        response = httpx.get(f"{gateway.url}{path}")
        assert response.status_code == 405 and response.json()["error"]["code"] == \
            "method_not_allowed"
    response = httpx.delete(f"{gateway.base_url}/models/gpt-4o")
    assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD")


def test_anthropic_clients_get_anthropics_404(gateway: GatewayServer,
                                              make_tenant: MakeTenant) -> None:
    client = anthropic_for(gateway, make_tenant().plaintext)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.get("/v1/foo", cast_to=httpx.Response)
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as batch:
        client.messages.batches.create(requests=[{"custom_id": "a", "params": {
            "model": "claude-haiku-4-5", "max_tokens": 5, "messages": MESSAGES}}])
    assert "/v1/messages/batches" in batch.value.message
    response = httpx.get(f"{gateway.base_url}/messages/nothing")  # under /v1/messages
    assert response.status_code == 404 and response.json()["type"] == "error"


def test_a_base_url_without_v1_is_a_json_404_saying_which_to_set(
        gateway: GatewayServer, make_tenant: MakeTenant) -> None:
    key = make_tenant().plaintext
    # The openai SDK with the gateway's root as its base URL (it must end in /v1).
    bare = openai.OpenAI(base_url=gateway.url, api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as chat:
        bare.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert chat.value.code == "unknown_url"
    assert "did you mean /v1/chat/completions?" in chat.value.message
    assert f"Set the SDK's base URL to {gateway.url}/v1 " in chat.value.message
    with pytest.raises(openai.NotFoundError) as responses:
        bare.responses.create(model="gpt-4o-mini", input="hi")
    assert "did you mean /v1/responses?" in responses.value.message
    # The anthropic SDK with a base URL ending in /v1 (it adds /v1 itself): /v1/v1/messages.
    doubled = anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as message:
        doubled.messages.create(model="claude-haiku-4-5", max_tokens=5, messages=MESSAGES)
    assert message.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "did you mean /v1/messages?" in message.value.message
    # Without /v1 at all, from a plain HTTP client: Anthropic's shape for /messages.
    response = httpx.post(f"{gateway.url}/messages", json={})
    assert response.status_code == 404 and response.json()["type"] == "error"
    assert "did you mean /v1/messages?" in response.json()["error"]["message"]


def test_responses_compact_and_input_tokens_are_unsupported(gateway: GatewayServer,
                                                            make_tenant: MakeTenant) -> None:
    for path in ("/v1/responses/compact", "/v1/responses/input_tokens"):
        response = httpx.post(f"{gateway.url}{path}", json={"model": "gpt-4o-mini",
                                                            "input": "hi"})
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "unsupported_endpoint", path


def test_unsupported_endpoints_are_refused_before_auth(gateway: GatewayServer,
                                                       make_tenant: MakeTenant) -> None:
    client = client_for(gateway, make_tenant().plaintext)
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(prompt="a cat")
    assert info.value.code == "unsupported_endpoint"
    assert "/v1/images" in info.value.message
    with pytest.raises(openai.NotFoundError) as files:
        client.files.list()
    assert files.value.code == "unsupported_endpoint"
    # A bad key is no reason: the endpoint is.
    with pytest.raises(openai.NotFoundError) as anyone:
        client_for(gateway, "tgk_nope").batches.list()
    assert anyone.value.code == "unsupported_endpoint"
    for path in ("/v1/audio/speech", "/v1/uploads", "/v1/fine_tuning/jobs",
                 "/v1/vector_stores/vs_1/files", "/v1/assistants", "/v1/threads/t_1/runs",
                 "/v1/realtime/sessions"):
        response = httpx.post(f"{gateway.url}{path}", json={})
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "unsupported_endpoint", path
