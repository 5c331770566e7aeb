"""Anthropic's Messages API end to end: the official anthropic SDK against a gateway running under
uvicorn (real Redis, real PostgreSQL) and the mock upstream behind an anthropic-kind provider key.

Every call is checked for money as in test_e2e_responses.py (whose helpers this module uses): one
ledger row per request, equal to the mock's bill class by class (cache reads, cache writes,
thinking), each class at its price, nothing pending afterwards. Errors come back in Anthropic's
shape, so the SDK raises its own exception classes.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from gateway.errors import Api, GatewayError, quota_store_unavailable
from gateway.mock_upstream import MockUpstream
from gateway.prices import Price
from quotas.engine import QuotaEngine
from tests.gateway.conftest import GatewayServer, MakeTenant, TenantKey, committed, start_gateway
from tests.gateway.test_e2e_responses import (
    Meter,
    Model,
    RequestIds,
    assert_nothing_pending,
    assert_row_is_the_bill,
    billed,
    drop_models,
    ledger_rows,
    priced_models,
)
from tests.support.gateway_calls import usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather", "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}
# The mock provider key's default price, for the module's models outside the catalog.
KEY_PRICE = Price(3_000_000, 15_000_000)


def hello(model: str, **options: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": options.pop("max_tokens", 64),
            "messages": [{"role": "user", "content": "hello there gateway"}], **options}


@dataclass(frozen=True)
class Setup:
    models: dict[str, Model]
    # Served by the module's anthropic-kind key (a model name list of its own, see `setup`).
    error_model: str
    over_quota_model: str
    unserved_model: str


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker: Any,
          mock_upstream: MockUpstream) -> Iterator[Setup]:
    """The module's catalog models and an anthropic-kind provider key on the mock that serves
    exactly them (and two unpriced names at its default price), so a model outside that list is
    one no anthropic-kind key of this module serves."""
    from gateway.models import ProviderKey
    from gateway.providers import create_provider_key, delete_provider_key

    models = priced_models(django_db_blocker, "ca", {
        "plain": "", "bearer": "", "raw": "", "stream": "",
        "tool": "", "thinking": "@reasoning_tokens=30", "budget": "", "headers": ""},
        tokenizer="heuristic")
    error_model = f"ca-{uuid.uuid4().hex[:8]}@status=500"
    over_quota_model = f"ca-{uuid.uuid4().hex[:8]}"
    unserved_model = f"ca-{uuid.uuid4().hex[:8]}"
    secret = f"sk-ant-sdk-{uuid.uuid4().hex}"
    # Priority 100: ahead of any other anthropic-kind key that serves every model, so the
    # faults set for this key below apply to every call of the module.
    key = committed(django_db_blocker, lambda: create_provider_key(
        "sdk-anthropic", base_url=mock_upstream.base_url, secret=secret, kind="anthropic",
        default_price=KEY_PRICE, priority=100,
        models=[m.name for m in models.values()] + [error_model, over_quota_model]))
    # Cache reads and writes for the stream model's calls (two fault options in its name would
    # make it longer than the audit trail keeps).
    httpx.post(f"{mock_upstream.url}/mock/faults", timeout=5, json={
        "key": secret, "model": models["stream"].billed_as,
        "faults": {"cache_read_tokens": 6, "cache_write_tokens": 4}}).raise_for_status()
    yield Setup(models, error_model, over_quota_model, unserved_model)
    httpx.post(f"{mock_upstream.url}/mock/faults", timeout=5, json={
        "key": secret, "faults": {}}).raise_for_status()
    committed(django_db_blocker, lambda: [delete_provider_key(k, actor="test")
                                          for k in ProviderKey.objects.filter(pk=key.pk)])
    drop_models(django_db_blocker, models)


@pytest.fixture(scope="module")
def server(setup: Setup, provider_key: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    gateway = start_gateway(tmp_path_factory.mktemp("gateway-messages"), workers=2)
    yield gateway
    gateway.stop()


@dataclass
class Caller:
    t: TenantKey
    ids: RequestIds
    client: anthropic.Anthropic


@pytest.fixture
def caller(server: GatewayServer, make_tenant: MakeTenant) -> Callable[..., Caller]:
    def make(**overrides: Any) -> Caller:
        t = make_tenant(**{"requests_per_second": -1, **overrides})
        ids = RequestIds()
        # The SDK appends /v1/messages itself.
        client = anthropic.Anthropic(base_url=server.url, api_key=t.plaintext, max_retries=0,
                                     timeout=30, http_client=ids.client())
        return Caller(t, ids, client)

    return make


def test_create_with_x_api_key_is_metered_exactly(
    caller: Callable[..., Caller], setup: Setup, mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    model = setup.models["plain"]
    meter = Meter(mock_upstream, model.name)
    message = c.client.messages.create(**hello(model.name, system="be brief"))
    bill = meter.take()
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and len(message.content[0].text.split()) == 16
    assert message.stop_reason == "end_turn"
    # The request id is in Anthropic's header (the SDK's _request_id) and OpenAI's.
    assert message._request_id == c.ids.last and message._request_id.startswith("req_")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 16)
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert row.request_id == message._request_id and row.endpoint == "messages"
    assert row.status == "settled" and not row.streamed
    assert_row_is_the_bill(row, bill, model.price)
    assert_nothing_pending(engine, c.t, 21)


def test_bearer_auth_works_for_the_messages_api(
    caller: Callable[..., Caller], setup: Setup, server: GatewayServer,
    mock_upstream: MockUpstream, engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    bearer_model, raw_model = setup.models["bearer"], setup.models["raw"]
    # The SDK with an auth token: it sends `Authorization: Bearer`, no x-api-key.
    sdk = anthropic.Anthropic(base_url=server.url, auth_token=c.t.plaintext, max_retries=0,
                              timeout=30, http_client=c.ids.client())
    meter = Meter(mock_upstream, bearer_model.name)
    message = sdk.messages.create(**hello(bearer_model.name))
    bearer_bill, bearer_id = meter.take(), c.ids.last
    assert message.usage.output_tokens == 16

    # A plain HTTP call with only a Bearer header and no anthropic-version (the gateway sends
    # the default version upstream).
    raw_meter = Meter(mock_upstream, raw_model.name)
    response = httpx.post(f"{server.url}/v1/messages", timeout=30,
                          headers={"Authorization": f"Bearer {c.t.plaintext}"},
                          json=hello(raw_model.name, max_tokens=5))
    raw_bill = raw_meter.take()
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["type"] == "message" and body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 5
    assert response.headers["request-id"] == response.headers["x-request-id"]

    rows = ledger_rows(django_db_blocker, engine, c.t, 2)
    assert_row_is_the_bill(rows[bearer_id], bearer_bill, bearer_model.price)
    assert_row_is_the_bill(rows[response.headers["request-id"]], raw_bill, raw_model.price)
    assert_nothing_pending(engine, c.t, 19 + 3 + 5)


def test_stream_with_cache_reads_and_writes(
    caller: Callable[..., Caller], setup: Setup, mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    model = setup.models["stream"]
    meter = Meter(mock_upstream, model.name)
    with c.client.messages.stream(model=model.name, max_tokens=64, system="a cached system prompt",
                                  messages=[{"role": "user", "content": "one two three four five "
                                                                       "six seven eight nine ten"}]
                                  ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    bill = meter.take()
    assert len(text.split()) == 16 and final.stop_reason == "end_turn"
    usage = final.usage
    # Anthropic's input_tokens leaves cache reads and writes out: 4 + 10 words in all.
    assert (usage.input_tokens, usage.cache_read_input_tokens,
            usage.cache_creation_input_tokens, usage.output_tokens) == (4, 6, 4, 16)
    assert (bill.input, bill.cached, bill.cache_write) == (14, 6, 4)
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert row.streamed and row.status == "settled" and row.request_id == c.ids.last
    # The ledger's input is every input token: uncached, read and written.
    assert row.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                + usage.cache_creation_input_tokens)
    assert (row.cached_input_tokens, row.cache_write_tokens, row.output_tokens) == (6, 4, 16)
    assert_row_is_the_bill(row, bill, model.price)
    assert row.cost_micros != model.price.cost(row.input_tokens, row.output_tokens)
    assert_nothing_pending(engine, c.t, 14 + 16)


def test_tool_use_then_tool_result(caller: Callable[..., Caller], setup: Setup,
                                   mock_upstream: MockUpstream, engine: QuotaEngine,
                                   django_db_blocker: Any) -> None:
    c = caller()
    model = setup.models["tool"]
    meter = Meter(mock_upstream, model.name)
    question = {"role": "user", "content": "what is the weather in Paris"}
    first = c.client.messages.create(model=model.name, max_tokens=64, tools=[WEATHER_TOOL],
                                     messages=[question])
    first_bill, first_id = meter.take(), c.ids.last
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}

    second = c.client.messages.create(model=model.name, max_tokens=64, tools=[WEATHER_TOOL],
                                      messages=[
        question,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny and warm"}]},
    ])
    second_bill, second_id = meter.take(), c.ids.last
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    tools_words = len(json.dumps([WEATHER_TOOL]).split())
    assert second.usage.input_tokens == (6 + len(json.dumps(use.input).split()) + 3
                                         + tools_words)

    rows = ledger_rows(django_db_blocker, engine, c.t, 2)
    assert_row_is_the_bill(rows[first_id], first_bill, model.price)
    assert_row_is_the_bill(rows[second_id], second_bill, model.price)
    assert_nothing_pending(engine, c.t, sum(m.usage.input_tokens + m.usage.output_tokens
                                            for m in (first, second)))


def test_thinking_counts_inside_the_output(caller: Callable[..., Caller], setup: Setup,
                                           mock_upstream: MockUpstream, engine: QuotaEngine,
                                           django_db_blocker: Any) -> None:
    """Thinking is output (inside max_tokens, billed with the answer). The ledger row must equal
    the mock's bill class by class: today the mock's bill reports the thinking as reasoning
    (output_reasoning_tokens 30, from its own usage.output_tokens_details.thinking_tokens) while
    the gateway reads no thinking figure from Anthropic's usage (the real API reports none), so
    the row keeps reasoning 0 and reconciliation would flag a reasoning mismatch
    (/tmp/q13/bugs-sdk.md, bug 2)."""
    c = caller()
    model = setup.models["thinking"]
    meter = Meter(mock_upstream, model.name)
    message = c.client.messages.create(**hello(
        model.name, max_tokens=2_000, thinking={"type": "enabled", "budget_tokens": 1_024}))
    bill = meter.take()
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text"]
    # The thinking (30 tokens by the model's fault option) is output, billed with the answer.
    assert message.usage.output_tokens == 30 + 16
    assert (bill.output, bill.reasoning) == (46, 30)
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert row.output_tokens == 46
    assert_row_is_the_bill(row, bill, model.price)
    assert_nothing_pending(engine, c.t, 3 + 46)


def test_the_thinking_budget_shrinks_with_the_headroom(
    caller: Callable[..., Caller], setup: Setup, mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    # 1,500 tokens a day: max_tokens 4,000 cannot be held, so the hold shrinks to the headroom
    # and max_tokens with it (about 1,200); the 2,000-token thinking budget must then shrink
    # below it too, or the upstream refuses the call (the mock checks budget < max_tokens).
    c = caller(tokens_per_day=1_500)
    model = setup.models["budget"]
    meter = Meter(mock_upstream, model.name)
    message = c.client.messages.create(**hello(
        model.name, max_tokens=4_000, thinking={"type": "enabled", "budget_tokens": 2_000}))
    bill = meter.take()
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 16
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert_row_is_the_bill(row, bill, model.price)
    assert row.held_tokens <= 1_500
    assert_nothing_pending(engine, c.t, 3 + 16)


def test_rate_limit_headers_on_a_success(caller: Callable[..., Caller], setup: Setup,
                                         engine: QuotaEngine, django_db_blocker: Any) -> None:
    c = caller(requests_per_second=5)
    raw = c.client.messages.with_raw_response.create(**hello(setup.models["headers"].name))
    message = raw.parse()
    headers = raw.headers
    assert headers["anthropic-ratelimit-tokens-limit"] == "500000"
    assert int(headers["anthropic-ratelimit-tokens-remaining"]) < 500_000
    assert headers["anthropic-ratelimit-requests-limit"] == "5"
    assert int(headers["anthropic-ratelimit-requests-remaining"]) <= 4
    for name in ("anthropic-ratelimit-tokens-reset", "anthropic-ratelimit-requests-reset"):
        assert datetime.fromisoformat(headers[name].replace("Z", "+00:00")).tzinfo is not None
    assert "x-ratelimit-limit-tokens" not in headers  # OpenAI's names are for OpenAI's APIs
    assert headers["request-id"] == message._request_id
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert row.output_tokens == message.usage.output_tokens


# -- errors: Anthropic's shape, the SDK's exception classes ---------------------------------------


def _error_body(error: anthropic.APIStatusError) -> dict[str, Any]:
    body = error.response.json()
    assert body["type"] == "error" and body["request_id"] == error.response.headers["request-id"]
    return body["error"]


def test_a_bad_key_is_an_authentication_error(server: GatewayServer, setup: Setup) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="tgk_not_a_key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(**hello(setup.models["plain"].name))
    assert info.value.status_code == 401
    assert _error_body(info.value)["type"] == "authentication_error"
    missing = httpx.post(f"{server.url}/v1/messages", json=hello("x"), timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


def test_a_model_not_allowed_is_a_permission_error(caller: Callable[..., Caller], setup: Setup,
                                                   mock_upstream: MockUpstream,
                                                   engine: QuotaEngine) -> None:
    c = caller(key_options={"allowed_models": [setup.models["plain"].name]})
    other = setup.models["headers"]
    with pytest.raises(anthropic.PermissionDeniedError) as info:
        c.client.messages.create(**hello(other.name))
    assert _error_body(info.value)["type"] == "permission_error"
    assert_nothing_pending(engine, c.t, 0)


def test_missing_max_tokens_is_a_bad_request(caller: Callable[..., Caller], setup: Setup,
                                             mock_upstream: MockUpstream,
                                             engine: QuotaEngine) -> None:
    c = caller()
    model = setup.models["plain"]
    before = billed(mock_upstream, model.name)
    with pytest.raises(anthropic.BadRequestError) as info:
        # The SDK's signature insists on max_tokens; omit it from the body all the same.
        c.client.messages.create(model=model.name, max_tokens=anthropic.omit,
                                 messages=[{"role": "user", "content": "hi"}])
    error = _error_body(info.value)
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    assert billed(mock_upstream, model.name) == before
    assert_nothing_pending(engine, c.t, 0)


@pytest.fixture
def only_this_modules_anthropic_key(setup: Setup, django_db_blocker: Any,
                                    tmp_path: Path) -> Iterator[GatewayServer]:
    """A gateway whose only anthropic-kind key is this module's (which serves a list of models):
    the session's shared anthropic key, which serves every model, is disabled while it runs."""
    from gateway.models import ProviderKey
    from gateway.providers import update_provider_key

    def switch(enabled: bool, ids: list[int]) -> list[int]:
        keys = list(ProviderKey.objects.filter(pk__in=ids) if ids else ProviderKey.objects.filter(
            kind="anthropic", enabled=True, tenant__isnull=True, models=[]))
        for key in keys:
            key.enabled = enabled
            update_provider_key(key, ["enabled"], actor="test")
        return [key.pk for key in keys]

    disabled = committed(django_db_blocker, lambda: switch(False, []))
    try:
        server = start_gateway(tmp_path, workers=1)
        yield server
        server.stop()
    finally:
        if disabled:
            committed(django_db_blocker, lambda: switch(True, disabled))


