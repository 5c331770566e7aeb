"""An upstream key's queue (lua/provider_take.lua "Queue", quotas/waiting.wait_for_capacity):
callers of several tenants waiting for one provider key's RPM capacity, on the standalone server
and the 3-node cluster: the higher plan first every time, arrival order within a plan, the gate
for callers that do not wait, leaving (the wake skips a dead successor), and a dead head
dropped."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from quotas import keys
from quotas.engine import CapacityWait
from quotas.waiting import QueueTimedOut, QueueTiming, wait_for_capacity
from tests.quotas.test_queue import KINDS, Queue, run, subscriber, until_dead, wake_messages

# One request per second: a drained bucket admits the next waiter each second.
RPM = 60
TIMING = QueueTiming(timeout_s=30.0, head_retry_ms=1000, lease_ms=3000)


def provider_id() -> int:
    return random.randint(10**8, 10**9)


async def drain(q: Queue, key: int) -> None:
    for _ in range(RPM):
        assert (await q.engine.take_capacity(key, RPM, None, 1)).taken
    assert not (await q.engine.take_capacity(key, RPM, None, 1)).taken


def waiter(q: Queue, key: int, rid: str, priority: int, timeout_s: float = 30.0,
           timing: QueueTiming = TIMING) -> asyncio.Task[tuple[Any, int]]:
    wait = CapacityWait(rid, priority, q.engine.clock.now_ms() + int(timeout_s * 1000) + 1000,
                        timing.lease_ms)
    return asyncio.ensure_future(wait_for_capacity(
        q.engine, q.room, key, RPM, None, 1, wait, timing))


async def queued(q: Queue, key: int, count: int) -> None:
    for _ in range(200):
        if await q.client.zcard(keys.provider_queue_key(key)) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} waiters")


@pytest.mark.parametrize("kind", KINDS)
def test_the_higher_plan_is_served_first_every_time(request: pytest.FixtureRequest,
                                                    kind: str) -> None:
    async def scenario(q: Queue) -> None:
        key = provider_id()
        await drain(q, key)
        # Alternate arrivals of a standard tenant (priority 10) and an enterprise one (20).
        arrivals = [("std-0", 10), ("ent-0", 20), ("std-1", 10), ("ent-1", 20), ("std-2", 10),
                    ("ent-2", 20)]
        tasks: dict[str, asyncio.Task[tuple[Any, int]]] = {}
        for n, (rid, priority) in enumerate(arrivals, start=1):
            tasks[rid] = waiter(q, key, rid, priority)
            await queued(q, key, n)
        order = []
        while tasks:
            done, _ = await asyncio.wait(tasks.values(), timeout=5,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "one request per second: one taker at a time"
            (rid,) = [r for r, t in tasks.items() if t in done]
            result, waited_ms = tasks.pop(rid).result()
            assert result.taken and waited_ms > 0
            order.append(rid)
        assert order == ["ent-0", "ent-1", "ent-2", "std-0", "std-1", "std-2"]
        assert await q.client.zcard(keys.provider_waiters_key(key)) == 0

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_caller_that_does_not_wait_never_takes_a_waiters_capacity(
    request: pytest.FixtureRequest, kind: str
) -> None:
    async def scenario(q: Queue) -> None:
        key = provider_id()
        await drain(q, key)
        task = waiter(q, key, "w", 10)
        await queued(q, key, 1)
        await asyncio.sleep(1.1)  # the bucket has a request again: the waiter's
        gated = await q.engine.take_capacity(key, RPM, None, 1, CapacityWait())
        # (the waiter may have taken it already; either way the gate refuses the newcomer)
        assert not gated.taken
        result, _ = await asyncio.wait_for(task, 5)
        assert result.taken

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_leaving_and_timing_out_remove_the_waiter(request: pytest.FixtureRequest,
                                                  kind: str) -> None:
    timing = QueueTiming(timeout_s=0.6, head_retry_ms=200, lease_ms=600)

    async def scenario(q: Queue) -> None:
        key = provider_id()
        await drain(q, key)
        gone = waiter(q, key, "gone", 10)
        await queued(q, key, 1)
        assert q.room.client_left(gone)
        with pytest.raises(asyncio.CancelledError):
            await gone
        await queued(q, key, 0)
        late = waiter(q, key, "late", 10, timeout_s=0.6, timing=timing)
        with pytest.raises(QueueTimedOut):
            await asyncio.wait_for(late, 5)
        assert await q.client.zcard(keys.provider_waiters_key(key)) == 0

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_head_of_a_provider_queue_is_dropped(request: pytest.FixtureRequest,
                                                    kind: str) -> None:
    timing = QueueTiming(timeout_s=20.0, head_retry_ms=200, lease_ms=600)

    async def scenario(q: Queue) -> None:
        key = provider_id()
        await drain(q, key)
        # A waiter of a killed process: queued, never back.
        dead = await q.engine.take_capacity(
            key, RPM, None, 1, CapacityWait("dead", 20, q.engine.clock.now_ms() + 60_000, 600))
        assert dead.queued and dead.queue_head
        live = waiter(q, key, "live", 10, timing=timing)
        result, _ = await asyncio.wait_for(live, 5)
        assert result.taken
        assert await q.client.zrange(keys.provider_queue_key(key), 0, -1) == []

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_leaving_head_of_a_provider_queue_wakes_the_next_live_waiter(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """queue_leave.lua on a provider key's queue: the leaving head's successor is dead (its
    deadline passed), so it is dropped and the live waiter behind it is woken; the arrival
    counter is not deleted with the last waiter (it expires after the last deadline)."""
    async def scenario(q: Queue) -> None:
        key = provider_id()
        await drain(q, key)
        sub = subscriber(request, kind)
        pubsub = sub.pubsub()
        await pubsub.subscribe(keys.QUEUE_WAKE_CHANNEL)
        await pubsub.get_message(timeout=1)
        now = q.engine.clock.now_ms()
        replies = {}
        for rid, deadline in (("head", now + 60_000), ("dead", now + 300), ("live", now + 60_000)):
            replies[rid] = await q.engine.take_capacity(key, RPM, None, 1,
                                                        CapacityWait(rid, 10, deadline, 3000))
            assert replies[rid].queued
        assert replies["head"].queue_head
        await until_dead(q, now + 300)
        await wake_messages(pubsub)
        assert await q.engine.leave_capacity_queue(key, "head", 3000)
        assert await wake_messages(pubsub) == [
            {"w": keys.provider_waiters_key(key), "ids": ["live"]}]
        assert await q.client.zrange(keys.provider_queue_key(key), 0, -1) == ["live"]
        assert await q.client.zrange(keys.provider_waiters_key(key), 0, -1) == ["live"]
        assert await q.engine.leave_capacity_queue(key, "live", 3000)
        ttl = await q.client.pttl(keys.provider_seq_key(key))
        assert 0 < ttl <= 61_000
        await pubsub.aclose()
        await sub.aclose()

    run(request, kind, scenario)
