"""The gateway's asyncio Redis pool (quotas/client.py _BlockingPool): redis-py's blocking pool with
the common take and give-back done at once. Pinned here on the installed redis-py, on the real
server: the fast path is the one in use, connections are reused, a burst beyond the pool waits
for a freed connection (and gets one), a take that cannot get one in time fails as redis-py's
does, and a connection the server closed is replaced."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.exceptions import ConnectionError

from quotas import client as quota_client
from quotas.client import make_async_redis


def test_the_fast_path_is_in_use() -> None:
    # The redis-py internals it reads exist in the installed version.
    assert quota_client._FAST_POOL


def _pool(url: str, connections: int, timeout: float = 5.0) -> quota_client._BlockingPool:
    client = make_async_redis(url, cluster=False)
    pool = client.connection_pool
    assert isinstance(pool, quota_client._BlockingPool)
    pool.max_connections = connections
    pool.timeout = timeout
    return client


def test_calls_one_at_a_time_reuse_one_connection(redis_url: str) -> None:
    async def scenario() -> None:
        client = _pool(redis_url, 4)
        key = f"pool-test:{uuid.uuid4().hex}"
        for i in range(20):
            await client.set(key, i)
            assert await client.get(key) == str(i)
        pool = client.connection_pool
        assert len(pool._available_connections) + len(pool._in_use_connections) == 1
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_a_burst_beyond_the_pool_waits_for_freed_connections(redis_url: str) -> None:
    async def scenario() -> None:
        client = _pool(redis_url, 2)
        key = f"pool-test:{uuid.uuid4().hex}"
        started = time.monotonic()
        # Each call holds its connection 0.1 s (a BLPOP on an empty list): 8 calls through 2
        # connections take 4 turns.
        results = await asyncio.gather(*(client.blpop([key], timeout=0.1) for _ in range(8)))
        elapsed = time.monotonic() - started
        assert results == [None] * 8
        assert elapsed > 0.35  # at least four turns: the calls waited for freed connections
        pool = client.connection_pool
        assert len(pool._available_connections) == 2 and not pool._in_use_connections
        assert pool._slow_takers == 0
        # Back to the fast path once nobody waits: still two connections, each reused.
        await asyncio.gather(*(client.ping() for _ in range(2)))
        assert len(pool._available_connections) == 2
        await client.aclose()

    asyncio.run(scenario())


def test_many_callers_share_a_small_pool(redis_url: str) -> None:
    async def scenario() -> None:
        client = _pool(redis_url, 3)
        key = f"pool-test:{uuid.uuid4().hex}"

        async def caller() -> None:
            for _ in range(25):
                await client.incr(key)

        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(40))), 30)
        assert await client.get(key) == "1000"
        pool = client.connection_pool
        assert len(pool._available_connections) == 3 and not pool._in_use_connections
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_a_take_that_cannot_get_a_connection_in_time_fails(redis_url: str) -> None:
    async def scenario() -> None:
        client = _pool(redis_url, 1, timeout=0.2)
        key = f"pool-test:{uuid.uuid4().hex}"
        holder = asyncio.ensure_future(client.blpop([key], timeout=1))
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionError, match="No connection available"):
            await client.ping()
        assert await holder is None
        assert await client.ping()  # the freed connection is taken again
        await client.aclose()

    asyncio.run(scenario())


def test_a_connection_the_server_closed_is_replaced(redis_url: str) -> None:
    async def scenario() -> None:
        client = _pool(redis_url, 2)
        await client.client_setname("pool-test-victim")
        victims = [c["id"] for c in await client.client_list()
                   if c.get("name") == "pool-test-victim"]
        other = make_async_redis(redis_url, cluster=False)
        for ident in victims:
            await other.client_kill_filter(_id=ident)
        await other.aclose()
        await asyncio.sleep(0.05)
        # The pooled connection is dead: found so on the take (or retried once), not an error.
        assert await client.ping()
        assert await client.set(f"pool-test:{uuid.uuid4().hex}", 1, ex=5)
        await client.aclose()

    asyncio.run(scenario())
