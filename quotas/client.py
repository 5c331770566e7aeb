"""Redis clients for the quota engine, built from settings (REDIS_URL, REDIS_CLUSTER).

A standalone server and a Redis Cluster are both supported; the engine takes whichever client
these return. Timeouts are short on purpose: an unreachable quota store must fail the request
fast (HTTP 503), not hang it.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from redis.backoff import NoBackoff

from quotas.loop_spin import SpinSite

try:
    from quotas.script_pool import ScriptPool
except ImportError:  # hiredis, or the redis-py parser it reuses, missing: redis-py's path
    ScriptPool = None  # type: ignore[assignment, misc]

try:
    import hiredis
except ImportError:  # a declared dependency; without it redis-py packs in Python as usual
    hiredis = None

# Argument types hiredis packs exactly as redis-py's Encoder does (str as UTF-8, int and float by
# repr): anything else (bool, None, memoryview, enums...) goes through redis-py's own packer.
_PLAIN_ARGS = frozenset((str, bytes, int, float))


def _options(asynchronous: bool = False) -> dict[str, object]:
    # redis-py retries with exponential backoff by default (seconds in all); one immediate retry
    # covers a pooled connection that went stale after a Redis restart, and no more.
    retry_cls = redis.asyncio.retry.Retry if asynchronous else redis.retry.Retry
    return {
        "decode_responses": True,
        "socket_timeout": settings.REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": settings.REDIS_SOCKET_TIMEOUT,
        "retry": retry_cls(NoBackoff(), 1),
        # No CLIENT SETINFO on each new connection: it only labels the connection in CLIENT
        # LIST, costs a round trip per connection, and Redis before 7.2 (the embedded server is
        # 6.2) answers it with an error that redis-py raises and swallows, leaving a traceback
        # cycle for the garbage collector (tests/gateway/test_e2e_no_cycles.py).
        "driver_info": None,
    }


@functools.lru_cache(maxsize=None)
def _c_packing(connection_class: type[Any]) -> type[Any]:
    """`connection_class` packing commands with hiredis's C packer: redis-py's asyncio
    connections pack in Python, argument by argument, which was the largest single cost of a
    gateway call's two script calls (each has about 90 KEYS and ARGV). The sync client already
    does this when hiredis is installed (redis.connection.HiredisRespSerializer); the bytes on
    the wire are the same."""

    class CPackingConnection(connection_class):  # type: ignore[valid-type, misc]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            encoder = self.encoder
            self._c_pack = (hiredis is not None and encoder.encoding.lower() in ("utf-8", "utf8")
                            and encoder.encoding_errors == "strict")

        def pack_command(self, *args: Any) -> list[bytes]:
            # A first argument with a space ("CONFIG GET") is split by redis-py's packer.
            if self._c_pack and _PLAIN_ARGS.issuperset(map(type, args)) and (
                    " " not in args[0] if type(args[0]) is str else b" " not in args[0]):
                return [hiredis.pack_command(args)]
            return super().pack_command(*args)

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            # redis-py writes every command through asyncio.wait_for (a task of its own, per
            # command) to bound the drain by the socket timeout; but a drain with the whole
            # command in the kernel's buffer returns at once. So: write, and only when the
            # transport kept some of it wait for the rest the way redis-py does (its drain,
            # under its timeout, with its error handling). A reset the drain would have raised
            # is raised by the read that follows, as the same ConnectionError (retried alike).
            writer = self._writer
            if (type(command) is list and writer is not None and not self.health_check_interval
                    and not writer.transport.is_closing()):
                writer.writelines(command)
                if not writer.transport.get_write_buffer_size():
                    return
                command = []
            await super().send_packed_command(command, check_health)

    CPackingConnection.__name__ = CPackingConnection.__qualname__ = (
        f"CPacking{connection_class.__name__}")
    return CPackingConnection


class _BlockingPool(redis.asyncio.BlockingConnectionPool):
    """redis-py's blocking pool, with the common case taken at once: a free connection, nobody
    waiting for one. redis-py takes every connection under an asyncio.Condition and a timeout,
    through an async context manager, a deprecation wrapper and observability hooks, and gives
    it back under the condition with a re-authentication event: about a tenth of a gateway
    call's CPU for its two script calls. Here a take pops a free connection and checks it as
    redis-py does (ensure_connection), and a give-back returns it to the free list; whenever a
    caller waits (all connections in use), the pool is in maintenance mode, or connections
    re-authenticate with a streaming credential provider, both go through redis-py's own path,
    which hands freed connections to the waiters in turn.

    It reads the pool's lists of free and used connections and its maintenance flag, which are
    not a public interface: tests/quotas/test_client_pool.py pins the behaviour on the installed
    redis-py, and a redis-py without them gets its own path (_FAST_POOL below)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slow_takers = 0  # callers in redis-py's take: maybe waiting for a connection
        # Streaming credentials re-authenticate connections on their give-back (redis-py's
        # release event): only redis-py's path does that.
        self._fast = _FAST_POOL and self.connection_kwargs.get("credential_provider") is None

    async def get_connection(self, command_name: Any = None, *keys: Any,
                             **options: Any) -> Any:
        free = self._available_connections
        if free and self._fast and not self._slow_takers and not self._in_maintenance:
            connection = free.pop()
            self._in_use_connections.add(connection)
            try:
                await self.ensure_connection(connection)
            except BaseException:
                await self.release(connection)
                raise
            return connection
        self._slow_takers += 1
        try:
            return await super().get_connection()
        finally:
            self._slow_takers -= 1

    async def ensure_connection(self, connection: Any) -> None:
        # redis-py's check, without its connect() (a retry loop around a coroutine that
        # returns at once) when the connection is up and has nothing unread: it is ready.
        try:
            ready = connection.is_connected and not await connection.can_read()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            # redis-py 8.2's can_read() raises for a socket the server closed (8.1 found it
            # readable): not ready either way, and redis-py's own check below reconnects it.
            ready = False
        if ready:
            return
        await super().ensure_connection(connection)

    async def release(self, connection: Any) -> None:
        if not self._fast or self._slow_takers or self._in_maintenance:
            await super().release(connection)  # wakes a waiter
            return
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():
            await connection.disconnect()
        self._available_connections.append(connection)


