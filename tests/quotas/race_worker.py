"""One OS process of the reservation race: many concurrent reservations through the async engine,
then, once every process has reserved, settle or release what it was granted.

Runs in a spawned child, so it builds its own Redis client and imports no Django.
"""
from __future__ import annotations

import asyncio
from multiprocessing.synchronize import Barrier

import redis.asyncio

from quotas.engine import (
    AsyncQuotaEngine,
    ConcurrencyLimit,
    RateLimit,
    ReserveRequest,
    ScopeLimit,
)


def actual_for(request_id: str, held: int) -> int:
    """Deterministic 'real usage' of a request, at most its hold."""
    return held - (sum(map(ord, request_id)) % (held // 2))


async def _race(url: str, cluster: bool, tenant: str, worker: int, n: int, amount: int,
                limits: tuple[ScopeLimit, ...], barrier: Barrier, rates: tuple[RateLimit, ...],
                concurrency: ConcurrencyLimit | None) -> list[tuple[str, bool, int, str]]:
    client = (redis.asyncio.RedisCluster if cluster else redis.asyncio.Redis).from_url(
        url, decode_responses=True, max_connections=n)
    await client.initialize()
    engine = AsyncQuotaEngine(client)
    requests = [ReserveRequest(tenant, f"w{worker}-r{i}", amount, limits, rates=rates,
                               concurrency=concurrency) for i in range(n)]
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    results = await asyncio.gather(*(engine.reserve(r) for r in requests))
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

    async def finish(index: int, result) -> str:
        if not result.admitted:
            return f"refused:{result.outcome}"
        if index % 3 == 0:
            return (await engine.release(result.hold)).outcome
        return (await engine.settle(result.hold, actual_for(result.request_id, result.granted))).outcome

    outcomes = await asyncio.gather(*(finish(i, r) for i, r in enumerate(results)))
    await client.aclose()
    return [(r.request_id, r.admitted, r.granted, o) for r, o in zip(results, outcomes, strict=True)]


def run(url: str, cluster: bool, tenant: str, worker: int, n: int, amount: int,
        limits: tuple[ScopeLimit, ...], barrier: Barrier, rates: tuple[RateLimit, ...] = (),
        concurrency: ConcurrencyLimit | None = None) -> list[tuple[str, bool, int, str]]:
    return asyncio.run(_race(url, cluster, tenant, worker, n, amount, limits, barrier, rates,
                             concurrency))
