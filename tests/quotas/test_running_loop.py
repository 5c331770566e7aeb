"""quotas/running_loop.py: the running loop found without asyncio's getpid() per lookup, and
the same answers as asyncio.get_running_loop() wherever the loop it kept no longer holds: another
thread the context was copied to, another loop in the same thread, a forked child, no loop."""
from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from quotas import running_loop as module
from quotas.running_loop import current_task, running_loop

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def new_loop(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    return LOOPS[request.param]


def run(new_loop: Callable[[], asyncio.AbstractEventLoop], coro: Any) -> Any:
    loop = new_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[asyncio.AbstractEventLoop]:
    """Each time running_loop() asks asyncio (the lookup that calls getpid())."""
    calls: list[asyncio.AbstractEventLoop] = []
    real = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        loop = real()
        calls.append(loop)
        return loop

    monkeypatch.setattr(module.asyncio, "get_running_loop", counted)
    return calls


def test_the_running_loop_asked_once_per_context(new_loop: Any, asked: list[Any]) -> None:
    async def main() -> None:
        loop = asyncio.get_event_loop()
        assert [running_loop() for _ in range(5)] == [loop] * 5
        assert current_task() is asyncio.current_task(loop)
        # A task made from this one inherits the context, and what it found.
        assert await loop.create_task(_lookups(3)) == [loop] * 3
        assert len(asked) == 1

    run(new_loop, main())


async def _lookups(n: int) -> list[asyncio.AbstractEventLoop]:
    await asyncio.sleep(0)
    return [running_loop() for _ in range(n)]


def test_no_loop_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        running_loop()
    with pytest.raises(RuntimeError):
        current_task()


def test_a_thread_given_the_context_has_no_loop(new_loop: Any) -> None:
    """asyncio.to_thread copies the caller's context, with the loop it found, into a thread
    where no loop runs: asyncio raises there, and so does running_loop()."""
    def in_thread() -> str:
        try:
            running_loop()
        except RuntimeError:
            return "no loop"
        return "a loop"

    async def main() -> str:
        running_loop()
        return await asyncio.to_thread(in_thread)

    assert run(new_loop, main()) == "no loop"


def test_another_loop_in_the_same_thread(new_loop: Any) -> None:
    """A context that found a loop now stopped, run under a new loop of the same thread: the new
    loop, not the old one."""
    async def keep() -> contextvars.Context:
        running_loop()
        return contextvars.copy_context()

    kept = run(new_loop, keep())

    async def main() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return asyncio.get_event_loop(), kept.run(running_loop)

    now, found = run(new_loop, main())
    assert found is now


def test_a_forked_child_has_no_loop(new_loop: Any) -> None:
    """As asyncio's own check (its reason for getpid()): a child forked while a loop runs does
    not run that loop."""
    async def main() -> bytes:
        running_loop()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer and leave at once, running nothing of the parent's
            try:
                running_loop()
                answer = b"a loop"
            except RuntimeError:
                answer = b"no loop"
            except BaseException:  # noqa: BLE001 - the child must always exit below
                answer = b"error"
            os.write(write, answer)
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as pipe:
            return pipe.read()

    assert run(new_loop, main()) == b"no loop"
