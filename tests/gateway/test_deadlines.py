"""The gateway's deadlines (gateway/deadlines.py): one timer per loop, asyncio.timeout's
behaviour. Every behaviour test runs against asyncio.timeout_at too, on asyncio's loop and on
uvloop (the gateway's): what the gateway's waits see must be what asyncio's timeouts gave them.
The fault tests of the paths that use them are where they were: a body trickled past its read
deadline (tests/security/test_gateway_input.py), the upstream's read timeouts
(test_upstream_http.py), an upstream that hangs and a stream stalled past the call's deadline
(test_e2e_faults_apis.py)."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from gateway.deadlines import _watch_of, deadline_at, deadline_in

IMPLEMENTATIONS = {"gateway": deadline_at, "asyncio": asyncio.timeout_at}
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run(loop_name: str, scenario: Callable[[], Any]) -> Any:
    loop = LOOPS[loop_name]()
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.close()


@pytest.fixture(params=sorted(LOOPS))
def loop_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def at(request: pytest.FixtureRequest) -> Callable[[float | None], Any]:
    return IMPLEMENTATIONS[request.param]


def test_a_wait_past_its_deadline_ends_in_timeout_error(loop_name: str, at: Any) -> None:
    async def scenario() -> tuple[bool, float, bool]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = at(began + 0.05)
        timed_out = False
        try:
            async with deadline:
                await asyncio.sleep(5)
        except TimeoutError:
            timed_out = True
        return timed_out, loop.time() - began, deadline.expired()

    timed_out, took, expired = _run(loop_name, scenario)
    assert timed_out and expired
    assert 0.045 <= took < 2.0


def test_a_wait_done_in_time_is_left_as_it_is(loop_name: str, at: Any) -> None:
    async def scenario() -> tuple[str, bool, int]:
        loop = asyncio.get_running_loop()
        async with at(loop.time() + 10) as deadline:
            await asyncio.sleep(0.01)
            got = "done"
        # The gateway's table of open deadlines keeps nothing of a wait that ended.
        return got, deadline.expired(), len(_watch_of(loop).open)

    assert _run(loop_name, scenario) == ("done", False, 0)


def test_none_is_no_deadline(loop_name: str, at: Any) -> None:
    async def scenario() -> bool:
        async with at(None) as deadline:
            await asyncio.sleep(0.02)
        return deadline.expired()

    assert _run(loop_name, scenario) is False


def test_a_deadline_already_past_fires_at_once(loop_name: str, at: Any) -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(TimeoutError):
            async with at(began - 1):
                await asyncio.sleep(5)
        return loop.time() - began

    assert _run(loop_name, scenario) < 1.0


def test_nested_deadlines_each_end_their_own_block(loop_name: str, at: Any) -> None:
    """The inner one passing ends the inner block only; the outer one passing while a later
    inner one is open ends the outer block, and the inner one is not expired."""
    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        seen: list[Any] = []
        async with at(loop.time() + 10) as outer:
            try:
                async with at(loop.time() + 0.03) as inner:
                    await asyncio.sleep(5)
            except TimeoutError:
                seen.append(("inner timed out", inner.expired(), outer.expired()))
            await asyncio.sleep(0.01)  # the outer block goes on
        seen.append(("outer left", outer.expired()))
        try:
            async with at(loop.time() + 0.03) as outer2:
                async with at(loop.time() + 10) as inner2:
                    await asyncio.sleep(5)
        except TimeoutError:
            seen.append(("outer timed out", outer2.expired(), inner2.expired()))
        return seen

    assert _run(loop_name, scenario) == [("inner timed out", True, False),
                                         ("outer left", False),
                                         ("outer timed out", True, False)]


def test_a_cancellation_from_elsewhere_wins_over_the_deadline(loop_name: str, at: Any) -> None:
    """The task cancelled by someone else as well as by its deadline: CancelledError goes on
    (the client left: the call must end as cancelled, not as timed out)."""
    async def waits() -> None:
        loop = asyncio.get_running_loop()
        async with at(loop.time() + 0.02):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                asyncio.current_task().cancel()  # type: ignore[union-attr] - the other party
                raise

    async def scenario() -> str:
        task = asyncio.ensure_future(waits())
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "timed out"
        return "returned"

    assert _run(loop_name, scenario) == "cancelled"


def test_a_cancellation_from_elsewhere_before_the_deadline_stays_a_cancellation(
        loop_name: str, at: Any) -> None:
    async def scenario() -> tuple[str, bool]:
        loop = asyncio.get_running_loop()
        deadline = at(loop.time() + 10)

        async def waits() -> None:
            async with deadline:
                await asyncio.sleep(5)

        task = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled", deadline.expired()
        return "returned", deadline.expired()

    assert _run(loop_name, scenario) == ("cancelled", False)


def test_many_waits_with_mixed_deadlines_expire_exactly_those_past_theirs(
        loop_name: str, at: Any) -> None:
    """400 waits at once, each of a random length under a random deadline (the call's, the
    body's, the upstream's: one table, one timer). Every wait whose deadline comes well before
    its end times out; every wait that ends well before its deadline does not; none is left
    open."""
    rng = random.Random(16)
    plans = [(rng.uniform(0.02, 0.4), rng.uniform(0.02, 0.4)) for _ in range(400)]
    # Waits whose two times are within this of each other could go either way.
    margin = 0.06
    plans = [(work, limit) for work, limit in plans if abs(work - limit) > margin]

    async def one(work: float, limit: float) -> bool:
        loop = asyncio.get_running_loop()
        try:
            async with at(loop.time() + limit):
                await asyncio.sleep(work)
        except TimeoutError:
            return True
        return False

    async def scenario() -> tuple[list[bool], int]:
        results = await asyncio.gather(*(one(work, limit) for work, limit in plans))
        return results, len(_watch_of(asyncio.get_running_loop()).open)

    timed_out, still_open = _run(loop_name, scenario)
    assert timed_out == [limit < work for work, limit in plans]
    assert still_open == 0
    assert 100 < sum(timed_out) < len(plans) - 100  # both outcomes are exercised


def test_the_loop_timer_is_set_for_the_earliest_open_deadline() -> None:
    """One timer per loop: moved earlier by an earlier deadline, never for a later one, and set
    for the next open deadline when it fires."""
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        watch = _watch_of(loop)
        now = loop.time()
        seen = []
        async with deadline_at(now + 10):
            seen.append(watch.timer_at - now)
            async with deadline_at(now + 20):
                seen.append(watch.timer_at - now)
                try:
                    async with deadline_at(now + 0.02):
                        seen.append(watch.timer_at - now)
                        await asyncio.sleep(5)
                except TimeoutError:
                    seen.append(watch.timer_at - now)  # fired: set for the next open one
        return seen

    assert [round(x, 2) for x in _run("uvloop", scenario)] == [10, 10, 0.02, 10]


def test_deadline_in_counts_from_now() -> None:
    async def scenario() -> tuple[float | None, float | None]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        return deadline_in(5).when() - now, deadline_in(None).when()  # type: ignore[operator]

    gap, none = _run("uvloop", scenario)
    assert 4.9 < gap <= 5.0 and none is None


def test_each_loop_has_its_own_table() -> None:
    """Tests and tools run loops one after another (and a worker's threads may run their own):
    a deadline entered on one loop never fires on another."""
    async def scenario() -> tuple[int, bool]:
        loop = asyncio.get_running_loop()
        async with deadline_at(loop.time() + 10) as deadline:
            await asyncio.sleep(0)
            return id(_watch_of(loop)), deadline.expired()

    first, second = _run("uvloop", scenario), _run("asyncio", scenario)
    assert first[0] != second[0] and not first[1] and not second[1]
