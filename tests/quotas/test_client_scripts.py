"""The gateway's asyncio Redis client sends its script calls (EVALSHA, the hot path's only
command) on connections of their own (quotas/client.py _ScriptCallingRedis, quotas/script_pool.py
ScriptPool: an asyncio protocol per connection), with redis-py's behaviour. Pinned here on the
real server: the replies, the pool's bound and reuse, a connection the server closed, a script
the server forgot, a script error, a command larger than the socket's buffer, a server that is
gone, a reply lost mid-call, a caller cancelled mid-reply, and a caller waiting for a connection
past the timeout. The redis-py path the scripts take for a URL the pool does not speak (TLS) is
pinned too."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quotas import client as quota_client
from quotas import script_pool
from quotas.client import make_async_redis

# Arguments of a reserve call's shape: keys with a hash tag, numbers, JSON, non-ASCII text.
ECHO = "return {#KEYS, ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]) + 1}"


def _client(url: str) -> quota_client._ScriptCallingRedis:
    client = make_async_redis(url, cluster=False)
    assert type(client) is quota_client._ScriptCallingRedis
    assert isinstance(client.connection_pool, quota_client._BlockingPool)
    assert isinstance(client.scripts, script_pool.ScriptPool)
    return client


def _scripts(client: quota_client._ScriptCallingRedis) -> script_pool.ScriptPool:
    assert client.scripts is not None
    return client.scripts


def _busy(microseconds: int, first: str = "") -> str:
    """A script keeping Redis busy this long (Redis runs one script at a time): a reply slower
    than a timeout, or a connection held while others wait. `first`: a command it runs first.
    The tests that check who waits while it runs give it several tenths of a second over their
    own short pauses: a loaded machine can stall the test's loop that long."""
    return (f"{first} local t = redis.call('TIME') while true do local n = redis.call('TIME') "
            f"if (n[1] - t[1]) * 1000000 + n[2] - t[2] > {microseconds} then return 1 end end")


