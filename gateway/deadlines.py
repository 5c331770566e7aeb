"""Deadlines for the gateway's waits: asyncio.timeout's behaviour, with one timer per event loop
instead of one per wait.

Every /v1 call waits under three or four deadlines (its body's read, the call's own deadline,
the upstream's headers, the upstream's body when it is not there yet), and nearly all of them
are left long before they pass. asyncio.timeout arms a loop timer for each and cancels it on the
way out: 4.8-7.7 us a wait warm on this machine (uvloop's call_at and cancel alone are 2.85
us), 14-20 us of a one-client call in its cold caches (docs/benchmarks.md, "one timer per loop
for the call's deadlines"). Here a wait is an entry in the loop's table of open deadlines; one timer per loop
is set for the earliest of them, and moved only when a wait's deadline comes before it (the
waits of one kind all have the same length, so a new one almost never does). When the timer
fires, the entries whose time has come are expired, and the timer is set for the next.

What the caller sees is asyncio.timeout's (Python 3.11's asyncio/timeouts.py, whose cancel
bookkeeping this follows): on expiry the task is cancelled, and the `async with` block ends in
TimeoutError, unless the task was also cancelled from elsewhere meanwhile, in which case the
CancelledError goes on. `expired()` tells whether this deadline fired. A deadline of None
never fires. A deadline fires at most the loop's clock resolution early (1 ms on uvloop), as
the loop runs its own timers: every open deadline due within it expires in the same pass."""
from __future__ import annotations

import asyncio
import math
import weakref
from types import TracebackType


class Deadline:
    """`async with deadline_at(when):` (loop time) or `async with deadline_in(seconds):`."""

    __slots__ = ("_when", "_task", "_cancelling", "_expired", "_watch")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False
        self._watch: _Watch | None = None

    def when(self) -> float | None:
        return self._when

    def expired(self) -> bool:
        """Whether this deadline passed while its block ran (its block then ended in
        TimeoutError, unless the task was cancelled from elsewhere too)."""
        return self._expired

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline must be used inside a task")
        if self._task is not None:
            raise RuntimeError("a deadline is entered once")
        self._task = task
        self._cancelling = task.cancelling()
        if self._when is not None:
            loop = asyncio.get_running_loop()
            watch = self._watch = _watch_of(loop)
            watch.add(self, loop)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        watch = self._watch
        if watch is not None:
            self._watch = None
            watch.open.pop(self, None)
        if self._expired:
            assert self._task is not None
            # As asyncio.Timeout: no cancellation asked since ours, so it is this deadline's.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _expire(self) -> None:
        self._expired = True
        self._watch = None
        assert self._task is not None
        self._task.cancel()


def deadline_at(when: float | None) -> Deadline:
    """A deadline at `when`, on the running loop's clock (loop.time()); None: none."""
    return Deadline(when)


def deadline_in(seconds: float | None) -> Deadline:
    """A deadline `seconds` from now; None: none."""
    if seconds is None:
        return Deadline(None)
    return Deadline(asyncio.get_running_loop().time() + seconds)


class _Watch:
    """One loop's open deadlines (entry -> when) and its one timer, set for the earliest. It
    holds nothing that holds its loop (a TimerHandle does): the table of watches is keyed
    weakly by loop, and a value holding its key would keep every loop a test or a tool ever ran
    alive. So a timer moved earlier is not cancelled: each timer carries the generation it was
    set in, and one that fires after a newer one was set does nothing (a timer is moved only
    when a wait's deadline comes before it, rarely: see the module's docstring)."""

    __slots__ = ("open", "timer_at", "generation")

    def __init__(self) -> None:
        self.open: dict[Deadline, float] = {}
        self.timer_at = math.inf
        self.generation = 0

    def add(self, deadline: Deadline, loop: asyncio.AbstractEventLoop) -> None:
        when = deadline._when
        assert when is not None
        self.open[deadline] = when
        if when < self.timer_at:
            self._set_timer(when, loop)

    def _set_timer(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        self.generation += 1
        self.timer_at = when
        if when <= loop.time():
            # Passed already: at the loop's next turn, as asyncio.timeout does (a timer at a
            # past time would run after the ready callbacks of that turn, on asyncio's loop).
            loop.call_soon(self._fire, self.generation)
        else:
            loop.call_at(when, self._fire, self.generation)

    def _fire(self, generation: int) -> None:
        if generation != self.generation:
            return  # moved since: the newer timer stands
        self.timer_at = math.inf
        loop = asyncio.get_running_loop()
        # As the loop runs its timers: those due within its clock's resolution are due now.
        now = loop.time() + _resolution(loop)
        due = [deadline for deadline, when in self.open.items() if when <= now]
        for deadline in due:
            del self.open[deadline]
            deadline._expire()
        if self.open:
            self._set_timer(min(self.open.values()), loop)


def _resolution(loop: asyncio.AbstractEventLoop) -> float:
    # asyncio's loops say theirs (time.get_clock_info("monotonic")); uvloop counts in ms.
    return getattr(loop, "_clock_resolution", 0.001)


# The running loop's watch: the last one looked up (its loop held weakly), else by loop (tests
# run many loops).
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], _Watch] | None = None
_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = (
    weakref.WeakKeyDictionary())


def _watch_of(loop: asyncio.AbstractEventLoop) -> _Watch:
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = _Watch()
    _last = (weakref.ref(loop), watch)
    return watch
