"""Issue 11, items 3, 6 and 7, against a running gateway (uvicorn, one worker, the session's Redis
and PostgreSQL): a flood of random keys, admin's revocations and provider key deletes, and a
revocation whose invalidation message was lost.

Whether the gateway answered a real key from its cache, without a database lookup, is probed the
one way a separate process allows: the key is revoked in the database behind the gateway's back
(a plain UPDATE, no invalidation message, no version change). A call still admitted was answered
from the cache; a lookup would have read the revocation.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from gateway.mock_upstream import MockUpstream, start_subprocess
from quotas.keys import auth_version_key, tenant_tag
from quotas.runtime import get_engine
from tenants import invalidation
from tenants.api_key_format import generate_key
from tests.gateway.conftest import GatewayServer, committed, start_gateway
from tests.support.gateway_calls import usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

LOOKUP_BURST = 5  # GATEWAY_AUTH_LOOKUP_BURST of this module's gateway
VERSION_CHECK_S = 0.5  # GATEWAY_AUTH_VERSION_CHECK_SECONDS of this module's gateway
HI = [{"role": "user", "content": "hi"}]
_addresses = (f"192.0.2.{n}" for n in itertools.count(1))


@dataclass(frozen=True)
class Tenant:
    tenant_id: int
    api_key_id: int
    plaintext: str
    provider_key_id: int
    address: str  # its calls come from here: each test's lookups have a bucket of their own

    @property
    def tag(self) -> str:
        return tenant_tag(self.tenant_id)


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    with start_subprocess() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory,
            mock: MockUpstream) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("gateway-auth"), workers=1,
                           GATEWAY_AUTH_LOOKUP_BURST=str(LOOKUP_BURST),
                           GATEWAY_AUTH_LOOKUPS_PER_SECOND="0.1",
                           GATEWAY_AUTH_CACHE_MAX_KEYS="4", GATEWAY_AUTH_NEGATIVE_MAX_KEYS="10",
                           GATEWAY_AUTH_VERSION_CHECK_SECONDS=str(VERSION_CHECK_S),
                           TOLLGATE_TRUSTED_PROXIES="127.0.0.1/32")
    # The worker builds its runtime on its first /v1 call and starts its listener, which empties
    # the cache once subscribed (a lookup racing that is not kept): let it settle first.
    httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer x"}, timeout=30)
    time.sleep(4 * VERSION_CHECK_S)
    yield server
    server.stop()


@pytest.fixture
def make_tenant(django_db_blocker: Any, mock: MockUpstream) -> Callable[..., Tenant]:
    """A committed tenant, project and key, with a provider key of its own at this module's mock
    (priority 0; pricing the models the catalog does not know)."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key
    from tenants.services import create_project, create_tenant, issue_key

    def make() -> Tenant:
        slug = f"auth-{uuid.uuid4().hex[:10]}"

        def create() -> Tenant:
            tenant = create_tenant(slug, plan_name="free", actor="test")
            project = create_project(tenant, "app", actor="test")
            provider = create_provider_key(f"mock-{slug}", base_url=mock.base_url,
                                           secret="sk-auth-e2e", tenant=tenant,
                                           default_price=Price(1_000_000, 2_000_000))
            issued = issue_key(project, actor="test")
            return Tenant(tenant.pk, issued.api_key.pk, issued.plaintext, provider.pk,
                          next(_addresses))

        return committed(django_db_blocker, create)

    return make


def call(server: GatewayServer, key: str, client: str) -> httpx.Response:
    """A small chat call as from `client` (through the trusted proxy on loopback)."""
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": "auth-e2e", "max_tokens": 1, "messages": HI},
                      headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": client})


def served(server: GatewayServer, tenant: Tenant) -> None:
    """Wait until the worker serves the tenant (its provider key reached the pool by pub/sub);
    the key is then in the worker's cache."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = call(server, tenant.plaintext, tenant.address)
        if answer.status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"the gateway never served the tenant: {answer.text}")


def refused_within(server: GatewayServer, tenant: Tenant, seconds: float) -> httpx.Response:
    """Call until the key is refused (401) or `seconds` have passed; the last answer. Calls the
    plan's request rate refuses (429) are not an answer about the key: the next one is."""
    deadline = time.monotonic() + seconds
    while True:
        answer = call(server, tenant.plaintext, tenant.address)
        if answer.status_code == 401 or time.monotonic() >= deadline:
            return answer
        time.sleep(0.1)


def revoke_behind_the_gateways_back(django_db_blocker: Any, api_key_id: int) -> None:
    from django.utils import timezone

    from tenants.models import ApiKey, ApiKeySecret

    def revoke() -> None:
        now = timezone.now()
        ApiKey.objects.filter(pk=api_key_id).update(revoked_at=now)
        ApiKeySecret.objects.filter(api_key_id=api_key_id).update(revoked_at=now)

    committed(django_db_blocker, revoke)


