"""The /v1 API end to end: the official openai SDK against the gateway running under uvicorn with
4 worker processes, real Redis, real PostgreSQL and the mock upstream."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from quotas.engine import QuotaEngine
from quotas.windows import WindowKind
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    async_client_for,
    client_for,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]



def tenant_counter(engine: QuotaEngine, tag: str, kind: WindowKind = WindowKind.DAY):
    return engine.counter(tag, "tenant", kind)


def test_chat_completion_is_metered_exactly(gateway: GatewayServer, make_tenant: MakeTenant,
                                            engine: QuotaEngine) -> None:
    t = make_tenant()
    client = client_for(gateway, t.plaintext)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "say hello to the gateway"}],
        max_tokens=7)
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 7
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.headers["x-ratelimit-limit-tokens"] == "500000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 500000
    assert raw.headers["x-ratelimit-limit-requests"] == "5"
    counter = tenant_counter(engine, t.tag)
    assert (counter.used, counter.pending) == (completion.usage.total_tokens, 0)


def test_streaming_without_include_usage_strips_the_usage_chunk(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    chunks = list(client_for(gateway, t.plaintext).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "stream please"}],
        stream=True, max_tokens=5))
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)  # no usage-only chunk reached the client
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text.split()) == 5
    # Settled from the usage chunk the gateway asked for: 2 prompt words + 5 output words.
    assert tenant_counter(engine, t.tag).used == 2 + 5


def test_streaming_with_include_usage_passes_the_usage_chunk(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    chunks = list(client_for(gateway, t.plaintext).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "stream please"}],
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert tenant_counter(engine, t.tag).used == chunks[-1].usage.total_tokens


def test_tool_calls_pass_through(gateway: GatewayServer, make_tenant: MakeTenant) -> None:
    t = make_tenant()
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    client = client_for(gateway, t.plaintext)
    completion = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "what is the weather in Paris"}],
        tools=tools)
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = list(client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "weather in Paris"}],
        tools=tools, stream=True))
    names = [tc.function.name for c in streamed if c.choices for tc in
             (c.choices[0].delta.tool_calls or []) if tc.function and tc.function.name]
    assert names == ["get_weather"]


def test_completions_and_embeddings(gateway: GatewayServer, make_tenant: MakeTenant,
                                    engine: QuotaEngine) -> None:
    t = make_tenant()
    client = client_for(gateway, t.plaintext)
    completion = client.completions.create(model="gpt-3.5-turbo-instruct",
                                           prompt="once upon a time", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    embedding = client.embeddings.create(model="text-embedding-3-small",
                                         input=["hello world", "tollgate meters tokens"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 8
    assert tenant_counter(engine, t.tag).used == (
        completion.usage.total_tokens + embedding.usage.total_tokens)


def test_models_lists_what_the_key_may_use(gateway: GatewayServer,
                                           make_tenant: MakeTenant) -> None:
    everything = {m.id for m in client_for(gateway, make_tenant().plaintext).models.list()}
    assert {"gpt-4o", "gpt-4o-mini", "text-embedding-3-small"} <= everything
    limited = make_tenant(key_options={"allowed_models": ["gpt-4o-mini"]})
    assert [m.id for m in client_for(gateway, limited.plaintext).models.list()] == ["gpt-4o-mini"]


def test_async_client(gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine) -> None:
    t = make_tenant(requests_per_second=-1)

    async def scenario() -> list[int]:
        client = async_client_for(gateway, t.plaintext)
        results = await asyncio.gather(*(
            client.chat.completions.create(model="gpt-4o-mini", max_tokens=3,
                                           messages=[{"role": "user", "content": f"hi {i}"}])
            for i in range(20)))
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        last = [chunk async for chunk in stream][-1]
        await client.close()
        return [r.usage.total_tokens for r in results] + [last.usage.total_tokens]

    totals = asyncio.run(scenario())
    counter = tenant_counter(engine, t.tag)
    assert (counter.used, counter.pending) == (sum(totals), 0)


# -- errors in OpenAI's shape, raised as the SDK's exception classes ------------------------------


def test_bad_key_is_401(gateway: GatewayServer) -> None:
    for key in ("tgk_nope", "tgk_AAAAAAAAAAAA_" + "B" * 40, "sk-something-else"):
        with pytest.raises(openai.AuthenticationError) as info:
            client_for(gateway, key).models.list()
        assert info.value.code == "invalid_api_key"
    response = httpx.post(f"{gateway.base_url}/chat/completions", json={})
    assert response.status_code == 401 and response.json()["error"]["type"]


def test_model_not_allowed_is_403(gateway: GatewayServer, make_tenant: MakeTenant,
                                  engine: QuotaEngine) -> None:
    t = make_tenant(key_options={"allowed_models": ["gpt-4o-mini"]})
    with pytest.raises(openai.PermissionDeniedError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_allowed"
    assert engine.open_hold_ids(t.tag) == []


def test_quota_exhausted_is_429_insufficient_quota_with_retry_after(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant(tokens_per_day=10)
    with pytest.raises(openai.RateLimitError) as info:
        client_for(gateway, t.plaintext).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=50)
    assert info.value.code == "insufficient_quota"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert engine.open_hold_ids(t.tag) == []


def test_request_rate_is_429_rate_limit_exceeded(gateway: GatewayServer,
                                                 make_tenant: MakeTenant) -> None:
    t = make_tenant(requests_per_second=2)
    client = client_for(gateway, t.plaintext)
    codes = []
    for _ in range(4):
        try:
            client.chat.completions.create(model="gpt-4o-mini", max_tokens=1,
                                           messages=[{"role": "user", "content": "hi"}])
            codes.append("ok")
        except openai.RateLimitError as exc:
            codes.append(exc.code)
            assert int(exc.response.headers["retry-after"]) >= 1
    assert codes.count("ok") == 2 and "rate_limit_exceeded" in codes


def test_a_model_outside_the_catalog_is_metered_with_the_fallback_estimate(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    raw = client_for(gateway, t.plaintext).chat.completions.with_raw_response.create(
        model="some-new-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    completion = raw.parse()
    assert completion.model == "some-new-model"
    # The heuristic over-estimates, so the hold (reported as remaining tokens) was generous.
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 500_000 - completion.usage.total_tokens
    counter = tenant_counter(engine, t.tag)
    assert (counter.used, counter.pending) == (completion.usage.total_tokens, 0)


def test_monthly_spend_budget_holds_the_worst_case_cost(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    from gateway.catalog import load_catalog
    from quotas.engine import Unit

    t = make_tenant(monthly_spend_budget_micros=400)
    client = client_for(gateway, t.plaintext)
    price = load_catalog().price("gpt-4o")
    costs = []
    for _ in range(2):  # each holds about 240 micro-dollars and costs about 105
        completion = client.chat.completions.create(
            model="gpt-4o", max_tokens=10, messages=[{"role": "user", "content": "hi there"}])
        # Micro-dollars, rounded half up once per call (gateway.prices.price_micros).
        costs.append((completion.usage.prompt_tokens * price.input_micros_per_mtok
                      + completion.usage.completion_tokens * price.output_micros_per_mtok
                      + 500_000) // 1_000_000)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="gpt-4o", max_tokens=10,
                                       messages=[{"role": "user", "content": "hi there"}])
    assert info.value.code == "insufficient_quota"
    # The budget's window is the tenant's cycle (the free plan's: a day).
    spend = engine.counter(t.tag, "tenant", WindowKind.MONTH, unit=Unit.MICROS,
                           schedule=t.schedule)
    assert (spend.limit, spend.used, spend.pending) == (400, sum(costs), 0)


def test_spend_budget_figures_never_appear_as_token_headers(
    gateway: GatewayServer, make_tenant: MakeTenant
) -> None:
    t = make_tenant(monthly_spend_budget_micros=1_000_000, tokens_per_day=123_456)
    raw = client_for(gateway, t.plaintext).chat.completions.with_raw_response.create(
        model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-ratelimit-limit-tokens"] == "123456"
