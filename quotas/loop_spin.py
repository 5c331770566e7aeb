"""Keep an event loop polling, briefly, after it writes a request whose reply comes back fast.

A call sleeps through waits that last tens to hundreds of microseconds: the reserve's and the
settle's Redis round trips, and a nearby upstream's answer. With nothing else to run, the event
loop blocks in epoll and the kernel halts the CPU; on a VM whose cpuidle driver does not poll
first (haltpoll with `guest_halt_poll_ns` = 0, as on the machines of docs/benchmarks.md) waking
it again costs more than the wait itself, with cold caches after. A kick keeps the loop from
blocking for GATEWAY_IDLE_SPIN_US after it: a callback that re-schedules itself makes the loop
poll with a zero timeout instead of sleeping. It is the kernel's halt polling done in the one
process that needs it, and adaptive the same way, per place a reply is awaited (`SpinSite`: a
connection pool's Redis, an upstream origin): a site whose spun-for replies come within the
budget spins again; one whose last three did not (a real model's answers, a Redis across the
network) sleeps through its next waits, 1, 2, 4 ... up to 64 of them, then spins once more to
see. So a wait longer than the budget costs the budget now and then, not at every call.

Only a loop with at most one call in flight spins (`LoopSpin.in_flight`, the router's set of
calls): with two or more, one call's wait is the other's turn, the loop seldom idles anyway,
and on a machine with few CPUs a polling worker would take a core that its Redis, its
upstream or another worker wants (docs/benchmarks.md, "The spin beside one call only": one
earlier run lost 2-12 % of throughput at 4 clients on 2 workers; later runs showed no cost
either way, so the rule bounds the spin to what it is for rather than buying a measured gain).

Measured in docs/benchmarks.md, "A bounded spin at the call's waits". 0 turns it off.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sized

from django.conf import settings

_now_ns = time.perf_counter_ns  # uvloop's loop.time() counts in milliseconds: too coarse here


class LoopSpin:
    """One event loop's spin: `kick()` keeps it polling until `budget_ns` after the kick."""

    __slots__ = ("loop", "budget_ns", "until_ns", "spinning", "turns", "in_flight")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget_ns: int) -> None:
        self.loop = loop
        self.budget_ns = budget_ns
        self.until_ns = 0
        self.spinning = False
        self.turns = 0  # the loop's turns spent polling (tests read it; never reset)
        # The calls in flight on this loop: the gateway's router sets its own set of them
        # (gateway/asgi.py). Empty (a loop without the router: the tests, a script) is one.
        self.in_flight: Sized = ()

    def kick(self) -> int:
        """Keep polling until the budget after now: that end (perf_counter_ns), 0 when off or
        when more than one call is in flight (then the loop is seldom idle, and its polling
        would take a CPU the other processes want)."""
        if self.budget_ns <= 0 or len(self.in_flight) > 1:
            return 0
        until = self.until_ns = _now_ns() + self.budget_ns
        if not self.spinning:
            self.spinning = True
            self.loop.call_soon(self._turn)
        return until

    def _turn(self) -> None:
        # One callback at a time per loop, whatever the number of kicks: a later kick only
        # moves the end. When the loop has other work the callback costs one turn's check.
        self.turns += 1
        if _now_ns() < self.until_ns:
            self.loop.call_soon(self._turn)
        else:
            self.spinning = False


_current: LoopSpin | None = None  # a process runs one loop at a time: one entry is enough


def loop_spin(loop: asyncio.AbstractEventLoop) -> LoopSpin:
    """The spin of `loop`, made at its first use (with GATEWAY_IDLE_SPIN_US as it is then)."""
    global _current
    spin = _current
    if spin is None or spin.loop is not loop:
        spin = _current = LoopSpin(loop, settings.GATEWAY_IDLE_SPIN_US * 1000)
    return spin


_MAX_SKIPS = 64  # a site that keeps missing spins for one wait in 65: 3 us a wait at 200 us
# Misses in a row before a site skips: a nearby Redis or upstream answers late now and then (its
# own CPU was halted, or the loop was busy), and one late reply is no reason to sleep through
# the next, fast one; a real model's answers are all late, so it stops after this many.
_MISSES_TO_SKIP = 3


class SpinSite:
    """A place where a loop awaits replies (a script pool's Redis, an upstream origin): whether
    its waits are worth spinning for. `kick()` as the request is written, `replied(kicked)`
    when its reply has come; a reply that fails leaves the record as it was."""

    __slots__ = ("skips", "backoff", "misses")

    def __init__(self) -> None:
        self.skips = 0  # waits left to sleep through before spinning again
        self.backoff = 0  # how many the last miss made it skip
        self.misses = 0  # spun-for replies in a row that came after the spin's end

    def kick(self, loop: asyncio.AbstractEventLoop) -> int:
        """Spin for the reply of a request written now (right after the write where the code
        makes it; just before, where redis-py makes it): the spin's end, for replied(); 0 when
        this wait does not spin (skipped, or the spin is off)."""
        if self.skips:
            self.skips -= 1
            return 0
        return loop_spin(loop).kick()

    def replied(self, kicked: int, arrived: int = 0) -> None:
        """The reply of the wait `kicked` (kick's value) has come, at `arrived`
        (perf_counter_ns; default now: for a caller that awaits it right after the write, not
        one with other work in between). Only spun waits are judged: a wait that slept
        includes the CPU's wake-up, which is what the spin saves."""
        if not kicked:
            return
        if (arrived or _now_ns()) <= kicked:
            self.misses = self.backoff = 0
            return
        self.misses += 1
        if self.misses >= _MISSES_TO_SKIP:
            self.backoff = self.skips = min(max(1, 2 * self.backoff), _MAX_SKIPS)
