"""The per-process state of a gateway worker, built on its first request.

Django's ASGI handler has no lifespan hooks, so the first request of each worker process checks
that the quota Redis cannot evict or lose counters (quotas/durability.py), loads the model
catalog and the provider pool (two queries), builds the quota engine and the HTTP client, and
starts the pub/sub listener. Everything here belongs to one event loop.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.utils.module_loading import import_string
from redis.exceptions import RedisError

from gateway.auth import AuthCache, load_key_context
from gateway.catalog import Catalog, load_catalog
from gateway.errors import quota_store_rebuilding, quota_store_unsafe
from gateway.providers import ProviderPool, load_pool
from gateway.upstream_http import make_transport
from gateway.tokens import ensure_encodings_cached
from quotas import durability
from quotas.client import make_async_redis
from quotas.engine import (
    AsyncQuotaEngine,
    EngineSettings,
    QuotaEpochLost,
    Reservation,
    ReserveRequest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class RebuildOutcome(Enum):
    """How a rebuild of lost quota counters went (GatewayRuntime.rebuild_quota)."""

    DONE = "done"  # rebuilt here, or found intact (another process rebuilt them since)
    BUSY = "busy"  # another process holds the tenant's rebuild lock
    FAILED = "failed"  # the rebuild raised (ledger or Redis unreachable): logged


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
    # Rebuilds of lost quota counters running in this worker, by tenant: the tenant's other
    # calls in this worker wait for it instead of each trying (see rebuild_quota).
    rebuilding: dict[str, asyncio.Future[RebuildOutcome]] = field(default_factory=dict)

    def spawn(self, coro_factory: Callable[[], object]) -> None:
        """Run a coroutine detached from the request (draining a stream after the client left,
        settling after a disconnect); keep a reference so it is not garbage collected."""
        task = asyncio.ensure_future(coro_factory())  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def reserve(self, request: ReserveRequest) -> Reservation:
        """engine.reserve, and when Redis has lost the tenant's data (its epoch marker is gone):
        rebuild the counters from the ledger, then reserve again. Nothing is admitted on an
        empty counter: a call that cannot have its counters back in time (another process
        is still rebuilding them after QUOTA_REBUILD_WAIT_SECONDS, or the ledger is unreachable)
        gets 503 quota_store_rebuilding, which the OpenAI SDKs retry after Retry-After."""
        try:
            return await self.engine.reserve(request)
        except QuotaEpochLost as lost:
            outcome = await self.rebuild_quota(lost.tenant)
        if outcome is RebuildOutcome.FAILED:
            raise quota_store_rebuilding()
        if outcome is RebuildOutcome.BUSY:
            # Another process holds the rebuild; a new tenant's takes milliseconds, a large
            # ledger's longer. Retrying the reserve is the wait: while the marker is missing it
            # refuses before writing anything.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + settings.QUOTA_REBUILD_WAIT_SECONDS
            pause = 0.01
            while loop.time() + pause < deadline:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.25)
                try:
                    return await self.engine.reserve(request)
                except QuotaEpochLost:
                    continue
            raise quota_store_rebuilding()
        try:
            return await self.engine.reserve(request)
        except QuotaEpochLost:
            # Lost again between the rebuild and this reserve (another flush): 503, and the
            # next call rebuilds.
            raise quota_store_rebuilding() from None

    async def rebuild_quota(self, tenant: str) -> RebuildOutcome:
        """Rebuild the tenant's counters (settings.QUOTA_REBUILDER, on the database threads: it
        reads the ledger). One rebuild per tenant per worker: the tenant's other calls in this
        worker wait for it; across processes the rebuilder's Redis lock picks one (BUSY here)."""
        running = self.rebuilding.get(tenant)
        if running is None:
            running = asyncio.ensure_future(self._rebuild(tenant))
            self.rebuilding[tenant] = running
            running.add_done_callback(lambda _: self.rebuilding.pop(tenant, None))
        # Shielded: a caller whose client left must not cancel the rebuild for the others.
        return await asyncio.shield(running)

    async def _rebuild(self, tenant: str) -> RebuildOutcome:
        rebuilder = import_string(settings.QUOTA_REBUILDER)
        try:
            result = await self.db.run(rebuilder, tenant)
        except Exception:  # noqa: BLE001 - no ledger, no admission: 503, logged for operators
            log.exception("cannot rebuild the quota counters of tenant %s; its calls get 503 "
                          "until they are rebuilt", tenant)
            return RebuildOutcome.FAILED
        return RebuildOutcome.DONE if result.rebuilt else RebuildOutcome.BUSY

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
            from gateway.listener import start_listener, start_last_used_flusher

            start_listener(runtime)
            start_last_used_flusher(runtime)
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