async def _slow_and_fine(client: quota_client._ScriptCallingRedis, microseconds: int,
                         ) -> tuple[Any, Any]:
    """A busy script and the echo, both loaded (each later call is one EVALSHA)."""
    slow = client.register_script(_busy(microseconds))
    fine = client.register_script(ECHO)
    assert await slow() == 1
    assert (await fine(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
    return slow, fine


def test_script_calls_answer_as_through_redis_py(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        keys = [f"tg:{{t1}}:c:{i}" for i in range(34)]
        for i in range(20):
            reply = await script(keys=keys, args=["r1", '{"m":"gpt-4o-mini","who":"é 漢"}',
                                                  "", 10**12 + i])
            assert reply == [34, "r1", '{"m":"gpt-4o-mini","who":"é 漢"}', "", 10**12 + i + 1]
        # One caller at a time: one script connection, taken and given back on every call.
        scripts = _scripts(client)
        assert scripts.opened == 1 and len(scripts.free) == 1 and scripts.in_use == 0
        # Other commands still go through redis-py's own path.
        key = f"script-test:{uuid.uuid4().hex}"
        assert await client.set(key, "v", ex=5) is True
        assert await client.get(key) == "v"
        await client.aclose()

    asyncio.run(scenario())


def test_concurrent_script_calls_share_the_pool(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        scripts = _scripts(client)
        scripts.size = 3
        key = f"script-test:{uuid.uuid4().hex}"
        incr = client.register_script("return redis.call('INCR', KEYS[1])")

        async def caller() -> list[int]:
            replies = []
            for _ in range(25):
                replies.append(await incr(keys=[key]))
                assert scripts.opened <= 3  # the bound holds all along, not only at the end
            return replies

        replies = await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(40))), 30)
        assert sorted(r for batch in replies for r in batch) == list(range(1, 1001))
        # 40 callers on 3 connections: never more, each given back, nobody left waiting.
        assert scripts.opened == 3 and len(scripts.free) == 3 and not scripts.waiters
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_an_idle_connection_the_server_closed_is_not_reused(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        assert (await script(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
        scripts = _scripts(client)
        (conn,) = scripts.free
        other = make_async_redis(redis_url, cluster=False)
        # The script connection is the client whose last command was the EVALSHA just sent
        # (this test's: the only one on this socket's port).
        port = conn.transport.get_extra_info("sockname")
        victims = [c["id"] for c in await other.client_list()
                   if c.get("cmd") == "evalsha" and (not isinstance(port, tuple)
                                                     or c.get("addr", "").endswith(f":{port[1]}"))]
        assert victims
        for ident in victims:
            await other.client_kill_filter(_id=ident)
        await other.aclose()
        await asyncio.sleep(0.05)
        # The pooled connection is dead (its close seen while idle): the call takes a new one.
        assert (await script(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        assert conn.closed and scripts.in_use == 0 and scripts.opened == 1
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
        scripts = _scripts(client)
        assert scripts.opened == 1 and len(scripts.free) == 1 and scripts.in_use == 0
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
        scripts = _scripts(client)
        assert scripts.opened == 0 and scripts.in_use == 0
        await client.aclose()

    asyncio.run(scenario())


def test_a_reply_lost_mid_call_is_retried_once_then_raised(redis_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    budget = [0]  # how many script replies are lost from here on
    failures: list[int] = []
    real = script_pool._ScriptConnection.data_received

    def data_received(self: script_pool._ScriptConnection, data: bytes) -> None:
        # Injected fault: the socket breaks while a script's reply is read (a new connection's
        # own setup has no waiter of a script call yet when budget is spent).
        if budget[0] and self.waiter is not None:
            budget[0] -= 1
            failures.append(1)
            self._fail(ConnectionError("injected: connection lost mid-reply"))
            return
        real(self, data)

    monkeypatch.setattr(script_pool._ScriptConnection, "data_received", data_received)

    async def scenario() -> None:
        client = _client(redis_url)
        script = client.register_script(ECHO)
        assert (await script(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
        scripts = _scripts(client)
        (first,) = scripts.free
        # Once: the connection closed, the call sent again on a new one, answered.
        budget[0] = 1
        assert (await script(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        assert len(failures) == 1 and first.closed
        assert scripts.opened == 1 and len(scripts.free) == 1
        # Twice in a row: the retry's failure is raised; no connection is kept or lost count of.
        budget[0] = 2
        with pytest.raises(ConnectionError, match="injected"):
            await script(keys=["k"], args=["a", "b", "c", 3])
        assert len(failures) == 3
        assert scripts.opened == 0 and scripts.in_use == 0 and not scripts.free
        assert (await script(keys=["k"], args=["a", "b", "c", 4]))[4] == 5
        await client.aclose()

    asyncio.run(scenario())


def test_a_caller_cancelled_mid_reply_leaves_no_connection_behind(redis_url: str) -> None:
    # A gateway call whose client left is cancelled, possibly while its script's reply is on
    # the way: that connection is closed (the late reply must answer nobody), its slot freed.
    async def scenario() -> None:
        client = _client(redis_url)
        slow, fine = await _slow_and_fine(client, 600000)
        scripts = _scripts(client)
        scripts.size = 1
        calling = asyncio.ensure_future(slow())
        await asyncio.sleep(0.05)
        assert scripts.in_use == 1 and not scripts.free
        calling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await calling
        assert scripts.in_use == 0 and scripts.opened == 0
        # The pool of one connection serves again, on a new connection.
        assert (await fine(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        assert scripts.opened == 1
        await client.aclose()

    asyncio.run(scenario())


def test_a_caller_past_the_pool_waits_then_fails_as_redis_py_does(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        slow, fine = await _slow_and_fine(client, 800000)
        scripts = _scripts(client)
        scripts.size, scripts.wait_timeout = 1, 0.1
        holder = asyncio.ensure_future(slow())
        await asyncio.sleep(0.02)
        with pytest.raises(ConnectionError, match="No connection available"):
            await fine(keys=["k"], args=["a", "b", "c", 2])
        assert not scripts.waiters
        scripts.wait_timeout = 5.0
        # A waiter given the connection when the holder is done.
        waiting = asyncio.ensure_future(fine(keys=["k"], args=["a", "b", "c", 3]))
        await asyncio.sleep(0.02)
        assert len(scripts.waiters) == 1
        assert await holder == 1
        assert (await waiting)[4] == 4
        assert scripts.opened == 1 and scripts.in_use == 0
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("url", [
    "rediss://localhost:6390/0",  # TLS
    "redis://localhost:6390/0?protocol=3",  # RESP3
    "redis://localhost:6390/0?client_name=gateway",
    "redis://localhost:6390/0?socket_keepalive=true",
])
def test_settings_the_script_pool_does_not_speak_keep_redis_py_path(url: str) -> None:
    client = make_async_redis(url, cluster=False)
    assert type(client) is quota_client._ScriptCallingRedis and client.scripts is None


def test_the_url_timeouts_and_the_pool_bound_are_the_script_pool_s() -> None:
    client = make_async_redis("redis://localhost:6390/3?socket_timeout=5&socket_connect_timeout=1",
                              cluster=False)
    scripts = _scripts(client)
    pool = client.connection_pool
    assert (scripts.timeout, scripts.connect_timeout) == (5.0, 1.0)
    assert (scripts.size, scripts.wait_timeout) == (pool.max_connections, pool.timeout)


def test_without_the_script_pool_the_scripts_take_redis_py_path(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # hiredis (or the redis-py parser the pool reuses) missing: quotas/client.py's import falls
    # back, and the scripts go the short way through redis-py's own connections.
    monkeypatch.setattr(quota_client, "ScriptPool", None)

    async def scenario() -> None:
        client = make_async_redis(redis_url, cluster=False)
        assert client.scripts is None
        script = client.register_script(ECHO)
        assert (await script(keys=["k"], args=["a", "b", "c", 1]))[4] == 2
        assert (await script(keys=["k"], args=["a", "b", "c", 2]))[4] == 3
        pool = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        await client.aclose()

    asyncio.run(scenario())
def test_a_reply_that_times_out_is_sent_once_more_then_raised(redis_url: str) -> None:
    # A script slower than the socket timeout (Redis runs one script at a time): the first
    # attempt times out and its connection is closed (its late reply must answer nobody); the
    # call is sent once more on a new connection in the same slot, which times out too.
    async def scenario() -> None:
        client = _client(redis_url)
        key = f"script-test:{uuid.uuid4().hex}"
        slow = client.register_script(_busy(150000, first="redis.call('INCR', KEYS[1])"))
        fine = client.register_script(ECHO)
        assert await slow(keys=[key]) == 1  # loaded: the next call is one EVALSHA per attempt
        scripts = _scripts(client)
        scripts.timeout = 0.1
        with pytest.raises(RedisTimeoutError):
            await slow(keys=[key])
        assert scripts.opened == 0 and scripts.in_use == 0 and not scripts.free
        scripts.timeout = 5.0
        assert (await fine(keys=["k"], args=["a", "b", "c", 1]))[4] == 2  # waits out Redis
        assert await client.get(key) == "3"  # the first call, then this one sent twice
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue(redis_url: str) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        slow, fine = await _slow_and_fine(client, 600000)
        scripts = _scripts(client)
        scripts.size = 1
        holder = asyncio.ensure_future(slow())
        await asyncio.sleep(0.02)
        waiting = asyncio.ensure_future(fine(keys=["k"], args=["a", "b", "c", 2]))
        await asyncio.sleep(0.02)
        assert len(scripts.waiters) == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not scripts.waiters
        assert await holder == 1
        assert scripts.opened == 1 and len(scripts.free) == 1  # given back, not handed to it
        assert (await fine(keys=["k"], args=["a", "b", "c", 3]))[4] == 4
        await client.aclose()

    asyncio.run(scenario())


def test_the_url_database_and_user_are_the_scripts_too(redis_url: str) -> None:
    # AUTH and SELECT on each new script connection, as redis-py sends them: a script must
    # write where every other command of the client reads.
    async def scenario() -> None:
        admin = make_async_redis(redis_url, cluster=False)
        user, secret = f"tg-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        await admin.execute_command("ACL", "SETUSER", user, "on", f">{secret}", "~*", "&*",
                                    "+@all")
        try:
            base, _, _ = redis_url.partition("?")
            scheme, rest = base.split("://", 1)
            url = f"{scheme}://{user}:{secret}@{rest}?db=5"
            client = _client(url)
            key = f"script-test:{uuid.uuid4().hex}"
            put = client.register_script("return redis.call('SET', KEYS[1], ARGV[1])")
            assert await put(keys=[key], args=["in-five"]) == "OK"
            assert await client.get(key) == "in-five"  # redis-py's own connection, db 5
            assert await admin.exists(key) == 0  # not in the default database
            await client.delete(key)
            await client.aclose()
            wrong = _client(f"{scheme}://{user}:not-{secret}@{rest}?db=5")
            with pytest.raises(ConnectionError):  # AuthenticationError is one
                await wrong.evalsha(put.sha, 1, key, "x")
            assert _scripts(wrong).opened == 0
            await wrong.aclose()
        finally:
            await admin.execute_command("ACL", "DELUSER", user)
            await admin.aclose()

    asyncio.run(scenario())


def test_aclose_closes_idle_connections_and_those_in_use_when_they_come_back(redis_url: str,
                                                                            ) -> None:
    async def scenario() -> None:
        client = _client(redis_url)
        # Two of these run back to back below, within the pool's 2 s read timeout.
        slow, fine = await _slow_and_fine(client, 400000)
        await asyncio.gather(fine(keys=["k"], args=["a", "b", "c", 1]), slow())
        scripts = _scripts(client)
        idle = list(scripts.free)
        assert len(idle) == 2
        holder = asyncio.ensure_future(slow())
        await asyncio.sleep(0.02)
        (busy,) = [conn for conn in idle if conn not in scripts.free]
        scripts.size = 2
        second = asyncio.ensure_future(slow())  # takes the other connection
        await asyncio.sleep(0.02)
        waiting = asyncio.ensure_future(fine(keys=["k"], args=["a", "b", "c", 9]))
        await asyncio.sleep(0.02)
        assert len(scripts.waiters) == 1
        await scripts.aclose()
        with pytest.raises(ConnectionError, match="pool closed"):  # not left to its timeout
            await waiting
        assert not busy.closed
        assert await holder == 1 and await second == 1
        assert all(conn.closed for conn in idle) and scripts.opened == 0 and not scripts.free
        assert (await fine(keys=["k"], args=["a", "b", "c", 2]))[4] == 3  # usable again
        await client.aclose()

    asyncio.run(scenario())


def test_send_now_writes_before_the_loop_turns_and_reply_answers(redis_url: str) -> None:
    """ScriptPool.send_now writes the command in the caller's own step (the gateway makes its
    answer while Redis runs the settle): Redis has run it before the event loop turns again.
    reply() gives its answer and the connection back. No free connection, or a pool bound to
    another event loop: None, and nothing is written (call_packed then takes the usual way)."""
    import hiredis
    import redis as sync_redis

    key = f"sendnow:{uuid.uuid4().hex}"
    sync = sync_redis.Redis.from_url(redis_url, decode_responses=True)

    async def scenario() -> script_pool.ScriptPool:
        client = _client(redis_url)
        script = client.register_script("redis.call('SET', KEYS[1], ARGV[1]) return 7")
        assert await script(keys=[key], args=["first"]) == 7  # loaded, one connection free
        scripts = _scripts(client)
        assert scripts.opened == 1 and len(scripts.free) == 1
        sent = scripts.send_now(hiredis.pack_command(("EVALSHA", script.sha, 1, key, "now")))
        assert sent is not None and scripts.in_use == 1
        # Still in this step: a blocking client sees the script's write.
        for _ in range(2000):
            if sync.get(key) == "now":
                break
            sync.execute_command("PING")
        assert sync.get(key) == "now"
        assert await scripts.reply(sent) == 7
        assert scripts.in_use == 0 and len(scripts.free) == 1
        # The only connection taken (a slow script in flight): nothing free, nothing written.
        scripts.size = 1
        slow = client.register_script(_busy(300000))
        await slow()
        busy = asyncio.ensure_future(slow())
        await asyncio.sleep(0.05)
        assert scripts.in_use == 1
        assert scripts.send_now(hiredis.pack_command(("EVALSHA", script.sha, 1, key, "no"))) is None
        assert await busy == 1
        assert sync.get(key) == "now"
        await client.aclose()
        return scripts

    scripts = asyncio.run(scenario())

    async def another_loop() -> None:
        # A pool bound to a loop that ended: not this loop's connections.
        assert scripts.send_now(b"*1\r\n$4\r\nPING\r\n") is None

    asyncio.run(another_loop())
    sync.delete(key)
    sync.close()


async def _incr_loaded(redis_url: str, key: str) -> tuple[Any, Any, Any, bytes]:
    """A client whose INCR script is loaded (the key at 1) with one script connection free, its
    pool, and the script's EVALSHA of `key`, packed for send_now."""
    import hiredis

    client = _client(redis_url)
    script = client.register_script("return redis.call('INCR', KEYS[1])")
    assert await script(keys=[key]) == 1
    return client, script, _scripts(client), hiredis.pack_command(("EVALSHA", script.sha, 1, key))


def test_a_sent_commands_round_trip_ends_when_its_reply_arrives(redis_url: str) -> None:
    """Sent.round_trip(): from the write to the reply's arrival (the loop's reading of it), not
    to the moment its caller gets to it: what runs before the caller's turn (under load, other
    calls' steps) is not Redis' time and must not show in the gateway's Redis latency
    histogram. After a resend on a new connection: to that connection's reply."""
    key = f"sendnow:{uuid.uuid4().hex}"

    async def scenario() -> None:
        client, script, scripts, command = await _incr_loaded(redis_url, key)
        sent = scripts.send_now(command)
        assert sent is not None
        conn = sent.conn
        for _ in range(200):  # the reply arrives while the caller does something else
            await asyncio.sleep(0.001)
            if sent.waiter.done():
                break
        assert sent.waiter.done()
        await asyncio.sleep(0.1)  # the caller's own work, after the arrival
        assert await scripts.reply(sent) == 2
        read_after = time.perf_counter() - sent.at
        assert read_after >= 0.1
        assert 0 < sent.round_trip() < read_after - 0.09
        assert sent.replied_at == conn.replied_at
        # The connection breaks after the write: the reply that counts is the resend's.
        sent = scripts.send_now(command)
        assert sent is not None
        sent.conn.transport.abort()
        assert await scripts.reply(sent) in (3, 4)
        assert 0 < sent.round_trip() <= time.perf_counter() - sent.at
        assert sent.replied_at != conn.replied_at
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())


def test_a_sent_command_whose_connection_breaks_is_sent_once_more(redis_url: str) -> None:
    """The connection breaks after send_now wrote: reply() sends the command once more on a new
    connection, as call_packed does (the scripts are idempotent per request id); a reply
    awaited by a caller that is cancelled closes its connection and frees its slot."""
    import hiredis

    key = f"sendnow:{uuid.uuid4().hex}"

    async def scenario() -> None:
        client, script, scripts, command = await _incr_loaded(redis_url, key)
        sent = scripts.send_now(command)
        assert sent is not None
        sent.conn.transport.abort()  # injected: the socket breaks after the write
        value = await scripts.reply(sent)
        assert value == int(await client.get(key)) and value in (2, 3)
        assert sent.conn.closed and scripts.opened == 1 and len(scripts.free) == 1
        # Cancelled while the reply is on its way: that connection is closed, its slot freed.
        slow = client.register_script(_busy(400000))
        await slow()
        (conn,) = scripts.free
        sent = scripts.send_now(hiredis.pack_command(("EVALSHA", slow.sha, 0)))
        assert sent is not None and sent.conn is conn
        waiting = asyncio.ensure_future(scripts.reply(sent))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert conn.closed and scripts.in_use == 0 and scripts.opened == 0
        assert await script(keys=[key]) == value + 1
        await client.delete(key)
        await client.aclose()

    asyncio.run(scenario())
