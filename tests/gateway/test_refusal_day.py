"""Refusals are counted and read in the day of the Redis clock (DESIGN.md invariant 6), not the
day of whichever host counts or reads them: a console host whose clock is three days off still
shows today's refusals."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.refusals import count_refusal
from quotas.client import make_async_redis
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.status import refused_today
from quotas.windows import WindowKind
from tests.world import World


@pytest.mark.django_db
def test_refusals_are_counted_and_read_on_the_redis_clock(world: World,
                                                          monkeypatch: Any) -> None:
    engine = get_engine()
    redis_now_s = engine.current_window(WindowKind.DAY).start_ms / 1000 + 3600

    async def count() -> None:
        client = make_async_redis()
        try:
            await count_refusal(client, tenant_tag(world.acme.pk), "rate_limit", redis_now_s)
        finally:
            await client.aclose()

    asyncio.run(count())
    skewed = time.time() + 3 * 86400
    monkeypatch.setattr("quotas.status.time.time", lambda: skewed)
    [refused] = refused_today(world.acme, engine=engine)
    assert (refused.reason, refused.count) == ("rate_limit", 1)
