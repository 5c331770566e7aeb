"""Holding for the earlier turns of a Responses call (gateway/responses_context.py) against a
real Redis: remembered contexts, unseen references, the plan's allowance, and never another
tenant's stored response."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.bodies import Endpoint, ParsedBody
from gateway.errors import GatewayError
from gateway.responses_context import held_context, remember_answer
from gateway.usage import Usage
from quotas.answers import AnswerKind, owner, recall
from quotas.client import make_async_redis


def _parsed(**fields: Any) -> ParsedBody:
    return ParsedBody(Endpoint.RESPONSES, {}, "gpt-4o", False, False, None, 1, **fields)


def _ctx(tag: str, allowance: int | None = None) -> Any:
    return SimpleNamespace(tenant_tag=tag, limits=SimpleNamespace(
        responses_context_allowance_tokens=allowance))


def _run(work: Any) -> Any:
    async def go() -> Any:
        client = make_async_redis()
        try:
            return await work(SimpleNamespace(engine=SimpleNamespace(client=client)), client)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_a_remembered_response_is_held_for_and_pinned(redis_url: str) -> None:
    async def work(runtime: Any, client: Any) -> Any:
        await remember_answer(runtime, _ctx("ctxa1"), _parsed(), "resp_ctx_a1", 7,
                              Usage(300, 40))
        context = await held_context(runtime, _ctx("ctxa1"), _parsed(context_ref="resp_ctx_a1"))
        return context, await owner(client, AnswerKind.RESPONSE, "resp_ctx_a1")
    context, made_by = _run(work)
    assert (context.tokens, context.pinned) == (340, 7)
    assert made_by == "ctxa1"


def test_an_unseen_reference_is_refused_without_an_allowance(redis_url: str) -> None:
    async def work(runtime: Any, client: Any) -> Any:
        with pytest.raises(GatewayError) as refused:
            await held_context(runtime, _ctx("ctxb1"), _parsed(context_ref="resp_never_seen"))
        allowed = await held_context(runtime, _ctx("ctxb1", allowance=5000),
                                     _parsed(context_ref="resp_never_seen"))
        return refused.value, allowed
    refused, allowed = _run(work)
    assert (refused.status, refused.code, refused.param) == (
        400, "previous_response_not_found", "previous_response_id")
    assert (allowed.tokens, allowed.pinned) == (5000, None)


def test_the_allowance_never_continues_another_tenants_response(redis_url: str) -> None:
    async def work(runtime: Any, client: Any) -> Any:
        await remember_answer(runtime, _ctx("ctxc1"), _parsed(conversation="conv_c1"),
                              "resp_ctx_c1", 3, Usage(100, 10))
        refused = []
        for parsed in (_parsed(context_ref="resp_ctx_c1"), _parsed(conversation="conv_c1")):
            with pytest.raises(GatewayError) as error:
                await held_context(runtime, _ctx("ctxc2", allowance=5000), parsed)
            refused.append(error.value)
        mine = await recall(client, "ctxc2", AnswerKind.RESPONSE, "resp_ctx_c1")
        return refused, mine
    refused, mine = _run(work)
    assert [e.code for e in refused] == ["previous_response_not_found", "conversation_not_found"]
    assert mine is None


def test_store_false_and_other_endpoints_are_not_remembered(redis_url: str) -> None:
    async def work(runtime: Any, client: Any) -> Any:
        await remember_answer(runtime, _ctx("ctxd1"), _parsed(store=False), "resp_d1", 1,
                              Usage(1, 1))
        chat = ParsedBody(Endpoint.CHAT, {}, "gpt-4o", False, False, None, 1)
        await remember_answer(runtime, _ctx("ctxd1"), chat, "resp_d2", 1, Usage(1, 1))
        return [await recall(client, "ctxd1", AnswerKind.RESPONSE, i) for i in ("resp_d1",
                                                                               "resp_d2")]
    assert _run(work) == [None, None]


def test_a_continuation_while_redis_is_away_is_the_quota_stores_refusal(
        settings: Any) -> None:
    from redis.asyncio import Redis

    from quotas.engine import QuotaStoreUnavailable

    async def work(fail_open: bool) -> Any:
        settings.GATEWAY_FAIL_OPEN = fail_open
        client = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        runtime = SimpleNamespace(engine=SimpleNamespace(client=client))
        try:
            return await held_context(runtime, _ctx("ctxe1"),
                                      _parsed(context_ref="resp_e1"))
        finally:
            await client.aclose()

    with pytest.raises(QuotaStoreUnavailable):  # views.py answers it 503 (Anthropic: 529)
        asyncio.run(work(fail_open=False))
    # Fail-open: the call goes on unmetered, without the earlier turns' context.
    assert asyncio.run(work(fail_open=True)) is None