def test_a_flood_of_random_keys_is_bounded_per_address_and_evicts_no_real_key(
    gateway: GatewayServer, make_tenant: Callable[..., Tenant], django_db_blocker: Any,
) -> None:
    real = make_tenant()
    served(gateway, real)
    # Each address gets LOOKUP_BURST lookups of unknown keys, then 429 with no lookup at all.
    answers = [call(gateway, generate_key()[0], "198.51.100.1") for _ in range(LOOKUP_BURST + 2)]
    assert [a.status_code for a in answers] == [401] * LOOKUP_BURST + [429, 429]
    refusal = answers[-1]
    assert refusal.json() == {"error": {
        "message": "Too many API key lookups from your address; retry shortly.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert int(refusal.headers["retry-after"]) >= 1
    # The forwarded address counts, since the peer is a trusted proxy: another client behind
    # the same proxy has its own bucket. A flood from many addresses, far past the sizes of
    # both stores (4 keys, 10 unknown prefixes) ...
    for n in range(60):
        assert call(gateway, generate_key()[0], f"203.0.113.{n}").status_code == 401
    # ... left the real key cached: revoked behind the gateway's back, it is still admitted,
    # so it was not looked up again (a lookup would read the revocation).
    revoke_behind_the_gateways_back(django_db_blocker, real.api_key_id)
    assert call(gateway, real.plaintext, real.address).status_code == 200


@pytest.fixture
def admin_client(django_db_blocker: Any) -> Client:
    name = f"root-{uuid.uuid4().hex[:8]}"
    user = committed(django_db_blocker, lambda: get_user_model().objects.create_superuser(
        name, "", "pw-123-secret"))
    client = Client()
    committed(django_db_blocker, lambda: client.force_login(user))
    return client


def test_revoking_a_key_in_admin_refuses_it_within_a_second(
    gateway: GatewayServer, make_tenant: Callable[..., Tenant], django_db_blocker: Any,
    admin_client: Client,
) -> None:
    tenant = make_tenant()
    served(gateway, tenant)
    # Admin offers no delete of a key (a revocation is what the gateways hear of) ...
    page = committed(django_db_blocker, lambda: admin_client.post(
        f"/admin/tenants/apikey/{tenant.api_key_id}/delete/", {"post": "yes"}))
    assert page.status_code == 403
    assert call(gateway, tenant.plaintext, tenant.address).status_code == 200
    # ... and its "revoke selected" action goes through revoke_key.
    page = committed(django_db_blocker, lambda: admin_client.post(
        "/admin/tenants/apikey/", {"action": "revoke_selected",
                                   "_selected_action": [tenant.api_key_id]}))
    assert page.status_code == 302
    refused = refused_within(gateway, tenant, 1.0)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_a_provider_key_deleted_in_admin_serves_no_call_after_a_second(
    gateway: GatewayServer, make_tenant: Callable[..., Tenant], django_db_blocker: Any,
    admin_client: Client, mock: MockUpstream,
) -> None:
    from gateway.providers import create_provider_key
    from tenants.models import Tenant as TenantRow

    tenant = make_tenant()
    preferred = committed(django_db_blocker, lambda: create_provider_key(
        "preferred", base_url=mock.base_url, secret="sk-auth-e2e-preferred", priority=100,
        tenant=TenantRow.objects.get(pk=tenant.tenant_id)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the worker's pool has the preferred key
        assert call(gateway, tenant.plaintext, tenant.address).status_code == 200
        if usage_events(get_engine(), tenant.tag)[-1]["event"]["pk"] == preferred.pk:
            break
        time.sleep(0.25)  # under the free plan's 5 requests per second
    page = committed(django_db_blocker, lambda: admin_client.post(
        f"/admin/gateway/providerkey/{preferred.pk}/delete/", {"post": "yes"}))
    assert page.status_code == 302
    time.sleep(1.0)  # the promised bound
    before = len(usage_events(get_engine(), tenant.tag))
    for _ in range(3):
        assert call(gateway, tenant.plaintext, tenant.address).status_code == 200
    used = [e["event"]["pk"] for e in usage_events(get_engine(), tenant.tag)[before:]]
    assert used == [tenant.provider_key_id] * 3


def test_a_revocation_whose_message_was_lost_lands_within_two_version_checks(
    gateway: GatewayServer, make_tenant: Callable[..., Tenant], django_db_blocker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tenants.models import ApiKey
    from tenants.services import revoke_key

    tenant = make_tenant()
    served(gateway, tenant)
    redis = get_engine().client
    lost: list[tuple[str, Any]] = []

    def publish_lost(kind: str, ident: Any) -> None:
        # The publish reached Redis (the version moved) but its message reached no gateway.
        redis.incr(auth_version_key())
        lost.append((kind, ident))

    monkeypatch.setattr(invalidation, "_transport", publish_lost)
    committed(django_db_blocker, lambda: revoke_key(ApiKey.objects.get(pk=tenant.api_key_id),
                                                    actor="test"))
    assert lost == [("api_key", tenant.api_key_id)]
    # Bound: two version checks (2 x 0.5 s here); the deadline leaves room for a loaded machine.
    refused = refused_within(gateway, tenant, 4 * VERSION_CHECK_S + 1.0)
    assert refused.status_code == 401
    assert json.loads(refused.content)["error"]["code"] == "invalid_api_key"
