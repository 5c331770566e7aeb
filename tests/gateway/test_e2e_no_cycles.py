"""A finished /v1 call leaves nothing for Python's cyclic garbage collector: everything it made
is freed by reference counting as soon as the call ends. Each reference cycle per call (the
router's frame held by the disconnect listener's exception, a call and its checkpoints) filled
the young generation until a collection paused the worker for milliseconds, the tail of the
one-client latency (docs/benchmarks.md). The gateway (GatewayRouter in front of Django's ASGI
handler, as config/asgi.py builds it) runs in this process under httpx's ASGI transport, over
the session's Redis, PostgreSQL and mock upstream."""
from __future__ import annotations

import asyncio
import gc
from collections import Counter

import httpx
import pytest
from django.core.handlers.asgi import ASGIHandler

from gateway.asgi import GatewayRouter
from gateway.startup import flush_active_marks
from gateway.urls import direct_routes, prefix_routes
from tests.gateway.conftest import MakeTenant
from tests.gateway.test_e2e_spans import _stop_runtime, fresh_runtime  # noqa: F401 - a fixture

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "collect nothing"}]
# Where the objects a call makes come from: the gateway's and the libraries it drives per call
# (httpx's ASGI transport, the test's client, may make cycles of its own: not counted).
OURS = ("gateway.", "quotas.", "django.", "redis.", "uvicorn.")


def _garbage_of_calls(calls: list[tuple[str, str, int]], rounds: int) -> Counter[str]:
    """The objects the cyclic GC finds after `rounds` of `calls` ((key, model, expected
    status), each streamed and not), by type, counting only the types of OURS."""
    async def run() -> Counter[str]:
        app = GatewayRouter(ASGIHandler(), direct_routes(), prefix_routes())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway", timeout=30) as client:
                async def send() -> None:
                    for key, model, expected in calls:
                        for stream in (False, True):
                            response = await client.post(
                                "/v1/chat/completions",
                                json={"model": model, "messages": MESSAGES, "max_tokens": 8,
                                      "stream": stream},
                                headers={"Authorization": f"Bearer {key}"})
                            await response.aread()
                            assert response.status_code == expected, response.text

                await send()  # warm: the runtime, its connections and caches
                # and the first flush of the active-tenant marks (its script's first load: a
                # NOSCRIPT answer once per process, not per call), which would otherwise come
                # during the measured rounds
                await flush_active_marks()
                await asyncio.sleep(0.2)
                gc.collect()
                gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
                try:
                    for _ in range(rounds):
                        await send()
                    await asyncio.sleep(0.2)  # the detached ends of the holds have finished
                    gc.collect()
                    return Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                                   for o in gc.garbage
                                   if type(o).__module__.startswith(OURS))
                finally:
                    gc.set_debug(0)
                    gc.garbage.clear()
        finally:
            await _stop_runtime()

    return asyncio.run(run())


def test_finished_calls_leave_no_cycles(fresh_runtime: None,  # noqa: F811
                                        make_tenant: MakeTenant) -> None:
    t = make_tenant(requests_per_second=1000)
    poor = make_tenant(tokens_per_day=10)
    garbage = _garbage_of_calls([
        (t.plaintext, "gpt-4o", 200),  # answered (a stream to its end)
        (t.plaintext, "gpt-4o@status=500", 502),  # the upstream failed: released
        (poor.plaintext, "gpt-4o", 429),  # refused by the reserve
    ], rounds=3)
    assert garbage == Counter()
