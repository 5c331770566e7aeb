"""Regression tests for failure paths found in review: cancelled auth lookups, oversized bodies
refused before authentication, odd model names, streams cut after the client asked for usage,
and plan edits reaching the gateways."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from gateway.auth import AuthCache
from quotas.engine import QuotaEngine
from tests.gateway.conftest import GatewayServer, MakeTenant, client_for
from tests.gateway.test_e2e_faults import usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def test_a_cancelled_caller_does_not_fail_the_others_waiting_on_the_same_key() -> None:
    async def scenario() -> object:
        loaded = asyncio.Event()
        sentinel = object()

        async def slow_load(prefix: str) -> object:
            await loaded.wait()
            return sentinel

        cache = AuthCache(60, slow_load)  # type: ignore[arg-type]
        first = asyncio.ensure_future(cache._lookup("p", 0.0))
        second = asyncio.ensure_future(cache._lookup("p", 0.0))
        await asyncio.sleep(0)
        first.cancel()  # its client left
        loaded.set()
        return await second, sentinel

    got, sentinel = asyncio.run(scenario())
    assert got is sentinel


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


def test_a_cut_stream_is_counted_even_when_the_client_asked_for_usage(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine
) -> None:
    t = make_tenant()
    stream = client_for(gateway, t.plaintext).chat.completions.create(
        model="gpt-4o@cut=3", messages=[{"role": "user", "content": "count me"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)  # the gateway ends the client's stream where the upstream broke
    assert all(chunk.usage is None for chunk in chunks)  # no usage ever arrived
    [event] = usage_events(engine, t.tag)
    assert event["event"]["outcome"] == "upstream_broken_counted"
    assert event["event"]["out"] > 0  # the text the client received was counted
    assert engine.counter(t.tag, "tenant").pending == 0


def test_spend_budget_figures_never_appear_as_token_headers(
    gateway: GatewayServer, make_tenant: MakeTenant
) -> None:
    t = make_tenant(monthly_spend_budget_micros=1_000_000, tokens_per_day=123_456)
    raw = client_for(gateway, t.plaintext).chat.completions.with_raw_response.create(
        model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-ratelimit-limit-tokens"] == "123456"


def test_plan_edits_in_admin_are_published(django_capture_on_commit_callbacks: Any) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from quotas.runtime import get_engine
    from tenants.invalidation import CHANNEL
    from tenants.models import Plan

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw-123-secret"))
    plan = Plan.objects.get(name="free")
    pubsub = get_engine().client.pubsub()
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=1)
    data = {field.name: getattr(plan, field.name) for field in Plan._meta.fields
            if field.name not in ("id", "created_at", "updated_at")}
    data.update(tokens_per_day=600_000, allowed_models=json.dumps(plan.allowed_models))
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/admin/tenants/plan/{plan.pk}/change/", data)
    assert response.status_code == 302, response.content[:1000]
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    pubsub.close()
    assert json.loads(message["data"]) == {"kind": "plan", "id": plan.pk}
