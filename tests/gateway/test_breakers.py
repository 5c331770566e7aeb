"""Circuit breakers on provider keys, in process: the pool's skipping of open breakers, the
messages other workers publish, and what the admin and /metrics show of the breakers' state
(read from the session's Redis). End to end across two gateways: test_e2e_breakers.py."""
from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import httpx

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from billing import metrics
from gateway.circuit import apply_breaker_message, rules_from_settings
from gateway.errors import GatewayError
from gateway.forward import Call, _answer
from gateway.providers import KEY_BREAKER, ProviderPool, Upstream, create_provider_key
from quotas.breakers import KEY_LEVEL, BreakerRules, BreakerStore, Outcomes
from quotas.runtime import get_engine
from tests.gateway.test_call_end import async_engine, new_tenant, open_call, settled_background
from tests.gateway.test_circuit import DatabaseDown
from tests.support.prometheus import samples


def upstream(ident: int, priority: int = 0, models: frozenset[str] = frozenset(),
             tenant_id: int | None = None) -> Upstream:
    return Upstream(id=ident, public_id=f"pk_{ident}", base_url="http://u", secret="s",
                    rpm_capacity=None, tpm_capacity=None, priority=priority, models=models,
                    tenant_id=tenant_id)


def ids(pool: ProviderPool, model: str, now: float, tenant_id: int | None = None) -> set[int]:
    return {u.id for u in pool.candidates(model, tenant_id, now)}


def test_an_open_key_breaker_skips_the_key_for_every_model() -> None:
    pool = ProviderPool([upstream(1), upstream(2)])
    pool.open_breaker(1, KEY_BREAKER, until=100.0)
    assert ids(pool, "gpt-4o", 50.0) == ids(pool, "other", 50.0) == {2}
    assert pool.breakers_due(1, "gpt-4o", 50.0) == []
    assert pool.breakers_due(2, "gpt-4o", 50.0) is None
    # Past its cool-down the key is offered again, with the breaker to probe.
    assert ids(pool, "gpt-4o", 150.0) == {1, 2}
    assert pool.breakers_due(1, "gpt-4o", 150.0) == [KEY_BREAKER]


def test_an_open_model_breaker_skips_the_key_for_that_model_only() -> None:
    pool = ProviderPool([upstream(1), upstream(2)])
    pool.open_breaker(1, "gpt-4o", until=100.0)
    assert ids(pool, "gpt-4o", 50.0) == {2}
    assert ids(pool, "gpt-4o-mini", 50.0) == {1, 2}
    assert pool.breakers_due(1, "gpt-4o-mini", 50.0) is None
    assert pool.breakers_due(1, "gpt-4o", 150.0) == ["gpt-4o"]


def test_both_breakers_due_are_both_probed_and_one_open_blocks() -> None:
    pool = ProviderPool([upstream(1)])
    pool.open_breaker(1, KEY_BREAKER, until=100.0)
    pool.open_breaker(1, "gpt-4o", until=200.0)
    assert pool.breakers_due(1, "gpt-4o", 150.0) == []
    assert pool.breakers_due(1, "gpt-4o", 250.0) == [KEY_BREAKER, "gpt-4o"]


def test_breaker_wait_is_the_first_half_open_among_usable_keys() -> None:
    pool = ProviderPool([upstream(1), upstream(2), upstream(3, tenant_id=9),
                         upstream(4, models=frozenset({"other"}))])
    pool.open_breaker(1, KEY_BREAKER, until=130.0)
    pool.open_breaker(2, "gpt-4o", until=110.0)
    pool.open_breaker(3, KEY_BREAKER, until=101.0)  # another tenant's key
    pool.open_breaker(4, KEY_BREAKER, until=102.0)  # does not serve gpt-4o
    assert pool.breaker_wait("gpt-4o", None, 100.0) == pytest.approx(10.0)
    assert pool.breaker_wait("gpt-4o", 9, 100.0) == pytest.approx(1.0)
    assert pool.breaker_wait("gpt-4o-mini", None, 100.0) == pytest.approx(30.0)
    assert ProviderPool([upstream(1)]).breaker_wait("gpt-4o", None, 100.0) is None


