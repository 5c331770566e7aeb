"""The gateway's asyncio Redis client sends its script calls (EVALSHA, the hot path's only
command) the short way (quotas/client.py _ScriptCallingRedis, and the connection's write that
skips redis-py's per-command task when the kernel takes the whole command). Pinned here on the
real server: the replies, a connection the server closed, a script the server forgot, a script
error, a command larger than the socket's buffer, and a server that is gone."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ConnectionError, ResponseError

from quotas import client as quota_client
from quotas.client import make_async_redis

# Arguments of a reserve call's shape: keys with a hash tag, numbers, JSON, non-ASCII text.
ECHO = "return {#KEYS, ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]) + 1}"


def _client(url: str) -> quota_client._ScriptCallingRedis:
    client = make_async_redis(url, cluster=False)
    assert type(client) is quota_client._ScriptCallingRedis
    assert isinstance(client.connection_pool, quota_client._BlockingPool)
    return client


def test_script_calls_answer_as_through_redis_py(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        keys = [f"tg:{{t1}}:c:{i}" for i in range(34)]
        for i in range(20):
            reply = await script(keys=keys, args=["r1", '{"m":"gpt-4o-mini","who":"é 漢"}',
                                                  "", 10**12 + i])
            assert reply == [34, "r1", '{"m":"gpt-4o-mini","who":"é 漢"}', "", 10**12 + i + 1]
        # One caller at a time: one connection, taken and given back on every call.
        pool = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        # Other commands still go through redis-py's own path.
        key = f"script-test:{uuid.uuid4().hex}"
        assert await client.set(key, "v", ex=5) is True
        assert await client.get(key) == "v"
        await client.aclose()

    asyncio.run(scenario())


def test_concurrent_script_calls_share_the_pool(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        pool = client.connection_pool
        pool.max_connections = 3
        key = f"script-test:{uuid.uuid4().hex}"
        incr = client.register_script("return redis.call('INCR', KEYS[1])")

        async def caller() -> list[int]:
            return [await incr(keys=[key]) for _ in range(25)]

        replies = await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(40))), 30)
        assert sorted(r for batch in replies for r in batch) == list(range(1, 1001))
        assert len(pool._available_connections) == 3 and not pool._in_use_connections
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_a_connection_the_server_closed_is_retried(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        assert (await script(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
        await client.client_setname("script-test-victim")
        victims = [c["id"] for c in await client.client_list()
                   if c.get("name") == "script-test-victim"]
        assert victims
        other = make_async_redis(redis_url, cluster=False)
        for ident in victims:
            await other.client_kill_filter(_id=ident)
        await other.aclose()
        await asyncio.sleep(0.05)
        # The pooled connection is dead: the call reconnects (redis-py's retry), no error.
        assert (await script(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        pool = client.connection_pool
        assert not pool._in_use_connections
        await client.aclose()

    asyncio.run(scenario())


def test_a_script_the_server_forgot_is_loaded_again(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        # A script of its own (SCRIPT FLUSH would make every other test's scripts reload too;
        # a unique body is as unknown to the server as a flushed one).
        body = f"return 'fresh-{uuid.uuid4().hex}'"
        script = client.register_script(body)
        assert not (await client.script_exists(script.sha))[0]
        assert (await script()).startswith("fresh-")  # NOSCRIPT, loaded, sent again
        assert (await client.script_exists(script.sha))[0]
        await client.aclose()

    asyncio.run(scenario())


def test_a_script_error_is_raised_and_the_connection_kept(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        failing = client.register_script("return redis.error_reply('QUOTA broken on purpose')")
        fine = client.register_script(ECHO)
        with pytest.raises(ResponseError, match="broken on purpose"):
            await failing()
        assert (await fine(keys=["k"], args=["a", "b", "c", 5]))[4] == 6
        pool = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        await client.aclose()

    asyncio.run(scenario())


def test_a_command_larger_than_the_socket_buffer(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        length = client.register_script("return string.len(ARGV[1])")
        # 8 MB: more than the kernel takes at once, so the write waits for the rest (redis-py's
        # drain) before the reply is read.
        assert await length(args=["x" * 8_000_000]) == 8_000_000
        assert await length(args=["y"]) == 1
        await client.aclose()

    asyncio.run(scenario())


def test_a_server_that_is_gone_fails_the_call(tmp_path: object) -> None:
    async def scenario() -> None:
        client = _client(f"unix://{tmp_path}/no-redis.sock")
        script = client.register_script(ECHO)
        with pytest.raises(ConnectionError):
            await script(keys=["k"], args=["a", "b", "c", 1])
        pool = client.connection_pool
        assert not pool._in_use_connections
        await client.aclose()

    asyncio.run(scenario())


def test_a_reply_lost_mid_call_is_retried_once_then_raised(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        assert (await script(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
        (connection,) = client.connection_pool._available_connections
        real_send, real_read = connection.send_packed_command, connection.read_response
        sent: list[bytes] = []
        failures: list[int] = []
        budget = [1]  # how many script replies are lost from here on

        async def send(command: list[bytes], check_health: bool = True) -> None:
            await real_send(command, check_health)  # a reconnect's handshake goes first
            sent.append(b"".join(command))

        async def read(*args: object, **kwargs: object) -> object:
            # Injected fault: the socket breaks while a script's reply is read (the
            # connection's own handshake after a reconnect is left alone).
            if sent and sent[-1].startswith(b"*") and b"EVALSHA" in sent[-1][:32] and budget[0]:
                budget[0] -= 1
                failures.append(1)
                await connection.disconnect()
                raise ConnectionError("injected: connection lost mid-reply")
            return await real_read(*args, **kwargs)

        connection.send_packed_command, connection.read_response = send, read
        # Once: disconnected, reconnected and sent again (redis-py's retry), answered.
        assert (await script(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        assert len(failures) == 1 and connection.is_connected
        # Twice in a row: the retry's failure is raised, the connection given back.
        budget[0] = 2
        with pytest.raises(ConnectionError, match="injected"):
            await script(keys=["k"], args=["a", "b", "c", 3])
        assert len(failures) == 3
        pool = client.connection_pool
        assert not pool._in_use_connections and connection in pool._available_connections
        assert (await script(keys=["k"], args=["a", "b", "c", 4]))[4] == 5
        await client.aclose()

    asyncio.run(scenario())
