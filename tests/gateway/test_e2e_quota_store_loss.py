"""Redis that forgets is noticed, end to end: running gateways on a Redis of the test's own.

- FLUSHALL mid-day: the next calls get 503 quota_store_rebuilding while another process holds the
  rebuild, then the counters come back from the ledger and no call is admitted beyond the limit.
- /readyz answers 503 on an evicting maxmemory-policy, and (persistence required, as in
  production) on a server without persistence; a worker refuses to meter on such a server, and
  so do the Celery worker and `python -m config.serve`.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.mock_upstream import MockUpstream
from quotas import keys
from quotas.engine import QuotaEngine
from quotas.windows import WindowKind
from tests.gateway.conftest import (
    ROOT,
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    gateway_env,
    start_gateway,
)
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MODEL = "gpt-4o-mini"
LIMIT = 1000


@pytest.fixture
def lonely_gateway(private_redis: PrivateRedis, provider_key: str,  # noqa: F811
                   tmp_path: Path) -> Iterator[GatewayServer]:
    # A call waits this long for another process's rebuild before its 503 (test_e2e_race has
    # a thousand first calls of a new tenant wait for one worker's rebuild).
    server = start_gateway(tmp_path, workers=2, REDIS_URL=private_redis.url,
                           QUOTA_REBUILD_WAIT_SECONDS="0.3")
    yield server
    server.stop()


def forwarded(mock: MockUpstream) -> int:
    """Calls of MODEL the mock upstream has answered so far (any key, any test)."""
    rows = httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]
    return sum(row["requests"] for row in rows if row["model"] == MODEL)


def ask(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, max_tokens=10,
                                          messages=[{"role": "user", "content": "hi"}])


def test_flushall_mid_day_refuses_until_rebuilt_then_admits_only_what_fits(
        lonely_gateway: GatewayServer, private_redis: PrivateRedis,  # noqa: F811
        make_tenant: MakeTenant, mock_upstream: MockUpstream, django_db_blocker: Any) -> None:
    t = make_tenant(tokens_per_day=LIMIT, requests_per_second=-1)
    redis_client = private_redis.client()
    engine = QuotaEngine(redis_client)
    client = client_for(lonely_gateway, t.plaintext, timeout=30)

    # The tenant's first call finds no epoch (a tenant Redis has never seen): rebuilt at once
    # from an empty ledger, and admitted.
    ask(client)
    while engine.counter(t.tag, "tenant").used < 900:
        ask(client)
    used_before = engine.counter(t.tag, "tenant").used

    def drain() -> int:
        return committed(django_db_blocker, lambda: drain_tenant(redis_client, t.tenant_id))

    def ledger_total() -> int:
        return committed(django_db_blocker, lambda: sum(
            r.total_tokens for r in UsageRecord.objects.filter(tenant_id=t.tenant_id)))

    drain()
    assert ledger_total() == used_before

    redis_client.flushall()
    # Another process is rebuilding the tenant, and longer than the call may wait: the call
    # is not admitted on the empty counter, nor forwarded; 503 with Retry-After, which the SDKs
    # retry.
    redis_client.set(keys.rebuild_lock_key(t.tag), "another worker")
    calls_before = forwarded(mock_upstream)
    with pytest.raises(openai.APIStatusError) as info:
        ask(client)
    assert info.value.status_code == 503
    assert info.value.code == "quota_store_rebuilding"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert forwarded(mock_upstream) == calls_before
    day = engine.current_window(WindowKind.DAY)
    assert not redis_client.exists(keys.counter_key(t.tag, "tenant", day.id))

    # The lock is free: the next call rebuilds the counters from the ledger, then is admitted
    # only if it fits in what the day has left.
    redis_client.delete(keys.rebuild_lock_key(t.tag))
    admitted_after, refused = 0, None
    while refused is None:
        try:
            ask(client)
            admitted_after += 1
        except openai.RateLimitError as exc:
            refused = exc
        assert admitted_after < 50  # an empty counter would admit about 50 calls
    assert refused.code == "insufficient_quota"
    counter = engine.counter(t.tag, "tenant")
    assert counter.used <= LIMIT and counter.pending == 0
    # Every call after the flush fitted in what was left before it: about 100 tokens, a few
    # calls of about 18 tokens each.
    assert counter.used - used_before <= LIMIT - used_before
    assert 1 <= admitted_after <= (LIMIT - used_before) // 10
    drain()
    assert ledger_total() == counter.used  # used equals the ledger
    assert engine.has_epoch(t.tag)
    redis_client.close()


def test_readyz_refuses_an_evicting_policy_and_recovers_when_fixed(
        private_redis: PrivateRedis, provider_key: str, tmp_path: Path) -> None:  # noqa: F811
    # One worker, so every probe reaches the same (running) worker: the policy changes under it.
    server = start_gateway(tmp_path, workers=1, REDIS_URL=private_redis.url)
    redis_client = private_redis.client()
    try:
        assert httpx.get(f"{server.url}/readyz", timeout=10).json() == {
            "status": "ok", "redis": "ok", "redis_config": "ok", "cache_redis": "ok",
            "broker": "ok", "database": "ok"}
        redis_client.config_set("maxmemory-policy", "allkeys-lru")
        try:
            ready = httpx.get(f"{server.url}/readyz", timeout=10)
            assert ready.status_code == 503
            assert ready.json() == {
                "status": "unavailable", "redis": "ok", "database": "ok", "cache_redis": "ok",
                "broker": "ok",
                "redis_config": "error: maxmemory-policy allkeys-lru may evict quota counters"}
        finally:
            redis_client.config_set("maxmemory-policy", "noeviction")
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
    finally:
        redis_client.close()
        server.stop()


def test_persistence_required_a_worker_refuses_to_meter_until_it_is_on(
        private_redis: PrivateRedis, provider_key: str, make_tenant: MakeTenant,  # noqa: F811
        tmp_path: Path) -> None:
    # What TOLLGATE_ENV=production turns on by default (tests/quotas/test_durability.py).
    server = start_gateway(tmp_path, workers=1, REDIS_URL=private_redis.url,
                           QUOTA_REDIS_REQUIRE_PERSISTENCE="true")
    redis_client = private_redis.client()
    try:
        t = make_tenant(requests_per_second=-1)
        ready = httpx.get(f"{server.url}/readyz", timeout=10)
        assert ready.status_code == 503
        assert ready.json() == {"status": "unavailable", "redis_config":
                                "error: no persistence (appendonly no, no save points)",
                                "cache_redis": "ok", "broker": "ok"}
        with pytest.raises(openai.APIStatusError) as info:
            ask(client_for(server, t.plaintext, timeout=30))
        assert info.value.status_code == 503 and info.value.code == "quota_store_unsafe"
        assert "no persistence" in server.log.read_text()

        redis_client.config_set("appendonly", "yes")
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        assert ask(client_for(server, t.plaintext, timeout=30)).usage is not None
    finally:
        redis_client.close()
        server.stop()


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "celery", "-A", "config", "worker", "--loglevel", "WARNING"],
    [sys.executable, "-m", "config.serve", "--no-mock", "--no-celery", "--port", "1"],
], ids=["celery-worker", "serve"])
def test_celery_worker_and_serve_refuse_an_evicting_redis(
        private_redis: PrivateRedis, command: list[str]) -> None:  # noqa: F811
    redis_client = private_redis.client()
    redis_client.config_set("maxmemory-policy", "volatile-lru")
    try:
        result = subprocess.run(command, cwd=ROOT, env=gateway_env(REDIS_URL=private_redis.url),
                                capture_output=True, text=True, timeout=120)
    finally:
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.close()
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "maxmemory-policy volatile-lru may evict quota counters" in output
    assert "set maxmemory-policy noeviction" in output
