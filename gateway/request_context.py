"""Which request the running code serves: its request id, tenant public id and API key public id,
in context variables, so that every log line (config/log_format.py) and span of a request can say
so without each call passing them along.

Each ASGI request runs in a task of its own, and asyncio copies the context into every task a
request starts (a stream's drain, a hold's end, a checkpoint), so their lines carry the request
too. The worker's own tasks (gateway/runtime.py `spawn`: the listener, the flushers) start in an
empty context instead, whichever request happened to start them. Work a request hands to one of
the worker's thread pools (a large body's counting, the database threads: a rebuild of the
tenant's counters) runs in a copy of its context (`in_thread`, as asyncio.to_thread does), so
its lines carry the request too. The router (gateway/asgi.py) runs the view in its own task,
so its lines after the view carry the ids the view bound; it logs a call's end and failures
through the call's Observation (`with_ids`) all the same, which binds them in a context of its
own (a request refused before its view has none).

Set in two places, once per request: `gateway.errors.new_request_id` (every /v1 answer makes
its id there) and `gateway.views._authenticate` (once the key is known). Never a secret: the
ids are the public ones the console and the ledger show.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

request_id: ContextVar[str | None] = ContextVar("tollgate_request_id", default=None)
tenant: ContextVar[str | None] = ContextVar("tollgate_tenant", default=None)
api_key: ContextVar[str | None] = ContextVar("tollgate_api_key", default=None)


def bind_request(rid: str) -> None:
    request_id.set(rid)


def bind_caller(tenant_public_id: str, key_public_id: str) -> None:
    tenant.set(tenant_public_id)
    api_key.set(key_public_id)


def current() -> dict[str, str]:
    """The ids known so far, for a log line or a span (empty outside a request)."""
    found: dict[str, str] = {}
    if (rid := request_id.get()) is not None:
        found["request_id"] = rid
    if (tid := tenant.get()) is not None:
        found["tenant"] = tid
    if (kid := api_key.get()) is not None:
        found["api_key"] = kid
    return found


async def in_thread(executor: Executor, work: Callable[..., T], *args: Any) -> T:
    """work(*args) on one of `executor`'s threads, in a copy of the caller's context (as
    asyncio.to_thread does; loop.run_in_executor alone runs it in the thread's own, empty one),
    so the lines it logs carry the request's ids. A copy: what the work binds stays there."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        executor, functools.partial(context.run, work, *args))
