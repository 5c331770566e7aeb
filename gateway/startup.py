"""Building a gateway worker's state (gateway/runtime.py) on its first request.

Django's ASGI handler has no lifespan hooks, so the first request of each worker process checks
that the quota Redis cannot evict or lose counters (quotas/durability.py), loads the model
catalog and the provider pool (two queries), builds the quota engine and the HTTP client, and
starts the background tasks (gateway/listener.py: the pub/sub listener and the last-use writer).
"""
from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import httpx
from django.conf import settings
from redis.exceptions import RedisError

from gateway.auth import AuthCache, load_key_context
from gateway.catalog import load_catalog
from gateway.errors import quota_store_unsafe
from gateway.listener import start_last_used_flusher, start_listener
from gateway.providers import load_pool
from gateway.runtime import Database, GatewayRuntime
from gateway.tokens import ensure_encodings_cached
from gateway.upstream_http import make_transport
from quotas import active, durability
from quotas.client import make_async_redis
from quotas.engine import AsyncQuotaEngine, EngineSettings

log = logging.getLogger(__name__)

_runtime: GatewayRuntime | None = None
_lock: asyncio.Lock | None = None


def _http_client(transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    timeouts = httpx.Timeout(
        connect=settings.GATEWAY_UPSTREAM_CONNECT_TIMEOUT,
        read=settings.GATEWAY_UPSTREAM_READ_TIMEOUT,
        write=settings.GATEWAY_UPSTREAM_CONNECT_TIMEOUT,
        pool=settings.GATEWAY_UPSTREAM_READ_TIMEOUT,
    )
    return httpx.AsyncClient(timeout=timeouts, transport=transport)


async def get_runtime() -> GatewayRuntime:
    global _runtime, _lock
    if _runtime is not None:
        return _runtime
    if _lock is None:
        _lock = asyncio.Lock()
    async with _lock:
        if _runtime is None:
            redis_client = make_async_redis()
            if settings.REDIS_CLUSTER:
                await redis_client.initialize()  # before concurrent use (redis-py cluster)
            await _refuse_unsafe_store(redis_client)
            db = Database(settings.GATEWAY_DB_THREADS)
            await db.run(ensure_encodings_cached)
            transport = make_transport(settings.GATEWAY_UPSTREAM_TRANSPORT,
                                       max_connections=settings.GATEWAY_UPSTREAM_MAX_CONNECTIONS)
            runtime = GatewayRuntime(
                engine=AsyncQuotaEngine(redis_client, EngineSettings.from_django()),
                http=_http_client(transport),
                transport=transport,
                auth=AuthCache(settings.GATEWAY_AUTH_CACHE_SECONDS,
                               lambda prefix: db.run(load_key_context, prefix)),
                catalog=await db.run(load_catalog),
                pool=await db.run(load_pool),
                db=db,
            )
            runtime.upstream_headers = {k.decode(): v.decode()
                                        for k, v in runtime.http.headers.raw}
            runtime.upstream_timeout = runtime.http.timeout.as_dict()
            start_listener(runtime)
            start_last_used_flusher(runtime)
            # The tenants this worker reserved, settled or released for, into the index of
            # active tenants the background jobs visit (quotas/active.py), about once a second.
            runtime.spawn(lambda: active.flush_forever(runtime.engine.flush_active,
                                                       settings.GATEWAY_ACTIVE_FLUSH_SECONDS))
            log.info("gateway worker ready: %d models, %d provider keys",
                     len(runtime.catalog), len(runtime.pool))
            _runtime = runtime
            _tune_gc()
    return _runtime


async def _refuse_unsafe_store(redis_client: Any) -> None:
    """A worker does not start on a quota Redis that may evict or lose counters: every call gets
    503 quota_store_unsafe (and the next call checks again, so fixing the server's configuration
    is enough). An unreachable Redis is not refused here: calls fail closed on their own (or go
    unmetered in fail-open mode), and /readyz keeps checking the configuration."""
    try:
        problems = await durability.acheck(redis_client)
    except (RedisError, OSError) as exc:  # ResponseError is handled inside the check
        log.warning("cannot read the quota Redis's configuration at start-up (%s); /readyz "
                    "checks it", exc)
        return
    if problems:
        for problem in problems:
            log.critical("refusing the quota store: %s", problem)
        await redis_client.aclose()
        raise quota_store_unsafe()


async def store_problems() -> list[durability.Problem]:
    """What is unsafe about the quota Redis, read on a connection of its own (for /readyz in a
    worker that refused to start, hence has no engine)."""
    client = make_async_redis()
    try:
        return await durability.acheck(client)
    finally:
        await client.aclose()


async def flush_active_marks() -> None:
    """At a worker's lifespan shutdown (gateway/asgi.py): the tenants marked since the last
    flush go to the index now, so the jobs need not wait for their full walk to find them."""
    if _runtime is None:
        return
    try:
        await _runtime.engine.flush_active()
    except Exception:  # noqa: BLE001 - the jobs' full walk finds them (quotas/active.py)
        log.warning("could not flush the active-tenant marks at shutdown", exc_info=True)


def _tune_gc() -> None:
    """Per request the gateway allocates thousands of short-lived containers, so the cyclic GC
    ran often and its older generations kept rescanning everything loaded at startup (Django,
    the apps, the caches just built). Freeze that startup heap out of the collector and
    collect the young generation less often; cycles are still collected."""
    threshold = settings.GATEWAY_GC_GEN0_THRESHOLD
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(threshold, gen1, gen2)
