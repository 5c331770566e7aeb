"""quotas/waiting.py Waiter.wait: the sleep of a call waiting in a queue (no Redis: the wait
itself). A wake and a cancellation (its client left) in the same turn end the wait cancelled:
with asyncio.wait_for (Python 3.11) the wake won, the cancellation was dropped, and the call went
on to reserve and forward for a client that had left."""
from __future__ import annotations

import asyncio

from quotas.waiting import Waiter


def test_woken_it_returns_true_and_consumes_the_wake() -> None:
    async def main() -> None:
        waiter = Waiter("req", "waiters")
        task = asyncio.ensure_future(waiter.wait(5))
        await asyncio.sleep(0)
        waiter.event.set()
        assert await task is True
        assert not waiter.event.is_set()

    asyncio.run(main())


def test_not_woken_it_returns_false_at_its_time() -> None:
    async def main() -> None:
        waiter = Waiter("req", "waiters")
        assert await waiter.wait(0.01) is False

    asyncio.run(main())


def test_a_wake_and_a_cancellation_in_one_turn_end_it_cancelled() -> None:
    async def main() -> None:
        waiter = Waiter("req", "waiters")
        task = asyncio.ensure_future(waiter.wait(5))
        await asyncio.sleep(0)  # the task starts waiting
        await asyncio.sleep(0)  # (and so would wait_for's inner task)
        waiter.event.set()  # its turn came...
        task.cancel()  # ...as its client left (WaitRoom.client_left)
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()

    asyncio.run(main())