def test_a_model_no_anthropic_key_serves_is_not_found(
    only_this_modules_anthropic_key: GatewayServer, make_tenant: MakeTenant, setup: Setup,
    mock_upstream: MockUpstream, engine: QuotaEngine
) -> None:
    t = make_tenant(requests_per_second=-1)
    client = anthropic.Anthropic(base_url=only_this_modules_anthropic_key.url,
                                 api_key=t.plaintext, max_retries=0, timeout=30)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(**hello(setup.unserved_model))
    error = _error_body(info.value)
    assert error["type"] == "not_found_error" and setup.unserved_model in error["message"]
    assert billed(mock_upstream, setup.unserved_model).requests == 0
    # The same gateway serves a model the module's key lists.
    served = client.messages.create(**hello(setup.models["plain"].name, max_tokens=2))
    assert served.usage.output_tokens == 2
    assert_nothing_pending(engine, t, 3 + 2)


def test_over_quota_is_a_rate_limit_error_with_retry_after(
    caller: Callable[..., Caller], setup: Setup, mock_upstream: MockUpstream,
    engine: QuotaEngine
) -> None:
    c = caller(tokens_per_day=10)
    with pytest.raises(anthropic.RateLimitError) as info:
        c.client.messages.create(model=setup.over_quota_model, max_tokens=64,
                                 messages=[{"role": "user", "content": " ".join(["w"] * 40)}])
    assert _error_body(info.value)["type"] == "rate_limit_error"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert billed(mock_upstream, setup.over_quota_model).requests == 0
    assert_nothing_pending(engine, c.t, 0)
    assert usage_events(engine, c.t.tag) == []


