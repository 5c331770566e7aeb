"""One OS process of the cycle-switch race (tests/quotas/test_cycle_race.py): threads sharing one
synchronous engine reserve a tenant's day and cycle counters, under a CycleSchedule whose switch
falls in the middle of the race, and end their holds.

Runs in a spawned child, so it builds its own Redis client and imports no Django. The test
process fixes the switch once every process is ready (two barriers, the plan in a manager dict),
so the race starts ~1.5 s before the switch whatever the time the processes took to start.

How a thread ends its holds (each thread draws from its own seeded generator):
- churn (before the race's stop): a hold is kept a few milliseconds (now and then ~0.1 s) and
  given back: released, or settled at zero. The windows fill with open holds only, so refusals
  keep coming and going without using the room up;
- across the switch: a hold reserved in the last `fill` part before the switch is kept until
  after it, then settled at its full amount (3 in 4) or given back: these end in the windows
  they were reserved in, after the switch;
- the fill (from the stop): reserve until refused, each hold settled at its full amount. A
  thread's give-backs all come before its final refusal, so after the last refusal of the
  thread that gave back last, nothing is given back and the window ends exactly full.
Actuals are 0 or the hold, so every counter moves by whole holds and a refusal means exactly
no room (the refusing counter reports 0 remaining).
"""
from __future__ import annotations

import random
import threading
import time
from multiprocessing.synchronize import Barrier
from typing import Any

import redis

from quotas.engine import QuotaEngine, Reservation, ReserveRequest, ScopeLimit
from quotas.windows import WindowKind


def _row(rid: str, result: Reservation) -> dict[str, Any]:
    refused = result.refused
    return {
        "rid": rid, "admitted": result.admitted, "outcome": result.outcome.value,
        "granted": result.granted, "server_ms": result.server_time_ms,
        "keys": list(result.hold.counter_keys) if result.hold else [],
        "created_ms": result.hold.created_ms if result.hold else None,
        # per counter, in the request's order (tenant day, tenant cycle): its window and room
        "windows": [c.window.id for c in result.counters],
        "remaining": [c.remaining for c in result.counters],
        "refused": refused.window.kind.value if refused is not None else None,
        "end": None, "actual": None, "crossing": False, "fill": False,
    }


def _sleep_until(engine: QuotaEngine, at_ms: int) -> None:
    while (left := at_ms - engine.clock.now_ms()) > 0:
        time.sleep(min(left, 50) / 1000)


def _task(engine: QuotaEngine, tenant: str, worker: int, n: int, amount: int,
          limits: tuple[ScopeLimit, ...], plan: dict[str, Any]) -> list[dict[str, Any]]:
    rng = random.Random(f"cycle-race-{worker}-{n}")
    switch, fill, stop = plan["switch_ms"], plan["fill_ms"], plan["stop_ms"]
    rows: list[dict[str, Any]] = []
    for i in range(1_000_000):
        rid = f"w{worker}-t{n}-r{i}"
        filling = engine.clock.now_ms() >= stop
        result = engine.reserve(ReserveRequest(tenant, rid, amount, limits,
                                               schedule=plan["schedule"]))
        row = _row(rid, result)
        rows.append(row)
        if not result.admitted:
            if filling:
                return rows  # the fill's end: this thread's last call was refused
            time.sleep(rng.random() * 0.003)
            continue
        at = result.server_time_ms
        if fill <= at < switch:
            row["crossing"] = True
            _sleep_until(engine, switch + rng.randint(20, 300))
            give_back = rng.random() < 0.25
        else:
            roll = rng.random()
            time.sleep(rng.random() * 0.012 if roll < 0.9 else 0.05 + rng.random() * 0.1)
            give_back = not filling and engine.clock.now_ms() < stop
        row["fill"] = filling
        hold = result.hold
        assert hold is not None
        if not give_back:
            row.update(end=engine.settle(hold, amount).outcome, actual=amount)
        elif rng.random() < 0.5:
            row.update(end=engine.release(hold).outcome, actual=0)
        else:
            row.update(end=engine.settle(hold, 0).outcome, actual=0)
    raise AssertionError(f"thread {worker}/{n} was never refused in the fill")


def run(url: str, cluster: bool, tenant: str, worker: int, threads: int, amount: int,
        limits: tuple[ScopeLimit, ...], ready: Barrier, go: Barrier,
        shared: Any) -> list[dict[str, Any]]:
    """`threads` threads reserving `amount` under `limits` through one engine, from the plan's
    start (`shared`: schedule, start_ms, fill_ms, switch_ms, stop_ms; Redis clock) until each
    is refused after the stop. Returns one row per reserve call."""
    client = (redis.RedisCluster if cluster else redis.Redis).from_url(
        url, decode_responses=True, max_connections=threads + 4)
    engine = QuotaEngine(client)
    engine.current_window(WindowKind.DAY)  # learn the Redis clock before the start
    ready.wait()
    go.wait()
    plan = dict(shared)
    _sleep_until(engine, plan["start_ms"])
    results: list[list[dict[str, Any]]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def body(n: int) -> None:
        try:
            results[n] = _task(engine, tenant, worker, n, amount, limits, plan)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    pool = [threading.Thread(target=body, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    client.close()
    if errors:
        raise errors[0]
    return [row for rows in results for row in rows]
