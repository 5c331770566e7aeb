"""A gateway worker's last steps when it is told to stop (SIGTERM: a rolling deploy, a scale-in).

uvicorn does the first part: it stops accepting connections, closes idle keep-alive ones, lets
the requests in flight finish (a stream to its end, its settle included: the relay settles
before its last byte) for up to `--timeout-graceful-shutdown` seconds (config/serve.py passes
GATEWAY_SHUTDOWN_DRAIN_SECONDS), then cancels what is left (gateway/asgi.py ends those as if
their clients had left: drained for their usage and settled). Then it sends the ASGI lifespan
shutdown, where the router (gateway/asgi.py) awaits `drain_worker` below before writing the
metrics' tally: the work the calls detached (a hold's end, its retries while Redis is away, a
stream's drain, a checkpoint, a breaker record) is awaited, again for up to
GATEWAY_SHUTDOWN_DRAIN_SECONDS; then the buffered writes are flushed (breaker successes, the
last use of API keys, fail-open usage events) and the worker's own loops (the listener, the
flushers) are cancelled, with any call's end still not done (logged at ERROR): a hold left
open is swept later with what it knew (its checkpoints), as after a crash.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

from django.conf import settings

from gateway import startup
from gateway.circuit import circuit_for
from gateway.forward import _unmetered_backlog
from gateway.listener import flush_last_used
from gateway.runtime import GatewayRuntime

log = logging.getLogger(__name__)

# How long the worker's own tasks (the listener, the flushers) get to end once cancelled: each
# ends at its next await and its clean-up (closing its connection), so only a task that ignored
# its cancellation is still running after it.
STOP_GRACE_SECONDS = 2.0


async def drain_worker(calls: Collection[asyncio.Task[Any]] = ()) -> None:
    """Finish this worker's detached work and buffered writes (a worker that served nothing has
    no runtime and nothing to do). `calls`: the router's calls in flight."""
    runtime = startup._runtime  # built on the first request (gateway/startup.py)
    if runtime is None:
        return
    await drain(runtime, float(settings.GATEWAY_SHUTDOWN_DRAIN_SECONDS), calls)


async def drain(runtime: GatewayRuntime, timeout: float,
                calls: Collection[asyncio.Task[Any]] = ()) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # Calls uvicorn cancelled at its graceful timeout are still running their cancellation
    # (ending as if their clients had left): they detach their ends as they finish. uvicorn
    # sends the lifespan shutdown at once, without waiting for them.
    running = {call for call in calls if not call.done()}
    if running:
        await asyncio.wait(running, timeout=max(deadline - loop.time(), 0.01))
    # The calls' ends first: they may detach more (a settle that found Redis away retries in a
    # task of its own), so until none is left or the time is up.
    while runtime.detached:
        left = deadline - loop.time()
        if left <= 0:
            log.error("stopping with %d calls' ends not done after %g s "
                      "(GATEWAY_SHUTDOWN_DRAIN_SECONDS): their holds stay open until the sweep "
                      "charges what they knew", len(runtime.detached), timeout)
            break
        await asyncio.wait(set(runtime.detached), timeout=left)
    await _flush(runtime, deadline)
    own = [task for task in runtime.background if not task.done()]
    for task in own:
        task.cancel()
    if not own:
        return
    # Bounded: a task whose cancellation was dropped below it (Python 3.11's asyncio.wait_for
    # dropped one that came as its awaitable finished: gateway/listener.py) would otherwise keep
    # the worker from ever stopping.
    done, left = await asyncio.wait(own, timeout=STOP_GRACE_SECONDS)
    for task in done:  # their ends read, as gather(return_exceptions=True) would
        if not task.cancelled():
            task.exception()
    if left:
        log.error("stopping with %d background tasks still running %g s after they were "
                  "cancelled: %s", len(left), STOP_GRACE_SECONDS,
                  ", ".join(sorted(_task_name(task) for task in left)))


def _task_name(task: asyncio.Future[Any]) -> str:
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    return getattr(coro, "__qualname__", repr(task))


async def _flush(runtime: GatewayRuntime, deadline: float) -> None:
    """The writes a worker buffers, done now rather than at their next interval."""
    try:
        await circuit_for(runtime).flush()  # successes counted since the last flush
    except Exception:  # noqa: BLE001 - lost as a crash would lose them (fail closed)
        log.warning("could not flush the breakers' successes at shutdown", exc_info=True)
    try:
        await flush_last_used(runtime)
    except Exception:  # noqa: BLE001 - the keys' last use is informative only
        log.warning("could not record the last use of API keys at shutdown", exc_info=True)
    backlog = _unmetered_backlog()
    if backlog.flushing is not None:
        left = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({backlog.flushing}, timeout=max(left, 0.01))
        if not done or backlog.pending:
            log.error("stopping with %d fail-open usage events not recorded (Redis away); "
                      "their ERROR lines are their only record", len(backlog.pending))
