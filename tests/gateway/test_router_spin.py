"""The router tells its loop's spin which /v1 calls are in flight (quotas/loop_spin.py): a write
made while one call is in flight spins for its reply; one made while two are does not, since the
loop then seldom idles and its polling would take a CPU that Redis, the upstream or another
worker wants. A call's end takes it out of the count."""
from __future__ import annotations

import asyncio
from typing import Any

from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponse
from django.test import override_settings

from gateway.asgi import GatewayRouter
from quotas.loop_spin import loop_spin
from tests.gateway.test_router_close import _exchange


def test_a_kick_spins_with_one_call_in_flight_and_not_with_two() -> None:
    kicks: list[tuple[str, bool]] = []

    async def scenario() -> None:
        first_in, second_in, first_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first(request: Any) -> HttpResponse:
            kicks.append(("first, alone", bool(loop_spin(asyncio.get_running_loop()).kick())))
            first_in.set()
            await second_in.wait()
            kicks.append(("first, beside the second",
                          bool(loop_spin(asyncio.get_running_loop()).kick())))
            return HttpResponse(b"{}")

        async def second(request: Any) -> HttpResponse:
            kicks.append(("second, beside the first",
                          bool(loop_spin(asyncio.get_running_loop()).kick())))
            second_in.set()
            await first_done.wait()
            kicks.append(("second, alone again",
                          bool(loop_spin(asyncio.get_running_loop()).kick())))
            return HttpResponse(b"{}")

        router = GatewayRouter(ASGIHandler(), {"/v1/first": first, "/v1/second": second})
        one = asyncio.create_task(router(*_exchange("/v1/first")[:3]))
        await first_in.wait()
        two = asyncio.create_task(router(*_exchange("/v1/second")[:3]))
        await one
        await asyncio.sleep(0)  # the first call's task is out of the set once its end has run
        first_done.set()
        await two
        assert router.calls == set()

    with override_settings(GATEWAY_IDLE_SPIN_US=1000):
        asyncio.run(scenario())
    assert kicks == [("first, alone", True), ("second, beside the first", False),
                     ("first, beside the second", False), ("second, alone again", True)]
