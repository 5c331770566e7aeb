"""The async engine, script reloading after NOSCRIPT, and fail-closed when Redis is unreachable."""
from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import pytest
import redis
import redis.asyncio

from config.embedded import free_port
from quotas.client import make_async_redis, make_redis
from quotas.engine import (
    AsyncQuotaEngine,
    QuotaEngine,
    QuotaStoreUnavailable,
    ReserveRequest,
    ScopeLimit,
)
from quotas.windows import WindowKind

LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 100), ScopeLimit("key:k", WindowKind.MONTH, 80))


def async_client(request: pytest.FixtureRequest, kind: str) -> redis.asyncio.Redis:
    if kind == "cluster":
        return redis.asyncio.RedisCluster.from_url(
            request.getfixturevalue("redis_cluster_url"), decode_responses=True)
    return redis.asyncio.Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True)


@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_async_engine_runs_the_same_scripts(
    request: pytest.FixtureRequest, kind: str, tenant: str
) -> None:
    async def scenario() -> None:
        client = async_client(request, kind)
        await client.initialize()
        engine = AsyncQuotaEngine(client)
        results = await asyncio.gather(
            *(engine.reserve(ReserveRequest(tenant, f"r{i}", 10, LIMITS)) for i in range(20))
        )
        admitted = [r for r in results if r.admitted]
        assert len(admitted) == 8  # the monthly key limit of 80 binds first
        assert {r.refused.scope for r in results if not r.admitted} == {"key:k"}
        settled = await asyncio.gather(*(engine.settle(r.hold, 4) for r in admitted[:5]))
        assert all(s.outcome == "settled" for s in settled)
        released = await asyncio.gather(*(engine.release(r.hold) for r in admitted[5:]))
        assert sum(r.released for r in released) == 30
        assert (await engine.release(admitted[0].hold)).outcome == "settled"
        day = await engine.counter(tenant, "tenant")
        assert (day.used, day.pending) == (20, 0)
        await client.aclose()

    asyncio.run(scenario())


def test_scripts_are_reloaded_after_a_script_flush(engine: QuotaEngine, client: redis.Redis, tenant: str) -> None:
    assert engine.reserve(ReserveRequest(tenant, "a", 1, LIMITS)).admitted
    client.script_flush()  # as after a restart or a failover to a replica without the cache
    result = engine.reserve(ReserveRequest(tenant, "b", 1, LIMITS))
    assert result.admitted
    assert engine.settle(result.hold, 1).outcome == "settled"


@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_async_scripts_are_reloaded_after_a_script_flush(
    request: pytest.FixtureRequest, kind: str, tenant: str
) -> None:
    # The async engine sends EVALSHA itself and falls back to redis-py's script object on
    # NOSCRIPT (which loads the script and sends it again): through the gateway's own client.
    url = request.getfixturevalue("redis_cluster_url" if kind == "cluster" else "redis_url")

    async def scenario() -> None:
        client = make_async_redis(url, cluster=kind == "cluster")
        engine = AsyncQuotaEngine(client)
        assert (await engine.reserve(ReserveRequest(tenant, "a", 1, LIMITS))).admitted
        await client.script_flush()  # every node of a cluster
        result = await engine.reserve(ReserveRequest(tenant, "b", 1, LIMITS))
        assert result.admitted
        await client.script_flush()
        assert (await engine.settle(result.hold, 1)).outcome == "settled"
        day = await engine.counter(tenant, "tenant")
        assert (day.used, day.pending) == (1, 1)  # "a" still held, "b" settled at 1
        await client.aclose()

    asyncio.run(scenario())


def test_unreachable_redis_raises_quota_store_unavailable(tenant: str) -> None:
    dead = make_redis(f"redis://127.0.0.1:{free_port()}/0", cluster=False)
    engine = QuotaEngine(dead)
    with pytest.raises(QuotaStoreUnavailable):
        engine.reserve(ReserveRequest(tenant, "a", 1, LIMITS))
    with pytest.raises(QuotaStoreUnavailable):
        engine.sweep(tenant, stale_s=0)


def test_unreachable_redis_async(tenant: str) -> None:
    async def scenario() -> None:
        dead = make_async_redis(f"redis://127.0.0.1:{free_port()}/0", cluster=False)
        with pytest.raises(QuotaStoreUnavailable):
            await AsyncQuotaEngine(dead).reserve(ReserveRequest(tenant, "a", 1, LIMITS))

    asyncio.run(scenario())


def test_a_timeout_mid_call_is_reported_as_unavailable(engine: QuotaEngine, tenant: str) -> None:
    # Fault injection only: the script itself always runs on the real server.
    with mock.patch.object(engine.client, "evalsha", side_effect=redis.TimeoutError("timed out")):
        with pytest.raises(QuotaStoreUnavailable, match="timed out"):
            engine.reserve(ReserveRequest(tenant, "a", 1, LIMITS))
    assert engine.open_hold_ids(tenant) == []


def test_a_reserve_retried_after_a_lost_reply_gets_the_first_calls_hold(
    redis_url: str, tenant: str
) -> None:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # The production client retries once; a reply slower than the socket timeout is "lost".
    client = redis.Redis.from_url(redis_url, socket_timeout=0.3, decode_responses=True,
                                  retry=Retry(NoBackoff(), 1))
    engine = QuotaEngine(client)
    engine.reserve(ReserveRequest(tenant, "warm", 1, LIMITS))  # scripts loaded, clock learnt
    blocker = redis.Redis.from_url(redis_url)
    sleeper = threading.Thread(target=lambda: blocker.execute_command("DEBUG", "SLEEP", "0.5"))
    sleeper.start()
    time.sleep(0.05)  # the server is now busy for 0.5 s: the first reply misses 0.3 s
    result = engine.reserve(ReserveRequest(tenant, "slow", 7, LIMITS))
    sleeper.join()
    assert result.admitted and result.hold.amount == 7
    assert QuotaEngine(blocker).counter(tenant, "tenant").pending == 1 + 7  # held once, not twice
    assert engine.settle(result.hold, 7).outcome == "settled"
