"""The waiting queue, process side: callers under the queue policy wait here for their turn.

Redis holds the order (lua/reserve.lua, "Queue"): a queue per refusing resource of a tenant,
ordered by priority, then arrival. This module holds what one process needs to wait cheaply:

- `WaitRoom`: this process's waiters, each with an asyncio event. One subscription per process to
  the wake channel (quotas.keys.QUEUE_WAKE_CHANNEL: gateway/listener.py in a gateway worker,
  `listen` for tools and tests) feeds `WaitRoom.dispatch`: a message naming waiters wakes those
  (they became heads); a message naming only a tenant's waiters key (capacity was freed there)
  wakes this process's front waiter of each of that tenant's queues.
- `wait_turns`: the loop of one waiter (`wait_in_queue` for a tenant's queues,
  `wait_for_capacity` for a provider key's). It tries again only when woken, or on a timer while
  it is the head of its queue or this process's front waiter of it (the safety net for a lost
  wake, a dead head and time-based capacity: a refilling bucket, a new window). Other waiters
  cost Redis nothing while they wait: a local look at the timer, no command.

Redis commands while waiting are therefore bounded by wakes (one per freed capacity, per
process front) plus one reserve per `head_retry_ms` per queue per process, however many wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from quotas import keys
from quotas.engine import (
    AsyncQuotaEngine,
    CapacityResult,
    CapacityWait,
    Outcome,
    Reservation,
    ReserveRequest,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    """One caller waiting in this process: its place as the last reply told it."""

    request_id: str
    waiters_key: str  # the tenant's (or provider key's) waiters key: wakes name it
    queue_key: str = ""
    order: int = 0
    head: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def told(self, turn: Turn) -> None:
        """Where the last attempt put it."""
        self.queue_key, self.order, self.head = turn.queue_key, turn.order, turn.head

    async def wait(self, seconds: float) -> bool:
        """Sleep until woken or `seconds` passed; True if woken (the wake is consumed)."""
        # Not asyncio.wait_for: on Python 3.11 a wake and a cancellation in the same turn (the
        # client left as its turn came) returned True and dropped the cancellation, and the
        # call went on for a client that had left.
        try:
            async with asyncio.timeout(max(0.0, seconds)):
                await self.event.wait()
        except TimeoutError:
            return False
        self.event.clear()
        return True


class WaitRoom:
    """This process's waiters, by request id (one room per event loop: a gateway worker's
    runtime holds one)."""

    def __init__(self) -> None:
        self._waiters: dict[str, Waiter] = {}
        # The task of each waiting call (gateway/views.py cancels it when its client leaves).
        self._tasks: dict[asyncio.Task[Any], Waiter] = {}
        # Clean-ups outliving their call (a leave, a release): referenced until done.
        self._background: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self, request_id: str, waiters_key: str) -> Waiter:
        waiter = Waiter(request_id, waiters_key)
        self._waiters[request_id] = waiter
        task = asyncio.current_task()
        if task is not None:
            self._tasks[task] = waiter
        return waiter

    def leave(self, waiter: Waiter) -> None:
        self._waiters.pop(waiter.request_id, None)
        for task, w in list(self._tasks.items()):
            if w is waiter:
                del self._tasks[task]

    def is_front(self, waiter: Waiter) -> bool:
        """No waiter of this process is ahead of `waiter` in its queue."""
        return not any(w.queue_key == waiter.queue_key and w.order < waiter.order
                       for w in self._waiters.values())

    def fronts(self, waiters_key: str) -> list[Waiter]:
        """This process's front waiter of each queue under `waiters_key`."""
        best: dict[str, Waiter] = {}
        for w in self._waiters.values():
            if w.waiters_key == waiters_key and w.queue_key:
                current = best.get(w.queue_key)
                if current is None or w.order < current.order:
                    best[w.queue_key] = w
        return list(best.values())

    def dispatch(self, data: str | bytes) -> None:
        """A message of the wake channel (never raises: a bad message is logged)."""
        try:
            message = json.loads(data)
            ids = message.get("ids") or []
            waiters_key = str(message["w"])
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring a malformed queue wake: %r", data)
            return
        if ids:
            for request_id in ids:
                waiter = self._waiters.get(str(request_id))
                if waiter is not None:
                    waiter.event.set()
            return
        for waiter in self.fronts(waiters_key):
            waiter.event.set()

    def wake_fronts(self) -> None:
        """Wake every front waiter (after the subscription was lost: wakes may have been)."""
        for waiters_key in {w.waiters_key for w in self._waiters.values()}:
            for waiter in self.fronts(waiters_key):
                waiter.event.set()

    def client_left(self, task: asyncio.Future[Any]) -> bool:
        """The client of `task` left: if the task is still waiting in the queue, cancel it (its
        waiter leaves the queue on the way out, see wait_in_queue). True if it was waiting."""
        if task in self._tasks:
            task.cancel()
            return True
        return False

    def detach(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        future = asyncio.ensure_future(coro)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future


class QueueTimedOut(Exception):
    """The waiter's queue timeout passed before it was admitted; it has left the queue."""

    def __init__(self, last: Any, waited_ms: int) -> None:
        super().__init__(f"waited {waited_ms} ms in the queue")
        self.last = last  # the last queued reply (a Reservation, a CapacityResult): what for
        self.waited_ms = waited_ms


@dataclass(frozen=True)
class QueueTiming:
    timeout_s: float  # how long the caller waits at most (the plan's queue_timeout_seconds)
    head_retry_ms: int  # a head's (or a process's front waiter's) timer
    lease_ms: int  # a head must call again within this (lua/reserve.lua)


@dataclass(frozen=True)
class Turn:
    """What one attempt (a reserve, a capacity take) told a waiter."""

    queued: bool  # still waiting; False: admitted, or refused for good (`value` says which)
    value: Any  # the attempt's result
    queue_key: str = ""
    order: int = 0
    head: bool = False
    retry_after_ms: int = 0  # > 0: time-based capacity (a refilling bucket) comes back then


async def wait_turns(room: WaitRoom, request_id: str, waiters_key: str, first: Turn,
                     attempt: Callable[[], Awaitable[Turn]],
                     leave: Callable[[str], Awaitable[Any]],
                     late: Callable[[Turn], Awaitable[Any]],
                     timing: QueueTiming) -> tuple[Turn, int]:
    """Wait from the queued `first` turn until an attempt ends the wait: (that turn, the ms
    waited). Attempts run when woken, or on the timer while this waiter is the head of its queue
    or this process's front waiter of it. QueueTimedOut after `timing.timeout_s` (having left
    the queue: `leave(queue_key)`). Cancelled: leaves the queue, detached; an attempt in flight
    is followed to its end and handed to `late` (release what it got, or leave)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timing.timeout_s
    retry_s = timing.head_retry_ms / 1000
    waiter = room.enter(request_id, waiters_key)
    current = first
    waiter.told(first)
    ended = False  # nothing of it left in the queue to remove (or someone else removes it)
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            pause = retry_s
            if current.head and current.retry_after_ms > 0:
                pause = min(pause, current.retry_after_ms / 1000)
            woken = await waiter.wait(min(pause, remaining))
            if loop.time() >= deadline:
                break
            if not woken and not (waiter.head or room.is_front(waiter)):
                continue  # not its turn to look: no Redis command
            in_flight = asyncio.ensure_future(attempt())
            try:
                turn = await asyncio.shield(in_flight)
            except asyncio.CancelledError:
                ended = True  # the follow-up owns the clean-up now
                in_flight.add_done_callback(
                    lambda t: t.cancelled() or t.exception() is not None
                    or room.detach(late(t.result())))
                raise
            if turn.queued:
                current = turn
                waiter.told(turn)
                continue
            ended = True
            return turn, int((loop.time() - started) * 1000)
        waited = int((loop.time() - started) * 1000)
        ended = True
        await asyncio.shield(room.detach(_quietly(leave(waiter.queue_key), request_id)))
        raise QueueTimedOut(current.value, waited)
    finally:
        room.leave(waiter)
        if not ended:
            # Cancelled while waiting (the client left), or an attempt failed: leave the queue,
            # detached so that the removal completes whatever happens to this task.
            room.detach(_quietly(leave(waiter.queue_key), request_id))


async def _quietly(work: Awaitable[Any], request_id: str) -> None:
    try:
        await work
    except Exception:  # noqa: BLE001 - the entry's expiry bounds what a failed clean-up leaves
        log.warning("could not clean up after waiter %s", request_id, exc_info=True)


def _reserve_turn(reservation: Reservation) -> Turn:
    if reservation.outcome is not Outcome.QUEUED:
        return Turn(False, reservation)
    return Turn(True, reservation, reservation.queue_key, reservation.queue_order or 0,
                reservation.queue_head, reservation.retry_after_ms)


async def wait_in_queue(engine: AsyncQuotaEngine,
                        reserve: Callable[[ReserveRequest], Awaitable[Reservation]],
                        request: ReserveRequest, first: Reservation, room: WaitRoom,
                        timing: QueueTiming) -> Reservation:
    """Wait in the tenant queue `first` (a QUEUED reply to `request`) put the call in, until
    reserve admits it or refuses it for good (returned, with queue_wait_ms), or the timeout
    passes (QueueTimedOut, after leaving the queue). Cancelled (the client left): leaves the
    queue, and a reserve in flight is followed to its end (its hold released if it admitted)."""
    assert request.queue is not None and first.outcome is Outcome.QUEUED
    request = replace(request, queue=replace(request.queue, order=first.queue_order))

    async def attempt() -> Turn:
        return _reserve_turn(await reserve(request))

    async def leave(queue_key: str) -> None:
        await engine.leave_queue(request.tenant, request.request_id, queue_key, timing.lease_ms)

    async def late(turn: Turn) -> None:
        reservation: Reservation = turn.value
        if reservation.hold is not None:  # admitted after its client left: nobody uses it
            await engine.release(reservation.hold, json.dumps({"reason": "client_gone"}))
        elif turn.queued:
            await leave(turn.queue_key)

    turn, waited_ms = await wait_turns(
        room, request.request_id, keys.queue_waiters_key(request.tenant), _reserve_turn(first),
        attempt, leave, lambda t: _quietly(late(t), request.request_id), timing)
    return replace(turn.value, queue_wait_ms=waited_ms)


def _capacity_turn(result: CapacityResult) -> Turn:
    if not result.queued:
        return Turn(False, result)
    return Turn(True, result, result.queue_key, result.queue_order, result.queue_head,
                result.retry_after_ms)


async def wait_for_capacity(engine: AsyncQuotaEngine, room: WaitRoom, provider_key_id: int,
                            rpm: int | None, tpm: int | None, tokens: int, wait: CapacityWait,
                            timing: QueueTiming) -> tuple[CapacityResult, int]:
    """Queue for an upstream key's RPM / TPM capacity (lua/provider_take.lua, "Queue") and wait
    for it: (the result that ended the wait, ms waited). Taken at once: waited 0. Ordered by
    plan priority, then arrival, across tenants; the head comes back after the buckets'
    retry_after_ms or when the head before it took capacity. QueueTimedOut after the timeout
    (having left the queue)."""
    first = await engine.take_capacity(provider_key_id, rpm, tpm, tokens, wait)
    if not first.queued:
        return first, 0
    wait = CapacityWait(wait.waiter_id, wait.priority, wait.deadline_ms, wait.lease_ms,
                        first.queue_order)

    async def attempt() -> Turn:
        return _capacity_turn(await engine.take_capacity(provider_key_id, rpm, tpm, tokens, wait))

    async def leave(_queue_key: str) -> None:
        await engine.leave_capacity_queue(provider_key_id, wait.waiter_id, timing.lease_ms)

    async def late(turn: Turn) -> None:
        # Capacity taken after its client left is spent (buckets give nothing back); a waiter
        # still queued leaves.
        if turn.queued:
            await leave(turn.queue_key)

    turn, waited_ms = await wait_turns(
        room, wait.waiter_id, keys.provider_waiters_key(provider_key_id), _capacity_turn(first),
        attempt, leave, lambda t: _quietly(late(t), wait.waiter_id), timing)
    return turn.value, waited_ms


async def listen(client: Any, room: WaitRoom, ready: asyncio.Event | None = None) -> None:
    """Feed `room` from the wake channel on `client` until cancelled (tools and tests; a gateway
    worker's listener subscribes once for everything, gateway/listener.py)."""
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(keys.QUEUE_WAKE_CHANNEL)
        if ready is not None:
            ready.set()
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None and message["type"] == "message":
                room.dispatch(message["data"])
    finally:
        with contextlib.suppress(Exception):
            await pubsub.aclose()
