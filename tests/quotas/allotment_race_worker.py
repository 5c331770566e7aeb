"""One OS process of the allotment races (tests/quotas/test_allotment_race.py): concurrent tasks
that reserve through allotment chains and end their holds every way a call can end.

Runs in a spawned child, so it builds its own Redis client and imports no Django: the test
passes each caller's ScopeLimits (built by quotas.limits.allotment_chain in the test process).
Every task draws from its own seeded random generator, so a failing run can be replayed.
"""
from __future__ import annotations

import asyncio
import random
from multiprocessing.synchronize import Barrier
from typing import Any

import redis.asyncio

from quotas.engine import AsyncQuotaEngine, Hold, Outcome, Phase, ReserveRequest, ScopeLimit

# caller name -> the limits its calls are reserved with
Callers = dict[str, tuple[ScopeLimit, ...]]


def _client(url: str, cluster: bool, connections: int) -> redis.asyncio.Redis:
    kind = redis.asyncio.RedisCluster if cluster else redis.asyncio.Redis
    return kind.from_url(url, decode_responses=True, max_connections=connections)


def _row(rid: str, caller: str, amount: int, least: int, result: Any) -> dict[str, Any]:
    refused = result.refused
    return {
        "rid": rid, "caller": caller, "amount": amount, "least": least,
        "admitted": result.admitted, "granted": result.granted, "outcome": result.outcome.value,
        "keys": list(result.hold.counter_keys) if result.hold else [],
        # the refusing counter: its scope, unit and window kind
        "refused": (refused.scope, refused.unit.value, refused.window.kind.value)
        if refused is not None else None,
        "end": None, "actual": None, "swept_charge": None,
    }


