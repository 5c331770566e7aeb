"""The gateway's asyncio Redis client packs commands with hiredis (quotas/client.py): the same
bytes as redis-py's own packer, the URL's connection class kept, and the engine's scripts run
through it on the real server."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio
from redis.exceptions import DataError

from quotas.client import make_async_redis
from quotas.engine import AsyncQuotaEngine, ReserveRequest, ScopeLimit
from quotas.windows import WindowKind

LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 100), ScopeLimit("key:k", WindowKind.MONTH, 80))


def _connections(url: str) -> tuple[redis.asyncio.connection.AbstractConnection, ...]:
    """A connection of the gateway's client for `url`, and one of redis-py's own class for the
    same URL (neither connects)."""
    pool = make_async_redis(url, cluster=False).connection_pool
    plain = redis.asyncio.BlockingConnectionPool.from_url(url)
    return pool.make_connection(), plain.make_connection()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6399/0", "rediss://127.0.0.1:6399/0",
                                 "unix:///tmp/tollgate-none.sock"])
def test_the_url_chooses_the_connection_class(url: str) -> None:
    ours, theirs = _connections(url)
    assert isinstance(ours, type(theirs))  # TLS stays TLS, a Unix socket stays one
    assert type(ours) is not type(theirs)


@pytest.mark.parametrize("args", [
    # A reserve call's shape: the script, its keys, numbers, JSON meta, non-ASCII text.
    ("EVALSHA", "f" * 40, 3, "tg:{t1}:hold:r1", "tg:{t1}:holds", "tg:{t1}:c:tenant:d20261201",
     "r1", 1200, -1, 0, 10**15, 2**70, '{"p":1,"m":"gpt-4o-mini","who":"é ü 漢"}', ""),
    ("SET", b"k\x00\xff", 1.5, 1e20, 0.1, -7),
    ("CONFIG GET", "maxmemory-policy"),  # a command name with a space: split, as redis-py does
    ("SET", "k", memoryview(b"view")),  # other types: redis-py's packer
])
def test_the_same_bytes_as_redis_py(args: tuple[object, ...]) -> None:
    ours, theirs = _connections("redis://127.0.0.1:6399/0")
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


@pytest.mark.parametrize("bad", [True, None, 1 + 2j])
def test_what_redis_py_refuses_is_refused(bad: object) -> None:
    ours, _ = _connections("redis://127.0.0.1:6399/0")
    with pytest.raises(DataError):
        ours.pack_command("SET", "k", bad)


def test_the_engine_runs_through_it(redis_url: str, tenant: str) -> None:
    async def scenario() -> None:
        client = make_async_redis(redis_url, cluster=False)
        engine = AsyncQuotaEngine(client)
        results = await asyncio.gather(
            *(engine.reserve(ReserveRequest(tenant, f"r{i}", 10, LIMITS)) for i in range(10)))
        admitted = [r for r in results if r.admitted]
        assert len(admitted) == 8  # the monthly key limit of 80 binds first
        await client.script_flush()  # NOSCRIPT: reloaded through the same packer
        settled = await asyncio.gather(*(engine.settle(r.hold, 4) for r in admitted))
        assert [s.outcome for s in settled] == ["settled"] * 8
        day = await engine.counter(tenant, "tenant")
        assert (day.used, day.pending) == (32, 0)
        connection = await client.connection_pool.get_connection()
        assert type(connection).__name__.startswith("CPacking")
        await client.connection_pool.release(connection)
        await client.aclose()

    asyncio.run(scenario())
