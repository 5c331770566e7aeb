"""The waiting queue through the engine (lua/reserve.lua "Queue", lua/queue_leave.lua and
quotas/waiting.py), on the standalone server and the 3-node cluster: order, the gate, per-resource
queues, wakes, the bound, a client leaving, a dead head, and what waiting costs Redis."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio

from quotas import keys
from quotas.engine import (
    AsyncQuotaEngine,
    QuotaEngine,
    ConcurrencyLimit,
    Outcome,
    QueueTicket,
    RateLimit,
    Reservation,
    ReserveRequest,
    ScopeLimit,
    Unit,
)
from quotas.waiting import QueueTimedOut, QueueTiming, WaitRoom, listen, wait_in_queue
from quotas.windows import WindowKind
from tests.quotas.conftest import new_tenant

DAY = WindowKind.DAY
KINDS = ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)]
TIMING = QueueTiming(timeout_s=30.0, head_retry_ms=1000, lease_ms=3000)
# Timers far beyond a test: only wakes (settle, release, sweep, an admitted head) move waiters.
WAKES_ONLY = QueueTiming(timeout_s=60.0, head_retry_ms=120_000, lease_ms=240_000)


@dataclass
class Queue:
    """An async engine, this "process's" wait room fed by the wake channel, and one tenant."""

    engine: AsyncQuotaEngine
    client: Any
    room: WaitRoom
    tenant: str = field(default_factory=new_tenant)
    timing: QueueTiming = TIMING

    def ticket(self, *, priority: int = 0, max_waiters: int = 500,
               timeout_s: float | None = None) -> QueueTicket:
        timeout = self.timing.timeout_s if timeout_s is None else timeout_s
        return QueueTicket(priority, self.engine.clock.now_ms() + int(timeout * 1000) + 1000,
                           self.timing.lease_ms, max_waiters)

    def request(self, rid: str, amount: int, limits: tuple[ScopeLimit, ...], *,
                queue: QueueTicket | None = None, **extra: Any) -> ReserveRequest:
        return ReserveRequest(self.tenant, rid, amount, limits, queue=queue, **extra)

    async def arrive(self, request: ReserveRequest) -> asyncio.Task[Reservation] | Reservation:
        """Reserve under the queue policy: the reservation when not queued, else the task of
        the waiter (it waits in this room)."""
        first = await self.engine.reserve(request)
        if first.outcome is not Outcome.QUEUED:
            return first
        return asyncio.ensure_future(wait_in_queue(
            self.engine, self.engine.reserve, request, first, self.room, self.timing))

    async def waiting_ids(self) -> set[str]:
        return set(await self.client.zrange(keys.queue_waiters_key(self.tenant), 0, -1))


def async_client(request: pytest.FixtureRequest, kind: str) -> Any:
    if kind == "cluster":
        return redis.asyncio.RedisCluster.from_url(
            request.getfixturevalue("redis_cluster_url"), decode_responses=True)
    # As the gateway's client (quotas/client.py): a burst waits for a free connection.
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        request.getfixturevalue("redis_url"), max_connections=50, timeout=5,
        decode_responses=True)
    return redis.asyncio.Redis(connection_pool=pool)


def sync_client(request: pytest.FixtureRequest, kind: str) -> Any:
    return request.getfixturevalue(kind)


def subscriber(request: pytest.FixtureRequest, kind: str) -> redis.asyncio.Redis:
    # PUBLISH reaches every node of a cluster: one node's connection hears them all.
    url = request.getfixturevalue("redis_cluster_url" if kind == "cluster" else "redis_url")
    return redis.asyncio.Redis.from_url(url, decode_responses=True)


@asynccontextmanager
async def queue_on(request: pytest.FixtureRequest, kind: str,
                   timing: QueueTiming = TIMING) -> AsyncIterator[Queue]:
    client = async_client(request, kind)
    if kind == "cluster":
        await client.initialize()
    sub = subscriber(request, kind)
    room = WaitRoom()
    ready = asyncio.Event()
    listener = asyncio.ensure_future(listen(sub, room, ready))
    await asyncio.wait_for(ready.wait(), 5)
    try:
        yield Queue(AsyncQuotaEngine(client), client, room, timing=timing)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await sub.aclose()
        await client.aclose()


def run(request: pytest.FixtureRequest, kind: str,
        scenario: Callable[[Queue], Awaitable[None]], timing: QueueTiming = TIMING) -> None:
    async def main() -> None:
        async with queue_on(request, kind, timing) as q:
            await scenario(q)
    asyncio.run(main())


async def next_done(tasks: dict[int, asyncio.Task[Reservation]], timeout: float = 10) -> int:
    done, _ = await asyncio.wait(tasks.values(), timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    assert done, "nobody was admitted"
    (index,) = [i for i, t in tasks.items() if t in done]  # exactly one at a time
    return index


# -- order ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_200_waiters_are_admitted_in_arrival_order(request: pytest.FixtureRequest,
                                                   kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        assert isinstance(holder, Reservation) and holder.admitted
        tasks: dict[int, asyncio.Task[Reservation]] = {}
        for i in range(200):
            task = await q.arrive(q.request(f"w{i}", 10, limits, queue=q.ticket()))
            assert isinstance(task, asyncio.Task), f"waiter {i} was not queued"
            tasks[i] = task
        assert len(await q.waiting_ids()) == 200
        admitted: list[int] = []
        current = holder
        for _ in range(200):
            await q.engine.release(current.hold)  # capacity freed, one hold at a time
            index = await next_done(tasks)
            current = tasks.pop(index).result()
            assert current.admitted and current.granted == 10 and current.queue_wait_ms >= 0
            # Never more held than the limit.
            assert (await q.engine.counter(q.tenant, "tenant")).pending == 10
            admitted.append(index)
        assert admitted == list(range(200))
        await q.engine.release(current.hold)
        counter = await q.engine.counter(q.tenant, "tenant")
        assert (counter.used, counter.pending) == (0, 0)
        assert await q.waiting_ids() == set() and len(q.room) == 0
        # The arrival counter outlives the last deadline it handed out, no longer.
        ttl = await q.client.pttl(keys.queue_seq_key(q.tenant))
        assert 0 < ttl <= WAKES_ONLY.timeout_s * 1000 + 2000

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_a_newcomer_never_overtakes_a_waiter(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 20),)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 15, limits, queue=q.ticket()))
        waiter = await q.arrive(q.request("big", 10, limits, queue=q.ticket()))
        assert isinstance(waiter, asyncio.Task)
        # 5 tokens are free, enough for a small call: it still queues behind the waiter.
        small = await q.engine.reserve(q.request("small", 5, limits, queue=q.ticket()))
        assert small.outcome is Outcome.QUEUED and not small.queue_head
        # A call of a tenant without the queue policy is not gated (and is admitted).
        plain = await q.engine.reserve(q.request("plain", 5, limits))
        assert plain.admitted
        await q.engine.release(plain.hold)
        await q.engine.release(holder.hold)
        big = await asyncio.wait_for(waiter, 10)
        assert big.admitted
        await q.engine.leave_queue(q.tenant, "small", small.queue_key, TIMING.lease_ms)
        await q.engine.release(big.hold)

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_higher_priority_goes_first(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        low = await q.arrive(q.request("low", 10, limits, queue=q.ticket(priority=10)))
        high = await q.arrive(q.request("high", 10, limits, queue=q.ticket(priority=20)))
        assert isinstance(low, asyncio.Task) and isinstance(high, asyncio.Task)
        await q.engine.release(holder.hold)
        tasks = {0: low, 1: high}
        assert await next_done(tasks) == 1
        await q.engine.release(tasks.pop(1).result().hold)
        assert await next_done(tasks) == 0
        await q.engine.release(low.result().hold)

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_random_priorities_are_served_by_priority_then_arrival(request: pytest.FixtureRequest,
                                                               kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)
    rng = random.Random(7)
    priorities = [rng.choice((-5, 0, 10, 20)) for _ in range(40)]

    async def scenario(q: Queue) -> None:
        current = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        assert isinstance(current, Reservation) and current.admitted
        tasks: dict[int, asyncio.Task[Reservation]] = {}
        for i, priority in enumerate(priorities):
            task = await q.arrive(q.request(f"w{i}", 10, limits, queue=q.ticket(priority=priority)))
            assert isinstance(task, asyncio.Task)
            tasks[i] = task
        served = []
        while tasks:
            await q.engine.release(current.hold)
            index = await next_done(tasks)
            current = tasks.pop(index).result()
            served.append(index)
        await q.engine.release(current.hold)
        assert served == sorted(range(len(priorities)), key=lambda i: (-priorities[i], i))

    run(request, kind, scenario, WAKES_ONLY)


# -- per resource, and what is queued -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_project_at_its_limit_does_not_block_another_project(
    request: pytest.FixtureRequest, kind: str
) -> None:
    def limits(project: str, project_limit: int) -> tuple[ScopeLimit, ...]:
        return (ScopeLimit("tenant", DAY, 1000),
                ScopeLimit(f"project:{project}", DAY, project_limit))

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("a-holder", 10, limits("a", 10), queue=q.ticket()))
        waiter = await q.arrive(q.request("a-waiter", 10, limits("a", 10), queue=q.ticket()))
        assert isinstance(waiter, asyncio.Task)
        other = await q.arrive(q.request("b-call", 10, limits("b", 1000), queue=q.ticket()))
        assert isinstance(other, Reservation) and other.admitted
        await q.engine.release(other.hold)
        await q.engine.release(holder.hold)
        assert (await asyncio.wait_for(waiter, 10)).admitted
        await q.engine.release(waiter.result().hold)

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_a_counter_not_queueable_refuses_at_once(request: pytest.FixtureRequest,
                                                 kind: str) -> None:
    pace = ScopeLimit("project:p", WindowKind.MINUTE, 10, queueable=False,
                      reason="spend_rate_exceeded")
    limits = (ScopeLimit("tenant", DAY, 1000), pace)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        refused = await q.engine.reserve(q.request("next", 10, limits, queue=q.ticket()))
        assert refused.outcome is Outcome.QUOTA
        assert refused.refused.reason == "spend_rate_exceeded"
        assert await q.waiting_ids() == set()
        await q.engine.release(holder.hold)

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_concurrency_and_rate_refusals_wait_too(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 1000),)
    gauge = ConcurrencyLimit("key:k", 1)
    rate = RateLimit("key:r", 1, 600)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("c-holder", 1, limits, concurrency=gauge,
                                          queue=q.ticket()))
        waiter = await q.arrive(q.request("c-waiter", 1, limits, concurrency=gauge,
                                          queue=q.ticket()))
        assert isinstance(waiter, asyncio.Task)
        await q.engine.settle(holder.hold, 1)  # the slot is freed: the settle wakes the waiter
        assert (await asyncio.wait_for(waiter, 5)).admitted
        await q.engine.settle(waiter.result().hold, 1)

        first = await q.arrive(q.request("r1", 1, limits, rates=(rate,), queue=q.ticket()))
        second = await q.arrive(q.request("r2", 1, limits, rates=(rate,), queue=q.ticket()))
        assert isinstance(first, Reservation) and first.admitted
        assert isinstance(second, asyncio.Task)
        # Nobody frees a bucket: the head comes back when its bucket has a request again.
        assert (await asyncio.wait_for(second, 5)).admitted
        await q.engine.settle(first.hold, 1)
        await q.engine.settle(second.result().hold, 1)

    run(request, kind, scenario, WAKES_ONLY)


# -- bounds, leaving, dead waiters ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_queue_is_bounded_per_tenant(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket(max_waiters=3)))
        tasks = [await q.arrive(q.request(f"w{i}", 10, limits, queue=q.ticket(max_waiters=3)))
                 for i in range(3)]
        assert all(isinstance(t, asyncio.Task) for t in tasks)
        full = await q.engine.reserve(q.request("w3", 10, limits, queue=q.ticket(max_waiters=3)))
        assert full.outcome is Outcome.QUEUE_FULL and full.waiters == 3
        assert await q.waiting_ids() == {"w0", "w1", "w2"}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await q.engine.release(holder.hold)

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_waiter_whose_client_left_is_removed(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        gone = await q.arrive(q.request("gone", 10, limits, queue=q.ticket()))
        stays = await q.arrive(q.request("stays", 10, limits, queue=q.ticket()))
        assert isinstance(gone, asyncio.Task) and isinstance(stays, asyncio.Task)
        await asyncio.sleep(0.05)
        assert q.room.client_left(gone)  # what gateway/views.py does on http.disconnect
        with pytest.raises(asyncio.CancelledError):
            await gone
        for _ in range(100):
            if await q.waiting_ids() == {"stays"}:
                break
            await asyncio.sleep(0.02)
        assert await q.waiting_ids() == {"stays"}
        await q.engine.release(holder.hold)
        assert (await asyncio.wait_for(stays, 5)).admitted
        await q.engine.release(stays.result().hold)
        assert (await q.engine.counter(q.tenant, "tenant")).pending == 0

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_head_is_dropped(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)
    timing = QueueTiming(timeout_s=20.0, head_retry_ms=200, lease_ms=600)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        # A waiter of a process that is then SIGKILLed: queued, and never heard of again.
        dead = await q.engine.reserve(q.request("dead", 10, limits, queue=q.ticket()))
        assert dead.outcome is Outcome.QUEUED and dead.queue_head
        live = await q.arrive(q.request("live", 10, limits, queue=q.ticket()))
        assert isinstance(live, asyncio.Task)
        await q.engine.release(holder.hold)
        # The dead head's lease passes; the live waiter drops it and is admitted.
        admitted = await asyncio.wait_for(live, 5)
        assert admitted.admitted
        assert await q.waiting_ids() == set()
        assert await q.client.zcard(dead.queue_key) == 0
        await q.engine.release(admitted.hold)

    run(request, kind, scenario, timing)


@pytest.mark.parametrize("kind", KINDS)
def test_a_waiter_times_out_and_leaves(request: pytest.FixtureRequest, kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)
    timing = QueueTiming(timeout_s=0.5, head_retry_ms=200, lease_ms=600)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        waiter = await q.arrive(q.request("waiter", 10, limits, queue=q.ticket()))
        assert isinstance(waiter, asyncio.Task)
        with pytest.raises(QueueTimedOut) as info:
            await asyncio.wait_for(waiter, 5)
        assert info.value.last.refused.scope == "tenant" and info.value.waited_ms >= 500
        assert await q.waiting_ids() == set()
        await q.engine.release(holder.hold)

    run(request, kind, scenario, timing)


# -- wakes and cost -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_settle_publishes_a_wake_only_when_someone_waits(request: pytest.FixtureRequest,
                                                         kind: str) -> None:
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        sub = subscriber(request, kind)
        pubsub = sub.pubsub()
        await pubsub.subscribe(keys.QUEUE_WAKE_CHANNEL)
        await pubsub.get_message(timeout=1)  # the subscribe confirmation

        async def messages() -> list[dict[str, Any]]:
            out = []
            while (m := await pubsub.get_message(ignore_subscribe_messages=True,
                                                 timeout=0.3)) is not None:
                out.append(json.loads(m["data"]))
            return out

        first = await q.engine.reserve(q.request("a", 5, limits))
        await q.engine.settle(first.hold, 0)
        assert await messages() == []  # nobody waits: no wake
        holder = await q.engine.reserve(q.request("b", 10, limits))
        queued = await q.engine.reserve(q.request("c", 5, limits, queue=q.ticket()))
        behind = await q.engine.reserve(q.request("d", 5, limits, queue=q.ticket()))
        assert queued.outcome is behind.outcome is Outcome.QUEUED
        assert queued.queue_head and not behind.queue_head
        await q.engine.release(holder.hold)
        waiters = keys.queue_waiters_key(q.tenant)
        assert await messages() == [{"w": waiters}]  # capacity freed where callers wait
        ticket = dataclasses.replace(q.ticket(), order=queued.queue_order)
        admitted = await q.engine.reserve(q.request("c", 5, limits, queue=ticket))
        assert admitted.admitted
        assert await messages() == [{"w": waiters, "ids": ["d"]}]  # the next head, at once
        await q.engine.leave_queue(q.tenant, "d", behind.queue_key, TIMING.lease_ms)
        await q.engine.release(admitted.hold)
        await pubsub.aclose()
        await sub.aclose()

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_swept_hold_wakes_the_waiter(request: pytest.FixtureRequest, kind: str) -> None:
    """The holder's process died: the sweep ends its hold, and the freed capacity wakes the
    queue (lua/sweep.lua publishes when the tenant has waiters)."""
    limits = (ScopeLimit("tenant", DAY, 10),)
    # A timer far beyond the test: only the sweep's wake can make the waiter try again.
    timing = QueueTiming(timeout_s=30.0, head_retry_ms=120_000, lease_ms=240_000)

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        waiter = await q.arrive(q.request("waiter", 10, limits, queue=q.ticket()))
        assert isinstance(holder, Reservation) and isinstance(waiter, asyncio.Task)
        sync = QuotaEngine(sync_client(request, kind))
        swept = await asyncio.to_thread(sync.sweep, q.tenant, stale_s=0)
        assert [h.request_id for h in swept.swept] == ["holder"]
        admitted = await asyncio.wait_for(waiter, 20)
        assert admitted.admitted and admitted.queue_wait_ms < 120_000
        await q.engine.release(admitted.hold)

    run(request, kind, scenario, timing)


def test_waiting_costs_redis_a_bounded_number_of_commands(request: pytest.FixtureRequest) -> None:
    """200 waiters, nothing freed for 3 seconds: only this process's front waiter of the queue
    calls reserve (once per head_retry_ms); the others cost nothing."""
    limits = (ScopeLimit("tenant", DAY, 10),)
    seconds, waiters = 3.0, 200

    async def scenario(q: Queue) -> None:
        holder = await q.arrive(q.request("holder", 10, limits, queue=q.ticket()))
        tasks = [await q.arrive(q.request(f"w{i}", 10, limits, queue=q.ticket()))
                 for i in range(waiters)]
        before = await q.client.info("commandstats")
        await asyncio.sleep(seconds)
        after = await q.client.info("commandstats")
        calls = {name: after[name]["calls"] - before.get(name, {"calls": 0})["calls"]
                 for name in after}
        calls["cmdstat_info"] -= 1  # the second INFO
        round_trips = sum(n for name, n in calls.items()
                          if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_info"))
        per_waiter_s = round_trips / waiters / seconds
        total_per_waiter_s = sum(calls.values()) / waiters / seconds
        print(f"\nqueue: {waiters} waiters for {seconds:g} s: {round_trips} script calls, "
              f"{per_waiter_s:.4f} per waiter per second ({total_per_waiter_s:.4f} commands "
              "with those the scripts ran)")
        # One front, one reserve per second: about 3 calls; bounded generously, exactly.
        assert round_trips <= 2 * seconds + 2
        assert per_waiter_s <= 0.01
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await q.engine.release(holder.hold)

    run(request, "standalone", scenario)


# -- a race ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_race_of_queued_calls_keeps_the_money_exact(request: pytest.FixtureRequest,
                                                      kind: str) -> None:
    limit, amount, calls = 50, 10, 60
    limits = (ScopeLimit("tenant", DAY, limit),)
    timing = QueueTiming(timeout_s=4.0, head_retry_ms=200, lease_ms=1000)

    async def one(q: Queue, i: int, rng: random.Random) -> tuple[str, int]:
        req = q.request(f"r{i}", amount, limits, queue=q.ticket(max_waiters=25,
                                                                timeout_s=timing.timeout_s))
        try:
            first = await q.arrive(req)
            result = first if isinstance(first, Reservation) else await first
        except QueueTimedOut:
            return "queue_timeout", 0
        if result.outcome is Outcome.QUEUE_FULL:
            return "queue_full", 0
        assert result.admitted, result
        counter = await q.engine.counter(q.tenant, "tenant")
        assert counter.used + counter.pending <= limit  # never more granted than the limit
        await asyncio.sleep(rng.uniform(0, 0.05))
        actual = rng.randint(0, amount)
        await q.engine.settle(result.hold, actual)
        return "admitted", actual

    async def scenario(q: Queue) -> None:
        rng = random.Random(12)
        outcomes = await asyncio.gather(*(one(q, i, rng) for i in range(calls)))
        kinds = [o for o, _ in outcomes]
        assert set(kinds) <= {"admitted", "queue_timeout", "queue_full"}
        used = sum(a for o, a in outcomes if o == "admitted")
        counter = await q.engine.counter(q.tenant, "tenant")
        assert counter.pending == 0 and counter.used == used <= limit
        # One usage event per admitted call, none for the others.
        assert await q.client.xlen(keys.usage_stream_key(q.tenant)) == kinds.count("admitted")
        assert await q.waiting_ids() == set()
        print(f"\nrace: {dict((k, kinds.count(k)) for k in set(kinds))}")

    run(request, kind, scenario, timing)


# -- calls that can never fit, dead successors, the bound's clean-up, the arrival counter -------


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_that_can_never_fit_is_refused_at_once(request: pytest.FixtureRequest,
                                                      kind: str) -> None:
    """A call bigger than a counter's limit plus credit (a prompt beyond the daily limit, the
    TPM limit, a spend budget) gets that counter's refusal at once: waiting cannot help it, and
    as the head of a queue it would block every call behind it until its timeout."""
    day = ScopeLimit("tenant", DAY, 100, reason="daily_quota_exceeded")
    tpm = ScopeLimit("tenant", WindowKind.MINUTE, 50, reason="tpm_exceeded")
    budget = ScopeLimit("tenant", WindowKind.MONTH, 1000, unit=Unit.MICROS,
                        reason="budget_exceeded")

    async def scenario(q: Queue) -> None:
        # Nobody holds anything: only its size refuses it.
        for rid, amount, limits, extra, reason in (
            ("too-big-day", 150, (day,), {}, "daily_quota_exceeded"),
            ("too-big-min", 200, (day,), {"min_amount": 101}, "daily_quota_exceeded"),
            ("too-big-tpm", 60, (day, tpm), {}, "tpm_exceeded"),
            ("too-dear", 10, (day, budget), {"money_amount": 1001}, "budget_exceeded"),
        ):
            refused = await q.engine.reserve(q.request(rid, amount, limits, queue=q.ticket(),
                                                       **extra))
            assert refused.outcome is Outcome.QUOTA, rid
            assert refused.refused.reason == reason
            assert await q.waiting_ids() == set()
        # A 1-token call of the tenant is not held up behind any of them.
        small = await q.engine.reserve(q.request("small", 1, (day,), queue=q.ticket()))
        assert small.admitted
        await q.engine.release(small.hold)
        # Credit counts: with 60 tokens of credit the 150-token call fits.
        sync = QuotaEngine(sync_client(request, kind))
        await asyncio.to_thread(sync.recharge, q.tenant, day, 60)
        fits = await q.engine.reserve(q.request("fits", 150, (day,), queue=q.ticket()))
        assert fits.admitted
        await q.engine.release(fits.hold)
        # A concurrency cap of 0 never frees a slot: refused at once too.
        closed = await q.engine.reserve(q.request("closed", 1, (day,),
                                                  concurrency=ConcurrencyLimit("key:z", 0),
                                                  queue=q.ticket()))
        assert closed.outcome is Outcome.CONCURRENCY
        assert await q.waiting_ids() == set()
        counter = await q.engine.counter(q.tenant, "tenant")
        assert (counter.used, counter.pending) == (0, 0)

    run(request, kind, scenario, WAKES_ONLY)


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_that_can_never_fit_leaves_the_queue_it_is_in(request: pytest.FixtureRequest,
                                                             kind: str) -> None:
    """Behind a waiter (the gate), or as a waiter whose limit was lowered under it: refused at
    once, out of its queue, and the waiter behind it is the next head (woken)."""
    def limits(limit: int) -> tuple[ScopeLimit, ...]:
        return (ScopeLimit("tenant", DAY, limit),)

    async def scenario(q: Queue) -> None:
        holder = await q.engine.reserve(q.request("holder", 60, limits(100)))
        head = await q.engine.reserve(q.request("head", 50, limits(100), queue=q.ticket()))
        behind = await q.arrive(q.request("behind", 40, limits(100), queue=q.ticket()))
        assert head.outcome is Outcome.QUEUED and head.queue_head
        assert isinstance(behind, asyncio.Task)
        # A newcomer that can never fit is not queued behind them.
        huge = await q.engine.reserve(q.request("huge", 101, limits(100), queue=q.ticket()))
        assert huge.outcome is Outcome.QUOTA and huge.refused.scope == "tenant"
        assert await q.waiting_ids() == {"head", "behind"}
        # The plan now allows 45 a day: the head (50) can never fit any more. Its next try is
        # refused at once, it leaves, and "behind" becomes the head and is woken: the holder
        # ends, and it is admitted.
        ticket = dataclasses.replace(q.ticket(), order=head.queue_order)
        again = await q.engine.reserve(q.request("head", 50, limits(45), queue=ticket))
        assert again.outcome is Outcome.QUOTA
        assert await q.waiting_ids() == {"behind"}
        assert await q.client.zrange(head.queue_key, 0, -1) == ["behind"]
        await q.engine.release(holder.hold)
        admitted = await asyncio.wait_for(behind, 10)
        assert admitted.admitted
        await q.engine.release(admitted.hold)
        assert await q.waiting_ids() == set()

    run(request, kind, scenario, WAKES_ONLY)


async def wake_messages(pubsub: Any) -> list[dict[str, Any]]:
    out = []
    while (m := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3)) is not None:
        out.append(json.loads(m["data"]))
    return out


async def until_dead(q: Queue, deadline_ms: int) -> None:
    """Wait until the Redis clock is past `deadline_ms` (an entry's expiry)."""
    while (await q.client.time())[0] * 1000 <= deadline_ms + 5:
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_a_leaving_head_wakes_the_next_live_waiter(request: pytest.FixtureRequest,
                                                   kind: str) -> None:
    """queue_leave.lua: the successor of a leaving head is a dead entry (its process was
    killed): it is dropped, and the wake goes to the live waiter behind it."""
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        sub = subscriber(request, kind)
        pubsub = sub.pubsub()
        await pubsub.subscribe(keys.QUEUE_WAKE_CHANNEL)
        await pubsub.get_message(timeout=1)
        holder = await q.engine.reserve(q.request("holder", 10, limits))
        head = await q.engine.reserve(q.request("head", 10, limits, queue=q.ticket()))
        short = dataclasses.replace(q.ticket(), deadline_ms=q.engine.clock.now_ms() + 300)
        dead = await q.engine.reserve(q.request("dead", 10, limits, queue=short))
        live = await q.engine.reserve(q.request("live", 10, limits, queue=q.ticket()))
        assert head.queue_head and not dead.queue_head and not live.queue_head
        await until_dead(q, short.deadline_ms)
        await wake_messages(pubsub)
        assert await q.engine.leave_queue(q.tenant, "head", head.queue_key, TIMING.lease_ms)
        assert await wake_messages(pubsub) == [
            {"w": keys.queue_waiters_key(q.tenant), "ids": ["live"]}]
        assert await q.client.zrange(head.queue_key, 0, -1) == ["live"]
        assert await q.waiting_ids() == {"live"}
        assert await q.client.hkeys(keys.queue_member_key(q.tenant)) == ["live"]
        # The woken head has its lease: it must come back within lease_ms.
        expiry = await q.client.zscore(keys.queue_waiters_key(q.tenant), "live")
        assert expiry <= (await q.client.time())[0] * 1000 + TIMING.lease_ms + 1000
        await q.engine.leave_queue(q.tenant, "live", live.queue_key, TIMING.lease_ms)
        await q.engine.release(holder.hold)
        await pubsub.aclose()
        await sub.aclose()

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_the_bound_drops_expired_waiters_from_their_queues(request: pytest.FixtureRequest,
                                                           kind: str) -> None:
    """A full tenant whose waiters are dead (expired, in project a's queue, which nobody visits
    any more): a newcomer of project b removes them with their queue entry and membership, and
    is queued."""
    def limits(project: str) -> tuple[ScopeLimit, ...]:
        return (ScopeLimit("tenant", DAY, 1000), ScopeLimit(f"project:{project}", DAY, 10))

    async def scenario(q: Queue) -> None:
        holders = [await q.engine.reserve(q.request(f"holder-{p}", 10, limits(p)))
                   for p in ("a", "b")]
        short = dataclasses.replace(q.ticket(max_waiters=2),
                                    deadline_ms=q.engine.clock.now_ms() + 300)
        dead = [await q.engine.reserve(q.request(f"dead{i}", 10, limits("a"), queue=short))
                for i in range(2)]
        assert all(d.outcome is Outcome.QUEUED for d in dead)
        await until_dead(q, short.deadline_ms)
        new = await q.engine.reserve(q.request("new", 10, limits("b"),
                                               queue=q.ticket(max_waiters=2)))
        assert new.outcome is Outcome.QUEUED and new.queue_head
        assert await q.client.zrange(dead[0].queue_key, 0, -1) == []
        assert await q.waiting_ids() == {"new"}
        assert await q.client.hkeys(keys.queue_member_key(q.tenant)) == ["new"]
        await q.engine.leave_queue(q.tenant, "new", new.queue_key, TIMING.lease_ms)
        for holder in holders:
            await q.engine.release(holder.hold)

    run(request, kind, scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dropped_slow_head_keeps_its_place_before_newcomers(request: pytest.FixtureRequest,
                                                              kind: str) -> None:
    """A head that came back after its lease was dropped (and the tenant's waiters emptied):
    the arrival counter is not reset, so it registers again ahead of later arrivals."""
    limits = (ScopeLimit("tenant", DAY, 10),)

    async def scenario(q: Queue) -> None:
        holder = await q.engine.reserve(q.request("holder", 10, limits))
        gone = await q.engine.reserve(q.request("gone", 10, limits, queue=q.ticket()))
        slow = await q.engine.reserve(q.request("slow", 10, limits, queue=q.ticket()))
        # "gone" leaves; "slow" becomes the head with a 200 ms lease, and misses it.
        await q.engine.leave_queue(q.tenant, "gone", gone.queue_key, 200)
        await until_dead(q, (await q.client.time())[0] * 1000 + 200)
        # "quick" drops the dead head on its way and waits; admitted, it leaves: nobody waits.
        quick = await q.engine.reserve(q.request("quick", 10, limits, queue=q.ticket()))
        assert quick.outcome is Outcome.QUEUED and quick.queue_head
        assert await q.waiting_ids() == {"quick"}
        await q.engine.release(holder.hold)
        quick_ticket = dataclasses.replace(q.ticket(), order=quick.queue_order)
        quick = await q.engine.reserve(q.request("quick", 10, limits, queue=quick_ticket))
        assert quick.admitted
        assert await q.waiting_ids() == set()
        later = await q.engine.reserve(q.request("later", 10, limits, queue=q.ticket()))
        assert later.outcome is Outcome.QUEUED
        ticket = dataclasses.replace(q.ticket(), order=slow.queue_order)
        back = await q.engine.reserve(q.request("slow", 10, limits, queue=ticket))
        assert back.outcome is Outcome.QUEUED
        assert back.queue_order == slow.queue_order < later.queue_order
        assert back.queue_head
        # The counter outlives no deadline it handed out by much: it has an expiry.
        ttl = await q.client.pttl(keys.queue_seq_key(q.tenant))
        assert 0 < ttl <= TIMING.timeout_s * 1000 + 2000
        for rid, reply in (("slow", back), ("later", later)):
            await q.engine.leave_queue(q.tenant, rid, reply.queue_key, TIMING.lease_ms)
        await q.engine.release(quick.hold)

    run(request, kind, scenario)