def test_a_later_open_wins_close_forgets_and_a_reload_keeps_them() -> None:
    pool = ProviderPool([upstream(1), upstream(2)])
    pool.open_breaker(1, "m", until=200.0)
    pool.open_breaker(1, "m", until=150.0)  # out of order: never shortens
    assert pool.breakers() == {(1, "m"): 200.0}
    pool.hold_breaker(1, "m", until=120.0)  # half-open, slots taken: may shorten
    pool.hold_breaker(2, "m", until=120.0)  # unknown: ignored
    assert pool.breakers() == {(1, "m"): 120.0}
    pool.cool_down(2, until=300.0)
    fresh = ProviderPool([upstream(1), upstream(2)])
    fresh.adopt_resting(pool)
    assert fresh.breakers() == {(1, "m"): 120.0} and fresh.cooldowns() == {2: 300.0}
    assert pool.without(2).breakers() == {(1, "m"): 120.0}
    pool.close_breaker(1, "m")
    assert pool.breakers() == {}


def test_published_transitions_apply_to_the_pool() -> None:
    pool = ProviderPool([upstream(1)])
    apply_breaker_message(pool, {"id": 1, "model": "", "state": "open", "left": 30})
    assert list(pool.breakers()) == [(1, KEY_BREAKER)]
    apply_breaker_message(pool, {"id": 1, "model": "gpt-4o", "state": "open", "left": 30})
    apply_breaker_message(pool, {"id": 1, "model": "gpt-4o", "state": "half_open", "left": 0})
    assert set(pool.breakers()) == {(1, KEY_BREAKER), (1, "gpt-4o")}
    apply_breaker_message(pool, {"id": 1, "model": "", "state": "closed", "left": 0})
    assert list(pool.breakers()) == [(1, "gpt-4o")]


# -- admin and /metrics ---------------------------------------------------------------------------

ONE_CALL = BreakerRules(window_ms=60_000, min_calls=1, error_percent=50, cooldown_ms=600_000,
                        probes=1, lease_ms=60_000)


@pytest.fixture
def root() -> Client:
    user = get_user_model().objects.create_superuser("breaker-root", "", "pw-123-secret")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def provider() -> Any:
    return create_provider_key(f"brk-{uuid.uuid4().hex[:8]}", base_url="https://u.example/v1",
                               secret="sk-breaker-admin-secret")


def _open_model(provider_id: int, model: str) -> None:
    store = BreakerStore(get_engine().client)
    result = store.record(provider_id, model, Outcomes(ok=1), Outcomes(failed=1), ONE_CALL)
    assert result.model.transition == "opened"


@pytest.mark.django_db
def test_the_admin_list_and_page_show_each_breaker(root: Client, provider: Any) -> None:
    listed = root.get("/admin/gateway/providerkey/").content.decode()
    assert "Circuit breaker" in listed
    model = f"brk-{uuid.uuid4().hex[:6]}"
    _open_model(provider.pk, model)
    listed = root.get("/admin/gateway/providerkey/").content.decode()
    assert f"OPEN: model {model} until " in listed
    page = root.get(f"/admin/gateway/providerkey/{provider.pk}/change/").content.decode()
    assert "Circuit breakers" in page
    assert f"<td>model {model}</td><td>OPEN</td><td>1 / 1</td>" in page
    assert "<td>key (transport)</td><td>closed</td><td>0 / 1</td><td>-</td>" in page


