"""Circuit breakers end to end, across two gateway processes sharing Redis: the mock upstream
fails on provider key A (fault injection per bearer key); once A's breaker opens, both gateways
send every call to key B without trying A; the mock heals; half-open probes close A; with every
key for a model open the caller gets 503 upstream_unavailable with Retry-After, through the
openai SDK. Money: every hold ends, one ledger row per request, the ledger equals the mock's
bill."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.mock_upstream import MockUpstream, api_key_id
from quotas import keys
from quotas.breakers import KEY_LEVEL, BreakerStore
from quotas.engine import QuotaEngine
from quotas.status import utc_day_id
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    TenantKey,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import SHARED_PROVIDER_SECRET, billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MIN_CALLS = 4
# Long enough for the 12 calls after the opening to be served before the cool-down ends,
# even on a loaded machine (a probe to A would then be among them).
COOLDOWN_S = 8
PROBES = 2
BREAKER_ENV = {
    "TOLLGATE_BREAKER_MIN_CALLS": str(MIN_CALLS), "TOLLGATE_BREAKER_ERROR_PERCENT": "50",
    "TOLLGATE_BREAKER_WINDOW_SECONDS": "120", "TOLLGATE_BREAKER_COOLDOWN_SECONDS": str(COOLDOWN_S),
    "TOLLGATE_BREAKER_PROBES": str(PROBES), "TOLLGATE_BREAKER_FLUSH_SECONDS": "0.2",
    # A hung upstream answers nothing: the gateway gives up on it after this long.
    "GATEWAY_UPSTREAM_READ_TIMEOUT": "1",
}


@dataclass(frozen=True)
class Keys:
    a: Any  # ProviderKey rows, dedicated to the tenant: tried before the shared mock key
    b: Any
    secret_a: str
    secret_b: str


@dataclass(frozen=True)
class Answer:
    status: int
    request_id: str
    tokens: int  # total tokens of a 200's usage
    headers: httpx.Headers
    error: dict[str, Any] | None


@pytest.fixture
def tenant(make_tenant: MakeTenant) -> TenantKey:
    return make_tenant(plan="enterprise", requests_per_second=-1)


@pytest.fixture
def provider_keys(tenant: TenantKey, django_db_blocker: Any, mock_upstream: MockUpstream
                  ) -> Iterator[Keys]:
    from gateway.models import ProviderKey
    from gateway.providers import create_provider_key, delete_provider_key
    from tenants.models import Tenant

    secret_a, secret_b = (f"sk-breaker-{name}-{uuid.uuid4().hex}" for name in "ab")

    def create() -> tuple[Any, Any]:
        owner = Tenant.objects.get(pk=tenant.tenant_id)
        return tuple(create_provider_key(  # type: ignore[return-value]
            f"breaker-{name}", base_url=mock_upstream.base_url, secret=secret, priority=100,
            tenant=owner) for name, secret in (("a", secret_a), ("b", secret_b)))

    a, b = committed(django_db_blocker, create)
    yield Keys(a, b, secret_a, secret_b)
    for secret in (secret_a, secret_b):
        set_faults(mock_upstream, secret, {})
    committed(django_db_blocker, lambda: [delete_provider_key(key, actor="test") for key in
                                          ProviderKey.objects.filter(pk__in=[a.pk, b.pk])])


@pytest.fixture
def gateways(provider_keys: Keys, tmp_path: Path) -> Iterator[list[GatewayServer]]:
    """Two gateway processes (one worker each), started after the keys exist."""
    servers = [start_gateway(tmp_path, workers=1, **BREAKER_ENV) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def set_faults(mock: MockUpstream, secret: str, faults: dict[str, Any],
               model: str | None = None) -> None:
    body = {"key": secret, "faults": faults} | ({"model": model} if model else {})
    httpx.post(f"{mock.url}/mock/faults", json=body, timeout=5).raise_for_status()


def mock_requests(mock: MockUpstream, secret: str) -> int:
    report = httpx.get(f"{mock.url}/mock/faults", timeout=5).json()
    return int(report["requests"].get(api_key_id(secret), 0))


def chat(server: GatewayServer, t: TenantKey, model: str) -> Answer:
    client = client_for(server, t.plaintext, timeout=30)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=3, messages=[{"role": "user", "content": "breaker test"}])
    except openai.APIStatusError as exc:
        body = exc.response.json()
        return Answer(exc.status_code, exc.response.headers["x-request-id"], 0,
                      exc.response.headers, body.get("error"))
    completion = raw.parse()
    return Answer(200, raw.headers["x-request-id"], completion.usage.total_tokens, raw.headers,
                  None)


def served_by(engine: QuotaEngine, t: TenantKey) -> dict[str, int | None]:
    """request id -> the provider key its call went to (from the usage events)."""
    return {e["request_id"]: e["event"].get("pk") for e in usage_events(engine, t.tag)}


def breaker_state(engine: QuotaEngine, provider_id: int, model: str = KEY_LEVEL) -> str:
    for breaker in BreakerStore(engine.client).snapshots(provider_id):
        if breaker.model == model:
            return breaker.state
    return "closed"


def audit_actions(django_db_blocker: Any, public_id: str) -> list[tuple[str, Any]]:
    from tenants.models import AuditEvent

    return committed(django_db_blocker, lambda: [
        (e.action, e.data.get("model")) for e in AuditEvent.objects.filter(
            target=public_id, action__startswith="provider_key.breaker_").order_by("id")])


def assert_money(engine: QuotaEngine, django_db_blocker: Any, mock: MockUpstream,
                 t: TenantKey, answers: list[Answer], models: list[str],
                 secrets: list[str]) -> None:
    """Every hold ended; one ledger row per request; the ledger equals the mock's bill."""
    assert wait_until(lambda: engine.counter(t.tag, "tenant").pending == 0)
    events = usage_events(engine, t.tag)
    assert sorted(e["request_id"] for e in events) == sorted(a.request_id for a in answers)
    bill = sum(billed(mock, model, secret)["total_tokens"] for model in models
               for secret in secrets)
    assert sum(int(e["actual"]) for e in events) == bill == sum(a.tokens for a in answers)
    assert engine.counter(t.tag, "tenant").used == bill
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    rows = committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id)))
    assert sorted(r.request_id for r in rows) == sorted(a.request_id for a in answers)
    assert sum(r.input_tokens + r.output_tokens for r in rows) == bill


