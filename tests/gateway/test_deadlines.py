"""The gateway's deadlines (gateway/deadlines.py): one timer per loop, asyncio.timeout's
behaviour. Every behaviour test runs against asyncio.timeout_at too, on asyncio's loop and on
uvloop (the gateway's): what the gateway's waits see must be what asyncio's timeouts gave them.
The fault tests of the paths that use them are where they were: a body trickled past its read
deadline (tests/security/test_gateway_input.py), the upstream's read timeouts
(test_upstream_http.py), an upstream that hangs and a stream stalled past the call's deadline
(test_e2e_faults_apis.py)."""
from __future__ import annotations

import asyncio
import gc
import random
import weakref
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


def test_a_deadline_already_past_ends_even_a_block_that_only_yields_once(
        loop_name: str, at: Any) -> None:
    """Expired at the loop's next turn, before the block's own step comes back (asyncio's
    loop would otherwise run that step first: a timer at a past time runs after the ready
    callbacks)."""
    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        try:
            async with at(loop.time() - 1):
                await asyncio.sleep(0)
        except TimeoutError:
            return "timed out"
        return "returned"

    assert _run(loop_name, scenario) == "timed out"


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
    body's, the upstream's: one table, one timer). A wait that timed out did so at its
    deadline, never before it; a wait that ended did so before its deadline. Both hold whatever
    the machine's load: a loop held up past both times runs the earlier one first (a wait
    whose deadline came first cannot end; one whose end came first may still be cut when both
    are due in the same turn, as with asyncio's own). None is left open."""
    rng = random.Random(16)
    plans = [(rng.uniform(0.02, 0.4), rng.uniform(0.02, 0.4)) for _ in range(400)]
    slack = 0.002  # the loops' clock resolution (1 ms), with room for float rounding

    async def one(work: float, limit: float) -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            async with at(began + limit):
                await asyncio.sleep(work)
        except TimeoutError:
            return True, loop.time() - began
        return False, loop.time() - began

    async def scenario() -> tuple[list[tuple[bool, float]], int]:
        results = await asyncio.gather(*(one(work, limit) for work, limit in plans))
        return results, len(_watch_of(asyncio.get_running_loop()).open)

    results, still_open = _run(loop_name, scenario)
    for (work, limit), (timed_out, took) in zip(plans, results):
        if timed_out:
            assert took >= limit - slack, (work, limit, took)
        else:
            assert limit >= work - slack, (work, limit, took)
    assert still_open == 0
    # Both outcomes are exercised (about half of each on a quiet machine; a loop held up by a
    # loaded machine cuts more of the waits whose end and deadline fall in the same turn: 340 of
    # 400 in one CI run, every one of them at its deadline).
    timed_out_count = sum(timed_out for timed_out, _ in results)
    assert 0 < timed_out_count < len(plans)


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


def test_a_closed_loop_is_not_kept_alive(loop_name: str) -> None:
    """The table of watches is keyed weakly by loop, and nothing in a watch holds its loop: a
    loop whose deadlines were left early, its timer still pending, is freed once closed (tests
    and tools run loop after loop)."""
    def one_loop() -> weakref.ref[asyncio.AbstractEventLoop]:
        loop = LOOPS[loop_name]()

        async def scenario() -> None:
            async with deadline_in(100):
                async with deadline_in(50):  # the timer moved earlier: two pending
                    await asyncio.sleep(0)

        loop.run_until_complete(scenario())
        loop.close()
        return weakref.ref(loop)

    gone = [one_loop() for _ in range(3)]
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]