# The redis-py internals _BlockingPool reads (checked once: without them, redis-py's own path).
_FAST_POOL = all(hasattr(redis.asyncio.BlockingConnectionPool(), name) for name in (
    "_available_connections", "_in_use_connections", "_in_maintenance", "ensure_connection"))


class _ScriptCallingRedis(redis.asyncio.Redis):
    """redis-py's asyncio client with its EVALSHA (the hot path's only command: a reserve and a
    settle per call) sent on connections of its own (`scripts`: quotas/script_pool.py). For a
    URL the script pool does not speak, an EVALSHA goes the short way through redis-py instead:
    a connection from the pool, redis-py's own retry (disconnect, then once more) around writing
    the packed command and reading the reply, the connection given back, without redis-py's
    per-command observability hooks (each an awaited call that finds no collector: Tollgate
    does not turn redis-py's OpenTelemetry on), its HIMPORT check and three more coroutines.
    Every other command, and any call with options or arguments hiredis does not pack as
    redis-py would, goes through redis-py as before."""

    scripts: ScriptPool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # redis-py's path for the scripts: whether its replies come within the loop's spin
        self.spin = SpinSite()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        pool = self.connection_pool
        if (args[0] != "EVALSHA" or options or self.single_connection_client
                or type(pool) is not _BlockingPool):
            return await super().execute_command(*args, **options)
        scripts = self.scripts
        if scripts is not None and _PLAIN_ARGS.issuperset(map(type, args)):
            return await scripts.call(args)
        conn = await pool.get_connection()
        try:
            return await conn.retry.call_with_retry(
                lambda: _round_trip(conn, args, self.spin),
                lambda error, failures: conn.disconnect(error=error, failure_count=failures),
                with_failure_count=True)
        finally:
            await pool.release(conn)

    def script_pool(self) -> ScriptPool | None:
        """The script connections an EVALSHA without options goes on (execute_command's way), for
        a command packed ahead (the engine's reserve and settle); None where it goes through
        redis-py."""
        if self.single_connection_client or type(self.connection_pool) is not _BlockingPool:
            return None
        return self.scripts

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if self.scripts is not None:
            await self.scripts.aclose()
        await super().aclose(close_connection_pool)


async def _round_trip(conn: Any, args: tuple[Any, ...], spin: SpinSite) -> Any:
    await conn.send_packed_command(conn.pack_command(*args))
    spun = spin.kick(asyncio.get_running_loop())
    reply = await conn.read_response()
    spin.replied(spun)
    return reply


def make_redis(url: str | None = None, *, cluster: bool | None = None) -> redis.Redis | redis.RedisCluster:
    url = url or settings.REDIS_URL
    if settings.REDIS_CLUSTER if cluster is None else cluster:
        return redis.RedisCluster.from_url(url, **_options())
    # A blocking pool: under a burst, a request waits (up to the socket timeout) for a free
    # connection instead of failing with "too many connections".
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=settings.REDIS_SOCKET_TIMEOUT,
        **_options())
    return redis.Redis(connection_pool=pool)


# Set while this task holds a turn of a cluster client: a pipeline that retries its redirected
# commands one by one (redis-py does, during a resharding) must not wait for a second turn.
_holding_turn: contextvars.ContextVar[bool] = contextvars.ContextVar("holding_turn", default=False)