@pytest.mark.django_db
def test_the_admin_page_still_works_without_redis(root: Client, provider: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from quotas.engine import QuotaStoreUnavailable

    def unreachable(self: Any, provider_key_id: int) -> None:
        raise QuotaStoreUnavailable("injected")

    monkeypatch.setattr(BreakerStore, "snapshots", unreachable)
    page = root.get(f"/admin/gateway/providerkey/{provider.pk}/change/")
    assert page.status_code == 200
    assert "unknown (Redis unreachable)" in page.content.decode()


@pytest.mark.django_db
def test_metrics_show_the_state_gauge_and_transitions(provider: Any) -> None:
    model = "gpt-4o"  # a catalog model: its breaker is a series of its own
    _open_model(provider.pk, model)
    got = samples(metrics.render())
    labels = f'provider_key="{provider.public_id}",model="{model}"'
    assert got[f"tollgate_provider_breaker_state{{{labels}}}"] == 2
    assert got[f'tollgate_provider_breaker_state{{provider_key="{provider.public_id}",'
               f'model="*"}}'] == 0
    assert got[f'tollgate_provider_breaker_transitions_total{{{labels},to="opened"}}'] == 1
    assert got[f'tollgate_provider_breaker_transitions_total{{{labels},to="closed"}}'] == 0


@pytest.mark.django_db
def test_breakers_of_names_outside_the_catalog_are_one_other_series(provider: Any) -> None:
    """A key with a default price serves any model name a client sends, and each name has a
    breaker: /metrics shows them as one `other` series per key (the worst of their states,
    their transitions summed), never a series per name a client made up."""
    names = [f"brk-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for name in names[:2]:
        _open_model(provider.pk, name)
    BreakerStore(get_engine().client).record(provider.pk, names[2], Outcomes(ok=1),
                                             Outcomes(ok=1), ONE_CALL)  # closed
    got = samples(metrics.render())
    other = f'provider_key="{provider.public_id}",model="other"'
    assert got[f"tollgate_provider_breaker_state{{{other}}}"] == 2
    assert got[f'tollgate_provider_breaker_transitions_total{{{other},to="opened"}}'] == 2
    assert got[f'tollgate_provider_breaker_transitions_total{{{other},to="closed"}}'] == 0
    assert not [sample for sample in got if any(name in sample for name in names)]


# -- a probe call that ends without a result hands its slot back (gateway/forward.py) --------------

class HangingTransport(httpx.AsyncBaseTransport):
    """Injected fault: the upstream never answers (the call waits until cancelled)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def _breaker_settings(settings: Any) -> None:
    settings.TOLLGATE_BREAKER_PROBES = 1
    settings.TOLLGATE_BREAKER_COOLDOWN_SECONDS = 0.1
    settings.TOLLGATE_BREAKER_MIN_CALLS = 1


async def _probe_call(rpm_capacity: int | None) -> tuple[Call, Upstream, BreakerStore, Any]:
    """An admitted call whose one provider key has its own breaker past its cool-down (opened
    in Redis, known open in the worker's pool), so the call takes the key's one probe slot."""
    tenant = new_tenant()
    engine = async_engine()
    call = await open_call(engine, tenant, stream=False)
    call.sent = False
    call.ctx.limits = SimpleNamespace(over_quota_policy=None, queue_timeout_seconds=0,
                                      queue_priority=0)
    pid = uuid.uuid4().int % 10**9
    key = Upstream(id=pid, public_id=f"pk_{pid}", base_url="http://upstream.invalid/v1",
                   secret="s", rpm_capacity=rpm_capacity, tpm_capacity=None)
    call.runtime.pool = ProviderPool([key])
    call.runtime.transport = HangingTransport()
    call.runtime.db = DatabaseDown(1)  # the transition's audit row is not this test's concern
    store = BreakerStore(get_engine().client)
    rules = rules_from_settings()
    opened = store.record(pid, "gpt-4o", Outcomes(failed=1), Outcomes(), rules)
    assert opened.key.state == "open"
    await asyncio.sleep(rules.cooldown_ms / 1000 + 0.05)
    call.runtime.pool.open_breaker(pid, KEY_BREAKER, until=time.time() - 1)
    return call, key, store, rules


def test_a_probe_call_without_capacity_hands_its_slot_back(settings: Any) -> None:
    _breaker_settings(settings)

    async def scenario() -> None:
        call, key, store, rules = await _probe_call(rpm_capacity=1)
        assert (await call.runtime.engine.take_capacity(key.id, 1, None, 1)).taken  # all of it
        with pytest.raises(GatewayError):  # (the pool still lists the key resting: 503)
            await _answer(call)
        await settled_background(call)
        # The one slot is free: the next call probes the key (not a lease, 240 s, later).
        assert store.probe(key.id, KEY_LEVEL, rules).granted

    asyncio.run(scenario())


def test_a_probe_call_the_client_leaves_hands_its_slot_back(settings: Any) -> None:
    _breaker_settings(settings)

    async def scenario() -> None:
        call, key, store, rules = await _probe_call(rpm_capacity=None)
        attempt = asyncio.create_task(_answer(call))
        await asyncio.wait_for(call.runtime.transport.entered.wait(), 10)
        assert not store.probe(key.id, KEY_LEVEL, rules).granted  # the call holds the slot
        attempt.cancel()  # the client leaves while the upstream has the call
        with pytest.raises(asyncio.CancelledError):
            await attempt
        await settled_background(call)
        assert store.probe(key.id, KEY_LEVEL, rules).granted
        await call.release(499, "client_gone")
        await settled_background(call)

    asyncio.run(scenario())
