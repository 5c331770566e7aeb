"""The per-process state of a gateway worker, built on its first request.

Django's ASGI handler has no lifespan hooks, so the first request of each worker process loads
the model catalog and the provider pool (two queries), builds the quota engine and the HTTP
client, and starts the pub/sub listener. Everything here belongs to one event loop.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection

from gateway.auth import AuthCache, load_key_context
from gateway.catalog import Catalog, load_catalog
from gateway.providers import ProviderPool, load_pool
from gateway.upstream_http import make_transport
from gateway.tokens import ensure_encodings_cached
from quotas.client import make_async_redis
from quotas.engine import AsyncQuotaEngine, EngineSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class Database:
    """Runs ORM work off the event loop on a few long-lived threads, each with its own
    connection. Django's per-request thread (sync_to_async under ASGI) would open a connection
    per concurrent request and exhaust PostgreSQL under a burst."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="gateway-db")

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        def job() -> T:
            close_old_connections()
            try:
                return work(*args)
            except (InterfaceError, OperationalError):
                # A connection that died with a database restart fails its first query; a
                # fresh one works as soon as the database is back.
                connection.close()
                return work(*args)

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)


@dataclass
class GatewayRuntime:
    engine: AsyncQuotaEngine
    http: httpx.AsyncClient
    # The client's transport, called directly on the hot path (gateway/forward.py).
    transport: httpx.AsyncBaseTransport
    auth: AuthCache
    catalog: Catalog
    pool: ProviderPool
    db: Database
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # The upstream client's default headers (as sent) and timeouts, for building requests
    # directly (gateway/forward.py); the client has no base URL, cookies or params to merge.
    upstream_headers: dict[str, str] = field(default_factory=dict)
    upstream_timeout: dict[str, float | None] = field(default_factory=dict)
    used_keys: set[int] = field(default_factory=set)  # API key ids used since the last flush

    def spawn(self, coro_factory: Callable[[], object]) -> None:
        """Run a coroutine detached from the request (draining a stream after the client left,
        settling after a disconnect); keep a reference so it is not garbage collected."""
        task = asyncio.ensure_future(coro_factory())  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def reload_catalog(self) -> None:
        self.catalog = await self.db.run(load_catalog)

    async def reload_pool(self) -> None:
        fresh = await self.db.run(load_pool)
        # Cooldowns learnt so far still hold for the same keys.
        for upstream_id, until in self.pool.cooldowns().items():
            fresh.cool_down(upstream_id, until)
        self.pool = fresh


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
            db = Database(settings.GATEWAY_DB_THREADS)
            await db.run(ensure_encodings_cached)
            redis_client = make_async_redis()
            transport = make_transport(settings.GATEWAY_UPSTREAM_TRANSPORT,
                                       max_connections=settings.GATEWAY_UPSTREAM_MAX_CONNECTIONS)
            if settings.REDIS_CLUSTER:
                await redis_client.initialize()  # before concurrent use (redis-py cluster)
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
            from gateway.listener import start_listener, start_last_used_flusher

            start_listener(runtime)
            start_last_used_flusher(runtime)
            log.info("gateway worker ready: %d models, %d provider keys",
                     len(runtime.catalog), len(runtime.pool))
            _runtime = runtime
            _tune_gc()
    return _runtime


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