class _Turns:
    """At most `size` Redis operations in flight at once; a caller past that waits its turn, up
    to `timeout` seconds, then gets redis-py's "No connection available" ConnectionError, as the
    standalone client's BlockingConnectionPool does."""

    __slots__ = ("semaphore", "timeout", "spin")

    def __init__(self, size: int, timeout: float) -> None:
        self.semaphore = asyncio.Semaphore(size)
        self.timeout = timeout
        self.spin = SpinSite()  # whether the cluster answers within the loop's spin

    async def run(self, operation: Any) -> Any:
        """Await `operation()` in a turn."""
        if _holding_turn.get():
            return await operation()
        if self.semaphore.locked():
            try:
                async with asyncio.timeout(self.timeout):
                    await self.semaphore.acquire()
            except TimeoutError:
                raise redis.exceptions.ConnectionError("No connection available.") from None
        else:
            await self.semaphore.acquire()  # a free turn: taken without waiting
        token = _holding_turn.set(True)
        spun = self.spin.kick(asyncio.get_running_loop())  # redis-py writes it in operation()
        try:
            result = await operation()
            self.spin.replied(spun)
            return result
        finally:
            _holding_turn.reset(token)
            self.semaphore.release()


class _WaitingClusterPipeline(redis.asyncio.cluster.ClusterPipeline):
    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        turns: _Turns = self.cluster_client.turns  # type: ignore[attr-defined]
        return await turns.run(lambda: super(_WaitingClusterPipeline, self).execute(*args, **kwargs))


class WaitingRedisCluster(redis.asyncio.RedisCluster):
    """redis-py's asyncio cluster client raises MaxConnectionsError at once when a node's
    `max_connections` are all in use (its node pools never wait), so a burst of more concurrent
    calls than REDIS_MAX_CONNECTIONS in one gateway worker was refused 503
    quota_store_unavailable on a cluster, where a standalone Redis makes them wait for a
    connection. Here every command and pipeline takes a turn first (at most max_connections in
    flight per client; each uses at most one connection per node at a time, so no node's pool
    is ever exhausted), waiting up to the socket timeout like the standalone pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turns = _Turns(kwargs.get("max_connections") or 2**31,
                            kwargs.get("socket_timeout") or settings.REDIS_SOCKET_TIMEOUT)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self.turns.run(lambda: super(WaitingRedisCluster, self).execute_command(
            *args, **kwargs))

    def pipeline(self, transaction: Any = None, shard_hint: Any = None,
                 ) -> redis.asyncio.cluster.ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py, as before
        return _WaitingClusterPipeline(self, transaction)


def make_async_redis(
    url: str | None = None, *, cluster: bool | None = None
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    url = url or settings.REDIS_URL
    if settings.REDIS_CLUSTER if cluster is None else cluster:
        return WaitingRedisCluster.from_url(
            url, max_connections=settings.REDIS_MAX_CONNECTIONS, **_options(asynchronous=True))
    pool = _BlockingPool.from_url(
        url, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=settings.REDIS_SOCKET_TIMEOUT,
        **_options(asynchronous=True))
    # The class the URL chose (TCP, TLS or a Unix socket), packing in C. (The cluster client
    # builds its nodes' connections itself and keeps redis-py's packer.)
    pool.connection_class = _c_packing(pool.connection_class)
    client = _ScriptCallingRedis(connection_pool=pool)
    client.scripts = _script_pool(pool)
    return client


# Connection settings the script pool applies as redis-py does (or that do not change what goes on
# the wire); a URL or client with any other setting keeps redis-py's path for the scripts.
_SCRIPT_POOL_KWARGS = frozenset((
    "host", "port", "path", "db", "username", "password", "socket_timeout",
    "socket_connect_timeout", "decode_responses", "encoding", "encoding_errors", "retry",
    "driver_info", "health_check_interval", "himport_registry", "maint_notifications_config",
    "maint_notifications_pool_handler", "orig_host_address", "orig_socket_timeout",
    "orig_socket_connect_timeout"))


def _script_pool(pool: _BlockingPool) -> ScriptPool | None:
    """The script connections for the settings `pool` was made with (its URL's included): the
    same bound (`max_connections` more connections at most), the same waits and timeouts. None
    for settings they do not implement (TLS, a credential provider, RESP3, a client name,
    keepalive options, decoding other than UTF-8...): redis-py's path carries the scripts then."""
    if ScriptPool is None:
        return None
    kwargs = pool.connection_kwargs
    kind = pool.connection_class
    if (not _SCRIPT_POOL_KWARGS.issuperset(kwargs)
            or issubclass(kind, redis.asyncio.connection.SSLConnection)
            or not kwargs.get("decode_responses")
            or str(kwargs.get("encoding", "utf-8")).lower() not in ("utf-8", "utf8")
            or kwargs.get("encoding_errors", "strict") != "strict"
            or kwargs.get("health_check_interval")):
        return None
    timeout = kwargs.get("socket_timeout") or settings.REDIS_SOCKET_TIMEOUT
    common = {"size": pool.max_connections, "timeout": timeout, "wait_timeout": pool.timeout,
              "connect_timeout": kwargs.get("socket_connect_timeout") or timeout,
              "db": int(kwargs.get("db") or 0), "username": kwargs.get("username"),
              "password": kwargs.get("password")}
    if issubclass(kind, redis.asyncio.connection.UnixDomainSocketConnection):
        return ScriptPool(path=kwargs["path"], **common)
    if issubclass(kind, redis.asyncio.connection.Connection):
        return ScriptPool(host=kwargs.get("host", "localhost"), port=int(kwargs.get("port", 6379)),
                          **common)
    return None
