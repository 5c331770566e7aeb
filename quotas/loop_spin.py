"""Keep an event loop polling, briefly, after it writes something whose answer comes back fast.

A call sleeps through a handful of waits that last tens to hundreds of microseconds: the
reserve's and the settle's Redis round trips, and a nearby upstream's answer. With nothing else to run, the event loop blocks in epoll and the
kernel halts the CPU; on a VM whose cpuidle driver does not poll first (haltpoll with
`guest_halt_poll_ns` = 0, as on the machines of docs/benchmarks.md) waking it again costs more
than the wait itself, with cold caches after. `spin_for_reply(loop)` keeps the loop from
blocking for GATEWAY_IDLE_SPIN_US after the latest call to it: a callback that re-schedules
itself makes the loop poll with a zero timeout instead of sleeping. It is the kernel's halt
polling done in the one process that needs it, bounded the same way: a wait longer than the
budget (a real model's answer, an idle connection) costs the budget once and then sleeps.

Measured in docs/benchmarks.md, "A bounded spin at the call's waits". 0 turns it off.
"""
from __future__ import annotations

import asyncio
import time

from django.conf import settings

_now_ns = time.perf_counter_ns  # uvloop's loop.time() counts in milliseconds: too coarse here


class LoopSpin:
    """One event loop's spin: `kick()` keeps it polling until `budget_ns` after the kick."""

    __slots__ = ("loop", "budget_ns", "until_ns", "spinning", "turns")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget_ns: int) -> None:
        self.loop = loop
        self.budget_ns = budget_ns
        self.until_ns = 0
        self.spinning = False
        self.turns = 0  # the loop's turns spent polling (tests read it; never reset)

    def kick(self) -> None:
        if self.budget_ns <= 0:
            return
        self.until_ns = _now_ns() + self.budget_ns
        if not self.spinning:
            self.spinning = True
            self.loop.call_soon(self._turn)

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


def spin_for_reply(loop: asyncio.AbstractEventLoop) -> None:
    """Call as a request whose reply may come within the spin's budget is written (right after
    the write where the code makes it; just before, where redis-py makes it)."""
    loop_spin(loop).kick()