def test_an_upstream_500_is_a_server_error_and_charges_nothing(
    caller: Callable[..., Caller], setup: Setup, mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    with pytest.raises(anthropic.InternalServerError) as info:
        c.client.messages.create(**hello(setup.error_model))
    assert info.value.status_code >= 500
    assert _error_body(info.value)["type"] in ("api_error", "overloaded_error")
    # Injected errors bill nothing upstream, and the gateway released what it held.
    assert billed(mock_upstream, setup.error_model).requests == 0
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert (row.status, row.input_tokens, row.output_tokens, row.cost_micros) == (
        "released", 0, 0, 0)
    assert_nothing_pending(engine, c.t, 0)


def test_a_quota_store_outage_renders_as_overloaded() -> None:
    """Making Redis unreachable for one module's gateway is out of reach here: the rendering of
    the refusal (503 in OpenAI's APIs) in Anthropic's shape is checked, and that the SDK raises
    OverloadedError for it."""
    response = quota_store_unavailable().response(api=Api.ANTHROPIC, request_id="req_test")
    assert response.status_code == 529
    body = json.loads(response.content)
    assert body == {"type": "error", "request_id": "req_test",
                    "error": {"type": "overloaded_error", "message": body["error"]["message"]}}
    assert GatewayError(503, "busy", "server_error").response(api=Api.OPENAI).status_code == 503

    replay = httpx2.Client(transport=httpx2.MockTransport(lambda request: httpx2.Response(
        response.status_code, content=response.content,
        headers={"content-type": "application/json", "request-id": "req_test"})))
    client = anthropic.Anthropic(base_url="http://gateway.invalid", api_key="tgk_x",
                                 max_retries=0, http_client=replay)
    with pytest.raises(anthropic.OverloadedError) as info:
        client.messages.create(**hello("claude-sonnet-4-5"))
    assert info.value.status_code == 529