def _actual(rng: random.Random, held: int) -> int:
    """What a call really used: nothing, less than its hold, all of it, or more (an estimate
    that was short)."""
    roll = rng.random()
    if roll < 0.25:
        return 0
    if roll < 0.65:
        return rng.randint(0, held)
    if roll < 0.80:
        return held
    return held + rng.randint(1, max(1, held // 4))


async def _end(engine: AsyncQuotaEngine, rng: random.Random, hold: Hold, row: dict[str, Any]) -> None:
    """Settle (40 %), release (25 %), end late (10 %: a slow call the sweeper takes for dead
    after a second, then settles or releases, correcting the sweep's charge) or abandon (25 %:
    the process 'dies'; the sweep ends it, charging what its phase says: nothing, the whole
    hold, or the input plus a checkpoint)."""
    roll = rng.random()
    if 0.65 <= roll < 0.75:
        await engine.progress(hold, rng.choice([Phase.FORWARDED, Phase.STREAMING]),
                              rng.randint(0, hold.amount))
        await asyncio.sleep(1.2 + rng.random())
        roll = rng.random() * 0.65  # then a settle or a release, as below
    if roll < 0.40:
        actual = _actual(rng, hold.amount)
        result = await engine.settle(hold, actual)
        row.update(end=result.outcome, actual=actual)
        if result.outcome == "corrected":  # a sweeper took it first: it charged actual - charged
            row["swept_charge"] = actual - result.charged
    elif roll < 0.65:
        result = await engine.release(hold)
        row.update(end=result.outcome, actual=0)
        if result.outcome == "corrected":
            row["swept_charge"] = result.released
    else:
        phase = rng.choice([Phase.RESERVED, Phase.FORWARDED, Phase.STREAMING])
        if phase is not Phase.RESERVED:
            await engine.progress(hold, phase, rng.randint(0, hold.amount))
        row.update(end="abandoned", phase=phase.value)


async def _chaos(url: str, cluster: bool, tenant: str, worker: int, tasks: int, rounds: int,
                 max_amount: int, callers: Callers, weights: dict[str, int], barrier: Barrier,
                 seed: int) -> list[dict]:
    client = _client(url, cluster, tasks + 2)
    await client.initialize()
    engine = AsyncQuotaEngine(client)
    names = [name for name in sorted(callers) for _ in range(weights.get(name, 1))]
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

    async def task(n: int) -> list[dict]:
        rng = random.Random(f"{seed}-{worker}-{n}")
        rows = []
        for i in range(rounds):
            caller = rng.choice(names)
            amount = rng.randint(1, max_amount)
            least = amount if rng.random() < 0.5 else rng.randint(1, amount)
            rid = f"w{worker}-t{n}-r{i}"
            result = await engine.reserve(ReserveRequest(
                tenant, rid, amount, callers[caller], min_amount=least,
                input_tokens=rng.randint(0, amount)))
            row = _row(rid, caller, amount, least, result)
            rows.append(row)
            # Holds overlap: each stays open a few milliseconds while the others race.
            await asyncio.sleep(rng.random() * 0.004)
            if result.admitted:
                await _end(engine, rng, result.hold, row)
        return rows

    results = await asyncio.gather(*(task(n) for n in range(tasks)))
    await client.aclose()
    return [row for rows in results for row in rows]


def chaos(url: str, cluster: bool, tenant: str, worker: int, tasks: int, rounds: int,
          max_amount: int, callers: Callers, weights: dict[str, int], barrier: Barrier,
          seed: int) -> list[dict]:
    """`tasks` concurrent tasks of `rounds` reservations each, by random callers (drawn by
    their weights, 1 when not given), of random amounts (1..max_amount, half of them
    shrinkable to the room left), each ended at random."""
    return asyncio.run(_chaos(url, cluster, tenant, worker, tasks, rounds, max_amount, callers,
                              weights, barrier, seed))


# -- the protection race --------------------------------------------------------------------------


async def _flood(url: str, cluster: bool, tenant: str, worker: int, callers: Callers,
                 asks: list[tuple[str, int, int]], flooders: list[str], flood_amount: int,
                 tasks: int, barrier: Barrier, ended: Barrier) -> list[dict]:
    client = _client(url, cluster, tasks + len(asks) + 2)
    await client.initialize()
    engine = AsyncQuotaEngine(client)
    holds: list[Hold] = []
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

    async def ask(i: int, caller: str, amount: int, least: int) -> dict:
        rid = f"w{worker}-a{i}"
        result = await engine.reserve(ReserveRequest(tenant, rid, amount, callers[caller],
                                                     min_amount=least))
        if result.hold:
            holds.append(result.hold)
        return _row(rid, caller, amount, least, result)

    async def flood(n: int) -> list[dict]:
        """Reserve (shrinkable to any room left) until refused: the holds stay open, so a
        refusal means this caller has nothing left to take."""
        caller = flooders[n % len(flooders)]
        rows = []
        for i in range(10_000):
            row = await ask(n * 10_000 + i + 1_000_000, caller, flood_amount, 1)
            rows.append(row)
            if not row["admitted"]:
                assert row["outcome"] == Outcome.QUOTA.value, row
                return rows
        raise AssertionError(f"{caller} was never refused")

    results = await asyncio.gather(
        *(ask(i, caller, amount, least) for i, (caller, amount, least) in enumerate(asks)),
        *(flood(n) for n in range(tasks)))
    rows = [r for part in results for r in (part if isinstance(part, list) else [part])]
    # Every process has decided every call (the test reads the counters now): then end them.
    await asyncio.get_running_loop().run_in_executor(None, ended.wait)
    await asyncio.get_running_loop().run_in_executor(None, ended.wait)
    by_rid = {r["rid"]: r for r in rows}
    rng = random.Random(f"end-{worker}")
    for hold in holds:
        actual = rng.randint(0, hold.amount)
        result = await engine.settle(hold, actual)
        by_rid[hold.request_id].update(end=result.outcome, actual=actual)
    await client.aclose()
    return rows


def flood(url: str, cluster: bool, tenant: str, worker: int, callers: Callers,
          asks: list[tuple[str, int, int]], flooders: list[str], flood_amount: int, tasks: int,
          barrier: Barrier, ended: Barrier) -> list[dict]:
    """Fire `asks` ((caller, amount, least) each, at once) while `tasks` flooding tasks of the
    `flooders` reserve until refused; keep every hold open until the test has read the counters
    (the `ended` barrier, twice: decided, then read), then settle them all below their holds."""
    return asyncio.run(_flood(url, cluster, tenant, worker, callers, asks, flooders,
                              flood_amount, tasks, barrier, ended))
