"""Requests the gateway refuses are counted per tenant, UTC day and reason, and the quota API and
the console dashboard show them: end to end through a running gateway and the openai SDK."""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import openai
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from gateway.refusals import count_refusal
from quotas import keys
from quotas.engine import QuotaEngine
from quotas.status import utc_day_id
from tenants.models import Membership, Tenant
from tests.gateway.conftest import GatewayServer, MakeTenant, client_for, committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "refusal test"}]


def _chat(server: GatewayServer, key: str, model: str) -> Any:
    return client_for(server, key).chat.completions.create(model=model, messages=MESSAGES,
                                                           max_tokens=5)


def _owner_of(django_db_blocker: Any, tenant_id: int) -> Any:
    def create() -> Any:
        user = get_user_model().objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="x")
        Membership.objects.create(user=user, tenant_id=tenant_id, role=Membership.Role.OWNER)
        return user

    return committed(django_db_blocker, create)


def _refused(engine: QuotaEngine, tag: str) -> dict[str, int]:
    raw = engine.client.hgetall(keys.refused_key(tag, utc_day_id()))
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def test_zero_quota_and_disallowed_model_show_on_the_quota_api_and_dashboard(
        gateway: GatewayServer, make_tenant: MakeTenant, django_db_blocker: Any,
        engine: QuotaEngine) -> None:
    t = make_tenant(tokens_per_day=0, key_options={"allowed_models": ["gpt-4o"]})
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as info:
            _chat(gateway, t.plaintext, "gpt-4o")
        assert info.value.code == "insufficient_quota"
    with pytest.raises(openai.PermissionDeniedError):
        _chat(gateway, t.plaintext, "gpt-4o-mini")
    with pytest.raises(openai.AuthenticationError):  # no tenant to count it against
        _chat(gateway, "tgk_not-a-key", "gpt-4o")

    assert _refused(engine, t.tag) == {"quota_tenant": 2, "model_not_allowed": 1}
    ttl = engine.client.ttl(keys.refused_key(t.tag, utc_day_id()))
    assert 2 * 86400 < ttl <= 3 * 86400

    tenant = Tenant.objects.get(pk=t.tenant_id)
    client = Client()
    client.force_login(_owner_of(django_db_blocker, t.tenant_id))
    body = client.get(f"/api/tenants/{tenant.public_id}/quota").json()
    assert body["refused_today"]["total"] == 3
    assert {r["reason"]: r["count"] for r in body["refused_today"]["by_reason"]} == {
        "quota_tenant": 2, "model_not_allowed": 1}
    html = client.get(f"/console/t/{tenant.public_id}/").content.decode()
    assert 'data-testid="refused-total">3<' in html
    assert "Tenant token quota used up" in html and "Model not allowed for the API key" in html


def test_rate_limit_is_counted_and_admitted_requests_write_nothing(
        gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine) -> None:
    t = make_tenant(key_options={"requests_per_minute": 1})
    assert _chat(gateway, t.plaintext, "gpt-4o").usage.completion_tokens > 0
    assert not engine.client.exists(keys.refused_key(t.tag, utc_day_id()))  # success: no write
    with pytest.raises(openai.RateLimitError) as info:
        _chat(gateway, t.plaintext, "gpt-4o")
    assert info.value.code == "rate_limit_exceeded"
    assert _refused(engine, t.tag) == {"rate_limit": 1}


class _BrokenPipeline:
    def hincrby(self, *args: Any) -> None:
        pass

    def expire(self, *args: Any) -> None:
        pass

    async def execute(self) -> None:
        raise ConnectionError("redis is gone")


class _BrokenClient:
    def pipeline(self, transaction: bool = False) -> _BrokenPipeline:
        return _BrokenPipeline()


def test_a_count_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.refusals"):
        asyncio.run(count_refusal(_BrokenClient(), "1", "quota_tenant"))
        asyncio.run(count_refusal(_BrokenClient(), "1", "made_up_reason"))
    assert "could not count a quota_tenant refusal" in caplog.text
    assert "unknown reason 'made_up_reason'" in caplog.text
