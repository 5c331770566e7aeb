"""Failing over between provider keys, the operator's fail-open mode, and the usage event each
call leaves for the ledger."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from config.embedded import free_port
from gateway.mock_upstream import MockUpstream
from quotas.engine import QuotaEngine
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    start_gateway,
)
from tests.support.gateway_calls import billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


@pytest.fixture(scope="module")
def fail_open_gateway(provider_key: str,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("fail-open"), workers=1, GATEWAY_FAIL_OPEN="true",
                           REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    yield server
    server.stop()


def test_fail_open_forwards_unmetered_and_says_so(
    fail_open_gateway: GatewayServer, make_tenant: MakeTenant, mock_upstream: MockUpstream
) -> None:
    t = make_tenant()
    model = unique_model("fx-open")
    raw = client_for(fail_open_gateway, t.plaintext, timeout=30).chat.completions \
        .with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=3)
    assert raw.headers["x-tollgate-unmetered"] == "true"
    assert raw.parse().usage.completion_tokens == 3
    assert billed(mock_upstream, model)["requests"] == 1
    assert "FAIL-OPEN" in fail_open_gateway.log.read_text()


def test_a_dead_provider_key_fails_over_to_the_next(
    make_tenant: MakeTenant, django_db_blocker: Any, engine: QuotaEngine,
    mock_upstream: MockUpstream, tmp_path: Any
) -> None:
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    t = make_tenant()
    # Dedicated to this tenant, so it is tried first; nothing listens on its port.
    dead = committed(django_db_blocker, lambda: create_provider_key(
        "dead", base_url=f"http://127.0.0.1:{free_port()}/v1", secret="sk-dead-upstream-key",
        priority=100, tenant=Tenant.objects.get(pk=t.tenant_id)))
    server = start_gateway(tmp_path, workers=1)  # loads the pool with the dead key in it
    try:
        model = unique_model("fx-failover")
        completion = client_for(server, t.plaintext).chat.completions.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert f"provider key {dead.public_id} unreachable" in server.log.read_text()
    finally:
        server.stop()
    assert billed(mock_upstream, model)["requests"] == 1
    counter = engine.counter(t.tag, "tenant")
    assert (counter.used, counter.pending) == (completion.usage.total_tokens, 0)
    [event] = usage_events(engine, t.tag)
    assert event["event"]["pk"] == _provider_id(django_db_blocker, "mock")


def _provider_id(django_db_blocker: Any, name: str) -> int:
    from gateway.models import ProviderKey

    return committed(django_db_blocker, lambda: ProviderKey.objects.get(name=name).pk)


def test_each_call_leaves_one_usage_event_with_everything_the_ledger_needs(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine, django_db_blocker: Any
) -> None:
    t = make_tenant()
    client = client_for(gateway, t.plaintext)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "ledger me"}], max_tokens=4)
    completion = raw.parse()
    [event] = usage_events(engine, t.tag)
    assert event["request_id"] == raw.headers["x-request-id"]
    assert event["outcome"] == "settled"
    assert int(event["actual"]) == completion.usage.total_tokens
    assert int(event["held"]) > completion.usage.total_tokens
    meta = json.loads(event["meta"])
    assert (meta["p"], meta["k"], meta["m"], meta["served"], meta["ep"]) == (
        t.project_id, t.api_key_id, "gpt-4o", "gpt-4o", "chat/completions")
    details = event["event"]
    assert (details["in"], details["out"]) == (completion.usage.prompt_tokens,
                                              completion.usage.completion_tokens)
    assert details["st"] == 200 and details["lat"] >= 0 and details["stream"] is False
    assert details["pk"] == _provider_id(django_db_blocker, "mock")


def test_a_provider_key_at_its_rpm_capacity_is_skipped(
    gateway: GatewayServer, make_tenant: MakeTenant, django_db_blocker: Any, engine: QuotaEngine,
    mock_upstream: MockUpstream, tmp_path: Any
) -> None:
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    t = make_tenant()
    limited = committed(django_db_blocker, lambda: create_provider_key(
        "two-per-minute", base_url=mock_upstream.base_url, secret="sk-limited-upstream-key",
        priority=100, rpm_capacity=2, tenant=Tenant.objects.get(pk=t.tenant_id)))
    server = start_gateway(tmp_path, workers=1)
    try:
        client = client_for(server, t.plaintext)
        for _ in range(3):
            client.chat.completions.create(model="gpt-4o-mini", max_tokens=1,
                                           messages=[{"role": "user", "content": "hi"}])
    finally:
        server.stop()
    used = [e["event"]["pk"] for e in usage_events(engine, t.tag)]
    # The dedicated key serves two calls a minute; the third goes to the shared key.
    assert used == [limited.pk, limited.pk, _provider_id(django_db_blocker, "mock")]