def open_by_failing(gateways: list[GatewayServer], t: TenantKey, model: str,
                    is_open: Any, answers: list[Answer], limit: int = 40) -> None:
    """Call through both gateways in turn until `is_open()`."""
    for i in range(limit):
        answers.append(chat(gateways[i % 2], t, model))
        if is_open():
            return
    raise AssertionError("the breaker never opened")


def test_resets_open_the_key_breaker_traffic_moves_to_b_then_probes_close_it(
    gateways: list[GatewayServer], tenant: TenantKey, provider_keys: Keys,
    engine: QuotaEngine, mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    t, k = tenant, provider_keys
    model = unique_model("brk-reset")
    set_faults(mock_upstream, k.secret_a, {"reset": True})
    answers: list[Answer] = []
    open_by_failing(gateways, t, model, lambda: breaker_state(engine, k.a.pk) == "open", answers)
    # A reset after the request was sent is not retried elsewhere (the upstream may have it):
    # those calls got 502; every other call was served by B.
    failed = [a for a in answers if a.status != 200]
    assert len(failed) == MIN_CALLS
    assert all(a.status == 502 and a.error["code"] == "upstream_error" for a in failed)
    by_key = served_by(engine, t)
    assert {by_key[a.request_id] for a in answers if a.status == 200} <= {k.b.pk}

    # Both gateways learn it from the transition's message: wait for its audit row, written by
    # the worker whose record opened it, at the time it published.
    assert wait_until(lambda: ("provider_key.breaker_opened", None)
                      in audit_actions(django_db_blocker, k.a.public_id))
    # The message's publish and the audit row are sent together (circuit.py), and each
    # gateway's listener applies the message on its own loop: a margin for a loaded machine
    # (0.2 s was tight), not a guarantee, as no gateway tells when it has applied it.
    time.sleep(1.0)
    tried_a = mock_requests(mock_upstream, k.secret_a)
    after = [chat(gateways[i % 2], t, model) for i in range(12)]
    answers += after
    assert [a.status for a in after] == [200] * 12
    by_key = served_by(engine, t)
    assert {by_key[a.request_id] for a in after} == {k.b.pk}
    assert mock_requests(mock_upstream, k.secret_a) == tried_a  # A was not tried at all

    # Healed; after the cool-down, probes (at most PROBES) succeed and close A.
    set_faults(mock_upstream, k.secret_a, {})
    time.sleep(COOLDOWN_S + 0.2)
    for i in range(20):
        answers.append(chat(gateways[i % 2], t, model))
        if breaker_state(engine, k.a.pk) == "closed":
            break
    assert breaker_state(engine, k.a.pk) == "closed"
    assert all(a.status == 200 for a in answers[-(i + 1):])
    assert mock_requests(mock_upstream, k.secret_a) - tried_a == PROBES
    assert wait_until(lambda: [a for a, _ in audit_actions(django_db_blocker, k.a.public_id)]
                      == ["provider_key.breaker_opened", "provider_key.breaker_half_opened",
                          "provider_key.breaker_closed"])
    # Closed everywhere: both gateways use A again.
    time.sleep(0.2)
    again = [chat(gateways[i % 2], t, model) for i in range(8)]
    answers += again
    by_key = served_by(engine, t)
    assert {by_key[a.request_id] for a in again} == {k.a.pk, k.b.pk}
    assert_money(engine, django_db_blocker, mock_upstream, t, answers, [model],
                 [k.secret_a, k.secret_b])


def test_a_hanging_key_is_skipped_once_open_so_no_call_waits_for_it(
    gateways: list[GatewayServer], tenant: TenantKey, provider_keys: Keys,
    engine: QuotaEngine, mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    t, k = tenant, provider_keys
    model = unique_model("brk-hang")
    set_faults(mock_upstream, k.secret_a, {"hang": True})
    answers: list[Answer] = []
    open_by_failing(gateways, t, model, lambda: breaker_state(engine, k.a.pk) == "open", answers)
    timeouts = [a for a in answers if a.status != 200]
    assert len(timeouts) == MIN_CALLS and {a.status for a in timeouts} == {504}
    assert wait_until(lambda: audit_actions(django_db_blocker, k.a.public_id)
                      == [("provider_key.breaker_opened", None)])
    time.sleep(1.0)  # each gateway's listener applies the message (see the test above)
    tried_a = mock_requests(mock_upstream, k.secret_a)
    after = [chat(gateways[i % 2], t, model) for i in range(12)]
    answers += after
    assert [a.status for a in after] == [200] * 12
    # No call went to A, so none waited out its read timeout.
    assert mock_requests(mock_upstream, k.secret_a) == tried_a
    assert {served_by(engine, t)[a.request_id] for a in after} == {k.b.pk}
    assert_money(engine, django_db_blocker, mock_upstream, t, answers, [model],
                 [k.secret_a, k.secret_b])


def test_every_key_open_for_a_model_is_503_upstream_unavailable_with_retry_after(
    gateways: list[GatewayServer], tenant: TenantKey, provider_keys: Keys,
    engine: QuotaEngine, mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    t, k = tenant, provider_keys
    model, other = unique_model("brk-5xx"), unique_model("brk-fine")
    secrets = [k.secret_a, k.secret_b, SHARED_PROVIDER_SECRET]
    # The model fails on every key that serves it (the shared key too, for this model only).
    for secret in secrets:
        set_faults(mock_upstream, secret, {"status": 500}, model=model)
    ids = [k.a.pk, k.b.pk]
    answers: list[Answer] = []

    def all_open() -> bool:
        return all(breaker_state(engine, pk, model) == "open" for pk in ids) and \
            answers[-1].status == 503

    open_by_failing(gateways, t, model, all_open, answers, limit=60)
    # A 5xx goes back to its caller (502), never retried on another key.
    assert {a.status for a in answers[:-1]} <= {502, 503}
    refused = answers[-1]
    assert refused.error["code"] == "upstream_unavailable"
    assert refused.error["type"] == "server_error"
    assert 1 <= int(refused.headers["retry-after"]) <= COOLDOWN_S
    # The key breakers stayed closed: the transport worked.
    assert breaker_state(engine, k.a.pk) == breaker_state(engine, k.b.pk) == "closed"

    # Through the SDK as a client sees it, on both gateways.
    for server in gateways:
        with pytest.raises(openai.InternalServerError) as caught:
            client_for(server, t.plaintext).chat.completions.create(
                model=model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503
        assert caught.value.code == "upstream_unavailable"
        assert 1 <= int(caught.value.response.headers["retry-after"]) <= COOLDOWN_S
        answers.append(Answer(503, caught.value.response.headers["x-request-id"], 0,
                              caught.value.response.headers, None))
    # Another model on the same keys is served.
    fine = chat(gateways[0], t, other)
    answers.append(fine)
    assert fine.status == 200
    refusals = engine.client.hgetall(keys.refused_key(t.tag, utc_day_id()))
    assert int(refusals["upstream_unavailable"]) == sum(a.status == 503 for a in answers)
    assert ("provider_key.breaker_opened", model) in audit_actions(django_db_blocker,
                                                                   k.a.public_id)
    assert_money(engine, django_db_blocker, mock_upstream, t, answers, [model, other], secrets)
