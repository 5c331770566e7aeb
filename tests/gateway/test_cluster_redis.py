"""The gateway's asyncio Redis clients on the 3-node Redis Cluster: a burst of more concurrent
commands than connections waits its turn (as on a standalone Redis) instead of being refused,
and the pub/sub listener subscribes and hears what is published anywhere in the cluster."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio
from asgiref.sync import async_to_sync

from gateway.auth import AuthCache
from gateway.listener import listen
from quotas.client import WaitingRedisCluster, _Turns, make_async_redis
from quotas.invalidation import publish_invalidation
from quotas.keys import PROVIDER_COOLDOWN_CHANNEL
from tests.security.test_auth_and_revocation import FakeRuntime, until

pytestmark = pytest.mark.cluster


def _keys(n: int) -> list[str]:
    """Keys in many slots, so the commands go to every node."""
    run = uuid.uuid4().hex[:8]
    return [f"tg:test:turns:{run}:{i}" for i in range(n)]


def test_redis_py_refuses_a_cluster_command_past_max_connections_at_once(
    redis_cluster_url: str,
) -> None:
    """Why the gateway does not use redis-py's cluster client as it is: with every connection
    of a node in use, the next command raises MaxConnectionsError without waiting (pinned on the
    installed version; a standalone BlockingConnectionPool waits for a free connection)."""

    async def burst() -> list[Any]:
        client = redis.asyncio.RedisCluster.from_url(redis_cluster_url, max_connections=2)
        try:
            await client.initialize()
            return await asyncio.gather(*(client.incr(k) for k in _keys(200)),
                                        return_exceptions=True)
        finally:
            await client.aclose()

    errors = [r for r in async_to_sync(burst)() if isinstance(r, Exception)]
    assert errors and all(isinstance(e, redis.exceptions.MaxConnectionsError) for e in errors)


def test_a_burst_past_max_connections_waits_its_turn_on_the_cluster(
    redis_cluster_url: str, settings: Any,
) -> None:
    """600 concurrent commands and 50 pipelines through a client of 2 connections per node:
    every one answered, in order of the values written."""
    settings.REDIS_MAX_CONNECTIONS = 2
    keys = _keys(600)

    async def burst() -> tuple[list[Any], list[Any], int]:
        client = make_async_redis(redis_cluster_url, cluster=True)
        assert isinstance(client, WaitingRedisCluster)
        try:
            await client.initialize()
            singles = await asyncio.gather(*(client.incrby(k, 2) for k in keys),
                                           return_exceptions=True)

            async def piped(chunk: list[str]) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for k in chunk:
                    pipe.incr(k)
                return await pipe.execute()

            piped_results = await asyncio.gather(
                *(piped(keys[i:i + 12]) for i in range(0, 600, 12)), return_exceptions=True)
            # Private to redis-py (its node pool): read to show no node opened more.
            most = max(len(node._connections) for node in client.get_nodes())
            return singles, piped_results, most
        finally:
            await client.aclose()

    singles, piped_results, most = async_to_sync(burst)()
    assert singles == [2] * 600
    assert piped_results == [[3] * 12] * 50
    assert most <= 2


def test_a_turn_not_given_within_the_timeout_fails_like_the_standalone_pool() -> None:
    """redis-py's BlockingConnectionPool raises ConnectionError('No connection available.')
    after its timeout; so does a turn that does not come."""

    async def scenario() -> tuple[Exception | None, bool]:
        turns = _Turns(1, 0.2)
        holder = asyncio.ensure_future(turns.run(lambda: asyncio.sleep(1.0)))
        await asyncio.sleep(0.05)
        failed: Exception | None = None
        try:
            await turns.run(lambda: asyncio.sleep(0))
        except redis.exceptions.ConnectionError as exc:
            failed = exc
        await holder
        # Given back: the next caller is served at once.
        await turns.run(lambda: asyncio.sleep(0))
        return failed, turns.semaphore.locked()

    failed, locked = async_to_sync(scenario)()
    assert isinstance(failed, redis.exceptions.ConnectionError)
    assert str(failed) == "No connection available."
    assert not locked


@pytest.mark.django_db
def test_the_listener_subscribes_on_the_cluster_and_hears_every_node(
    redis_cluster_url: str, settings: Any,
) -> None:
    """On the cluster the listener subscribed to nothing before (its fresh cluster client had
    no slot map: KeyError, retried every half second, the auth cache never trusted). Now it
    trusts the cache, and hears a numbered invalidation (published by a script on the node of
    the version's slot) and a cooldown (published on another connection)."""
    settings.REDIS_URL = redis_cluster_url
    settings.REDIS_CLUSTER = True
    settings.GATEWAY_AUTH_VERSION_CHECK_SECONDS = 0.2
    runtime = FakeRuntime(AuthCache(3600, lambda prefix: None))  # type: ignore[arg-type]

    async def main() -> None:
        listener = asyncio.ensure_future(listen(runtime))  # type: ignore[arg-type]
        publisher = make_async_redis(redis_cluster_url, cluster=True)
        try:
            assert await until(lambda: runtime.auth.trusted, timeout=10)
            reloads = runtime.reloads
            await asyncio.to_thread(publish_invalidation, "providers", None)
            assert await until(lambda: runtime.reloads > reloads, timeout=10)
            until_s = time.time() + 60
            await publisher.publish(PROVIDER_COOLDOWN_CHANNEL,
                                    json.dumps({"id": 4242, "until": until_s}))
            assert await until(lambda: runtime.pool.cooldowns().get(4242) == until_s, timeout=10)
            assert runtime.auth.trusted
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await publisher.aclose()

    async_to_sync(main)()
