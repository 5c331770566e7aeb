"""The Redis checks of /readyz (gateway/views.py) beyond the quota store's own: the health of a
Redis Cluster's every master, the Django cache's Redis and Celery's broker.

A process serving the ASGI application uses three Redis roles, and any of them down breaks
something it serves: the quota store (every /v1 call), the cache (console and admin logins are
throttled through it, console forms are one-use through it) and the broker (the console and the
management API publish webhook test events and redeliveries). On a single server they may all be
one Redis; with REDIS_CLUSTER they are two or three (settings require CACHE_REDIS_URL and
CELERY_BROKER_URL to name standalone servers), so each is probed on its own and reported by name.

The answers are public (/readyz needs no credentials): an error says what failed, never a
server's address; the addresses go to the log.
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.asyncio
from django.conf import settings

log = logging.getLogger(__name__)

_REDIS_SCHEMES = ("redis", "rediss", "unix")


async def cluster_state(client: redis.asyncio.RedisCluster) -> str:
    """"ok" when every master the client knows answers CLUSTER INFO with cluster_state:ok and
    all 16384 slots served. A master that died makes its slots' tenants fail (their calls get
    503 quota_store_unavailable) while PING on the others still succeeds: this is what sees it."""
    await client.initialize()  # idempotent: the masters are known after it
    failures: list[str] = []
    masters = client.get_primaries()
    for node in masters:
        try:
            info = await client.cluster_info(target_nodes=node)
        except Exception as exc:  # noqa: BLE001 - readiness reports any failure
            log.error("readiness: Redis Cluster master %s: %s", node.name, exc)
            failures.append(f"a master unreachable ({type(exc).__name__})")
            continue
        state = str(info.get("cluster_state", "?"))
        if state != "ok":
            log.error("readiness: Redis Cluster master %s says cluster_state:%s", node.name, state)
            failures.append(f"cluster_state {state}")
        elif int(info.get("cluster_slots_ok", 0)) != 16384:
            log.error("readiness: Redis Cluster master %s: %s of 16384 slots ok", node.name,
                      info.get("cluster_slots_ok"))
            failures.append(f"{info.get('cluster_slots_ok')} of 16384 slots ok")
    if not masters:
        return "error: no master known"
    if failures:
        # Each distinct failure once, with how many masters of how many said it.
        counted = {f: failures.count(f) for f in failures}
        return "error: " + "; ".join(f"{f} on {n} of {len(masters)} masters"
                                     for f, n in counted.items())
    return "ok"


def broker_redis_url(url: str) -> str | None:
    """The broker URL as a redis-py URL, or None when the broker is not Redis. kombu names a
    Unix socket `redis+socket://path` and its database `virtual_host`."""
    parts = urlsplit(url)
    if parts.scheme in _REDIS_SCHEMES:
        return url
    if parts.scheme == "redis+socket":
        query = dict(parse_qsl(parts.query))
        db = query.pop("virtual_host", None) or query.pop("db", None) or "0"
        return f"unix://{parts.path}?{urlencode({**query, 'db': db})}"
    return None


async def ping(url: str, what: str) -> str:
    """PING a standalone Redis on a connection of its own (closed after), within the quota
    store's socket timeout."""
    client = redis.asyncio.Redis.from_url(
        url, socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
        socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT)
    try:
        await client.ping()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure
        log.error("readiness: the %s Redis: %s", what, exc)
        return f"error: {type(exc).__name__}"
    finally:
        await client.aclose()


def _kombu_check(url: str) -> None:
    from kombu import Connection

    # The transport's options as Celery gets them (a Sentinel broker's master name).
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {})
    with Connection(url, connect_timeout=settings.REDIS_SOCKET_TIMEOUT,
                    transport_options=options) as conn:
        # One retry at once (kombu waits 2 s before it by default: a probe must answer fast).
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                               timeout=settings.REDIS_SOCKET_TIMEOUT)


async def broker_state(url: str) -> str:
    """The broker reachable: a Redis broker is PINGed; any other (Sentinel, RabbitMQ: kombu's
    transports) is connected to once, on a thread (kombu is synchronous)."""
    redis_url = broker_redis_url(url)
    if redis_url is not None:
        return await ping(redis_url, "broker")
    try:
        await asyncio.to_thread(_kombu_check, url)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        log.error("readiness: the broker: %s", exc)
        return f"error: {type(exc).__name__}"


async def other_redis_checks() -> dict[str, str]:
    """The cache's Redis and the broker, probed concurrently."""
    cache, broker = await asyncio.gather(ping(settings.CACHE_REDIS_URL, "cache"),
                                         broker_state(settings.CELERY_BROKER_URL))
    return {"cache_redis": cache, "broker": broker}
