"""Redis clients for the quota engine, built from settings (REDIS_URL, REDIS_CLUSTER).

A standalone server and a Redis Cluster are both supported; the engine takes whichever client
these return. Timeouts are short on purpose: an unreachable quota store must fail the request
fast (HTTP 503), not hang it.
"""
from __future__ import annotations

import redis
import redis.asyncio
from django.conf import settings
from redis.backoff import NoBackoff


def _options(asynchronous: bool = False) -> dict[str, object]:
    # redis-py retries with exponential backoff by default (seconds in all); one immediate retry
    # covers a pooled connection that went stale after a Redis restart, and no more.
    retry_cls = redis.asyncio.retry.Retry if asynchronous else redis.retry.Retry
    return {
        "decode_responses": True,
        "socket_timeout": settings.REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": settings.REDIS_SOCKET_TIMEOUT,
        "retry": retry_cls(NoBackoff(), 1),
    }


def make_redis(url: str | None = None, *, cluster: bool | None = None) -> redis.Redis | redis.RedisCluster:
    url = url or settings.REDIS_URL
    if settings.REDIS_CLUSTER if cluster is None else cluster:
        return redis.RedisCluster.from_url(url, **_options())
    # A blocking pool: under a burst, a request waits (up to the socket timeout) for a free
    # connection instead of failing with "too many connections".
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=settings.REDIS_SOCKET_TIMEOUT,
        **_options())
    return redis.Redis(connection_pool=pool)


def make_async_redis(
    url: str | None = None, *, cluster: bool | None = None
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    url = url or settings.REDIS_URL
    if settings.REDIS_CLUSTER if cluster is None else cluster:
        return redis.asyncio.RedisCluster.from_url(
            url, max_connections=settings.REDIS_MAX_CONNECTIONS, **_options(asynchronous=True))
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=settings.REDIS_SOCKET_TIMEOUT,
        **_options(asynchronous=True))
    return redis.asyncio.Redis(connection_pool=pool)
