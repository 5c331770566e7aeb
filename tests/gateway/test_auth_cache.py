"""The gateway's API key cache: callers waiting on the same key share one lookup."""
from __future__ import annotations

import asyncio

from gateway.auth import AuthCache


def test_a_cancelled_caller_does_not_fail_the_others_waiting_on_the_same_key() -> None:
    async def scenario() -> object:
        loaded = asyncio.Event()
        sentinel = object()

        async def slow_load(prefix: str) -> object:
            await loaded.wait()
            return sentinel

        cache = AuthCache(60, slow_load)  # type: ignore[arg-type]
        first = asyncio.ensure_future(cache._lookup("p", 0.0))
        second = asyncio.ensure_future(cache._lookup("p", 0.0))
        await asyncio.sleep(0)
        first.cancel()  # its client left
        loaded.set()
        return await second, sentinel

    got, sentinel = asyncio.run(scenario())
    assert got is sentinel
