"""The running event loop, found without a system call.

On CPython 3.11, `asyncio.get_running_loop()`, and every asyncio function that finds the loop
itself (`current_task()`, `create_task()`, `ensure_future()` of a coroutine, `sleep()`, a lock's
wait), calls `getpid()` on each lookup: a loop found in a process forked from the one running it
must not be returned. glibc no longer caches the pid, so each lookup is a system call. A plain
gateway call made 20 of them (strace: 33,717 for 1,672 calls), about 1.1 us each in the call's
cold caches (2.2 % of the worker's samples at one client), against 0.19 us warm
(docs/benchmarks.md, "The running loop without getpid()").

`running_loop()` keeps the loop it found in the current context (a task's context, which the
tasks it makes inherit) with the thread it was found on and the count of forks this process has
seen: the next lookup in that context returns it while all three still hold (the same thread, no
fork since, the loop running), and asks asyncio otherwise. So it answers as
`asyncio.get_running_loop()` does, including RuntimeError where no loop runs (a thread a
context was copied to, a process forked from a running loop).
"""
from __future__ import annotations

import asyncio
import os
import threading
from contextvars import ContextVar

_forks = 0  # forks this process came through: a loop found before one is not this process's


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)

_thread = threading.get_ident
_found: ContextVar[tuple[asyncio.AbstractEventLoop, int, int] | None] = ContextVar(
    "tollgate_running_loop", default=None)


def running_loop() -> asyncio.AbstractEventLoop:
    """asyncio.get_running_loop(), without its getpid() when this context found it before."""
    found = _found.get()
    if found is not None:
        loop, thread, forks = found
        if thread == _thread() and forks == _forks and loop.is_running():
            return loop
    loop = asyncio.get_running_loop()  # RuntimeError where none runs, as asyncio's
    _found.set((loop, _thread(), _forks))
    return loop


def current_task() -> asyncio.Task[object] | None:
    """asyncio.current_task() of the running loop (RuntimeError where none runs)."""
    return asyncio.current_task(running_loop())
