"""The per-process state of a gateway worker: the quota engine, the upstream HTTP client, the
auth cache, the catalog, the provider pool and the database threads, with the reserve that
rebuilds lost counters. Built on the worker's first request by gateway/startup.py; everything
here belongs to one event loop.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import httpx
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.utils.module_loading import import_string

from gateway import metrics
from gateway.auth import AuthCache
from gateway.catalog import Catalog, load_catalog
from gateway.errors import GatewayError, quota_store_rebuilding, spend_rate_exceeded
from gateway.providers import ProviderPool, load_pool
from gateway.request_context import in_thread
from quotas.engine import (
    AsyncQuotaEngine,
    QuotaEpochLost,
    QuotaStoreUnavailable,
    Reservation,
    ReserveRequest,
    SentReserve,
)
from quotas.limits import SPEND_RATE_EXCEEDED
from quotas.pace import AsyncPaceBreaker, paced_of
from quotas.waiting import WaitRoom

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

        # In the caller's context: a request's work logs with its ids (a rebuild's lines).
        return await in_thread(self._executor, job)


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
    # Of those, the worker's own loops (spawn: the listener, the flushers), which a stopping
    # worker cancels; the rest is the calls' detached work, which it waits for.
    loops: set[asyncio.Task[Any]] = field(default_factory=set)
    # The upstream client's default headers (as sent) and timeouts, for building requests
    # directly (gateway/forward.py); the client has no base URL, cookies or params to merge.
    upstream_headers: dict[str, str] = field(default_factory=dict)
    upstream_timeout: dict[str, float | None] = field(default_factory=dict)
    used_keys: set[int] = field(default_factory=set)  # API key ids used since the last flush
    # Rebuilds of lost quota counters running in this worker, by tenant: the tenant's other
    # calls in this worker wait for it instead of each trying (see rebuild_quota).
    rebuilding: dict[str, asyncio.Future[RebuildOutcome]] = field(default_factory=dict)
    _pace: AsyncPaceBreaker | None = None  # made on the first pace refusal
    # Calls waiting in the queue policy's queue, woken by the listener (quotas/waiting.py).
    waiting: WaitRoom = field(default_factory=WaitRoom)

    def spawn(self, coro_factory: Callable[[], object]) -> asyncio.Task[Any]:
        """Run a task of the worker's, not of a request (the listener, the flushers, a breaker
        transition's publish and audit), referenced like `detach`'s. It starts in an empty
        context: made from within the request that happened to need it first, it would
        otherwise carry that request's ids (gateway/request_context.py) in every log line and
        span for the worker's life. A call's own detached work (its settle, a stream's drain)
        goes through `detach` and keeps the call's ids."""
        task = asyncio.get_running_loop().create_task(
            coro_factory(), context=contextvars.Context())  # type: ignore[arg-type]
        self.background.add(task)
        self.loops.add(task)
        task.add_done_callback(self.background.discard)
        task.add_done_callback(self.loops.discard)
        return task

    def detach(self, coro: Coroutine[Any, Any, T] | asyncio.Future[T]) -> asyncio.Future[T]:
        """Run `coro` (or keep an existing task) detached from the request: no client leaving
        can cancel it, and it is referenced in `background` until it finishes, so it is not
        garbage collected mid-way (draining a stream, ending a hold, a checkpoint)."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    @property
    def detached(self) -> set[asyncio.Future[Any]]:
        """The calls' own detached work still running (detach: ends of holds and their retries,
        stream drains, checkpoints, breaker records): what a stopping worker waits for
        (gateway/shutdown.py). Derived from `background`, so a call's detach stays one set add."""
        return self.background - self.loops

    async def reserve(self, request: ReserveRequest, sent: SentReserve | None = None,
                      ) -> Reservation:
        """engine.reserve (see _reserve); a refusal by a pace counter trips the scope's burn-rate
        breaker and raises 429 spend_rate_exceeded at once, whatever the plan's over-quota
        policy: waiting, a soft ceiling or a cheaper model cannot help a scope that is closed.
        `sent`: this request's script call already written (send_reserve), whose reply this
        waits for."""
        reservation = await self._reserve(request, sent)
        refused = reservation.refused
        if refused is not None and refused.reason == SPEND_RATE_EXCEEDED and not request.dry_run:
            raise await self._pace_tripped(request, reservation)
        return reservation

    async def _pace_tripped(self, request: ReserveRequest, reservation: Reservation,
                            ) -> GatewayError:
        """Trip the refused scope's breaker (lua/pace_trip.lua: one more script call, on this
        refusal path only; idempotent while the trip lasts) and the 429 to answer, with
        Retry-After until the cool-down ends."""
        refused = reservation.refused
        assert refused is not None
        paced = paced_of(request.limits, refused.scope)
        now_ms = reservation.server_time_ms
        retry_after_ms = refused.window.end_ms - now_ms
        kind = refused.scope.split(":", 1)[0]
        owner = f"{kind} {paced[0].label!r}" if paced and paced[0].label else refused.scope
        if paced:
            if self._pace is None:
                self._pace = AsyncPaceBreaker(self.engine.client)
            try:
                trip = await self._pace.trip(request.tenant, paced, now_ms)
            except QuotaStoreUnavailable:
                # The refusal stands (the counter is full); the trip is recorded by the next.
                log.warning("could not trip the pace breaker of %s (tenant %s)", refused.scope,
                            request.tenant, exc_info=True)
            else:
                retry_after_ms = trip.until_ms - now_ms
                if trip.first:
                    log.warning("pace breaker tripped: tenant %s, %s %s (%s) until %d",
                                request.tenant, paced[0].owner, owner, paced[0].rule,
                                trip.until_ms)
        return spend_rate_exceeded(owner, max(1, -(-retry_after_ms // 1000)))

    def send_reserve(self, request: ReserveRequest) -> SentReserve | None:
        """The engine's send_reserve: `request`'s script call written to Redis now, for
        reserve(request, sent) to wait for; None when it goes the usual way. A failure to
        write it is logged and the reserve goes the usual way too (which reports it)."""
        try:
            return self.engine.send_reserve(request)
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("writing the reserve of %s at once failed; it goes the usual way",
                          request.request_id)
            return None

    async def _reserve(self, request: ReserveRequest, sent: SentReserve | None = None,
                       ) -> Reservation:
        """engine.reserve, and when Redis has lost the tenant's data (its epoch marker is gone):
        rebuild the counters from the ledger, then reserve again. Nothing is admitted on an
        empty counter: a call that cannot have its counters back in time (another process
        is still rebuilding them after QUOTA_REBUILD_WAIT_SECONDS, or the ledger is unreachable)
        gets 503 quota_store_rebuilding, which the OpenAI SDKs retry after Retry-After."""
        try:
            return await self._engine_reserve(request, sent)
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
                    return await self._engine_reserve(request)
                except QuotaEpochLost:
                    continue
            raise quota_store_rebuilding()
        try:
            return await self._engine_reserve(request)
        except QuotaEpochLost:
            # Lost again between the rebuild and this reserve (another flush): 503, and the
            # next call rebuilds.
            raise quota_store_rebuilding() from None

    async def _engine_reserve(self, request: ReserveRequest, sent: SentReserve | None = None,
                              ) -> Reservation:
        """The reserve's round trip, its latency counted (tollgate_redis_duration_seconds) when
        it answers. For one already `sent`: from its write to its reply's arrival (Sent.round_trip:
        the loop's reading of it, not this task's turn after it, behind other calls' steps)."""
        if sent is None:
            began = time.perf_counter()
            reservation = await self.engine.reserve(request)
            metrics.observe(metrics.REDIS_RESERVE, time.perf_counter() - began)
        else:
            reservation = await self.engine.reserve(request, sent)
            metrics.observe(metrics.REDIS_RESERVE, sent.sent.round_trip())
        return reservation

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
        # Cooldowns and open breakers learnt so far still hold for the same keys.
        fresh.adopt_resting(self.pool)
        self.pool = fresh
