"""The connections that carry the gateway's script calls (EVALSHA: a reserve and a settle per
call), on asyncio protocols of their own, beside redis-py's pool for every other command.

Why not redis-py's connection: each of its round trips goes through an asyncio StreamReader and
StreamWriter, a read wrapper with a timeout context, its retry helper and the pool's take and
give-back; here a call is one `transport.write` of the command hiredis packs, one future the
protocol resolves with the reply hiredis parses, and one timer (the figures: docs/benchmarks.md,
"Issue 16 item 3 against the issue's own baseline"). The parsing is hiredis's (the C parser
redis-py uses), the error replies are redis-py's exception classes (its own parse_error), and
the behaviour is redis-py's, pinned by tests/quotas/test_client_scripts.py:

- at most `size` connections; a caller past that waits for a freed one up to `wait_timeout`,
  then gets redis-py's "No connection available." ConnectionError (its BlockingConnectionPool's);
- connecting and each reply are bounded by `timeout` (redis-py's socket timeouts);
- a call whose connection breaks or times out is sent again once on a new connection (redis-py's
  Retry(NoBackoff(), 1), which the other commands keep); the scripts are idempotent per request
  id, as they must be under redis-py's retry too;
- an error reply (a script's error_reply, NOSCRIPT) is raised as redis-py raises it, and the
  connection stays in the pool;
- a connection whose call failed, timed out or was cancelled mid-reply is closed, never reused
  (its late reply would answer the next call);
- an idle connection the server closed is dropped on the next take.

Only plain Redis over TCP or a Unix socket, RESP2, with an optional AUTH and SELECT: a URL asking
for anything else (TLS, a credential provider, RESP3, a client name...) keeps redis-py's path for
the scripts too (quotas/client.py decides).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
import redis.exceptions
from redis._parsers.base import BaseParser

from quotas.loop_spin import SpinSite

_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class _ScriptConnection(asyncio.Protocol):
    """One connection to Redis carrying one command at a time."""

    def __init__(self) -> None:
        # Decoded as the gateway's redis-py clients are (decode_responses); error replies made
        # into redis-py's exceptions by redis-py's own parser (NoScriptError for NOSCRIPT...).
        self.reader = hiredis.Reader(encoding="utf-8", replyError=BaseParser.parse_error)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Any] | None = None
        # When the last reply was read and parsed (time.perf_counter()): a round trip's end,
        # whenever its caller gets to it.
        self.replied_at = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                # redis-py raises InvalidResponse, which reached the engine's callers as an
                # unexpected error; here it is a broken connection (retried, then the store
                # is unavailable: refused 503, fail closed).
                self._fail(redis.exceptions.ConnectionError(f"Protocol error from Redis: {exc}"))
                return
            if reply is False:
                return
            waiter = self.waiter
            if waiter is None or waiter.done():
                # A reply nobody asked for (the late answer of a call that timed out): this
                # connection can no longer tell which reply answers what.
                self._fail(redis.exceptions.ConnectionError("Unexpected reply from Redis."))
                return
            self.waiter = None
            self.replied_at = time.perf_counter()
            waiter.set_result(reply)

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake(redis.exceptions.ConnectionError(
            "Connection closed by server." if exc is None else f"Connection lost: {exc!r}"))

    def _fail(self, error: Exception) -> None:
        self.close()
        self._wake(error)

    def _wake(self, error: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, command: bytes, timeout: float, loop: asyncio.AbstractEventLoop,
                      ) -> Any:
        """Send one packed command and return its reply (an error reply raised). On any failure
        or cancellation the connection is closed: a reply may still be on its way."""
        waiter, timer = self.send(command, timeout, loop)
        return await self.finish(waiter, timer)

    def send(self, command: bytes, timeout: float, loop: asyncio.AbstractEventLoop,
             ) -> tuple[asyncio.Future[Any], asyncio.TimerHandle | None]:
        """Write one packed command now: the future its reply resolves, and the timer bounding
        it (`finish` waits for both). A connection already closed fails the future instead; a
        write that raises is raised, the connection closed (the caller frees its slot)."""
        waiter: asyncio.Future[Any] = loop.create_future()
        if self.closed or self.transport is None or self.transport.is_closing():
            waiter.set_exception(redis.exceptions.ConnectionError("Connection closed."))
            return waiter, None
        self.waiter = waiter
        # A plain timer rather than asyncio.timeout: it fails the one future, no task is
        # cancelled and uncancelled.
        timer = loop.call_at(loop.time() + timeout, _expire, waiter,
                             redis.exceptions.TimeoutError, "Timeout reading from Redis.")
        try:
            self.transport.write(command)
        except BaseException:
            timer.cancel()
            self.close()
            raise
        return waiter, timer

    async def finish(self, waiter: asyncio.Future[Any], timer: asyncio.TimerHandle | None) -> Any:
        """The reply `send` wrote the command for (an error reply raised); see request()."""
        try:
            reply = await waiter
        except BaseException:
            self.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if self.waiter is waiter:
                self.waiter = None
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        first = reply[0] if type(reply) is list and reply else reply
        if isinstance(first, redis.exceptions.ConnectionError):
            # e.g. "max number of clients", LOADING (also as an array's first element): raised
            # as redis-py's parser raises them, and the connection is not reused.
            self.close()
            raise first
        return reply


@dataclass(slots=True)
class Sent:
    """A command written on a script connection (ScriptPool.call_packed, send_now) whose reply
    is still to come: the connection holds its pool slot until ScriptPool.reply."""

    conn: _ScriptConnection
    generation: int  # the pool's, when the connection was taken
    loop: asyncio.AbstractEventLoop
    command: bytes  # sent once more on a new connection if this one breaks
    waiter: asyncio.Future[Any]
    timer: asyncio.TimerHandle | None
    at: float  # time.perf_counter() when it was written: a round trip's start
    replied_at: float = 0.0  # when its reply arrived (set by ScriptPool.reply); 0: none did
    spun: int = 0  # the pool's SpinSite.kick for it (quotas/loop_spin.py); 0: it did not spin

    def round_trip(self) -> float:
        """Seconds from the write to the reply's arrival (the event loop's reading of it),
        once ScriptPool.reply returned it; not to the moment its caller got to it. Between the
        two, the loop runs whatever is ready before the caller (under load, other calls' steps),
        which is not Redis' time. (What runs on the loop before its next read of the socket
        still counts: the loop cannot see the reply sooner.) When no reply ended the call here
        (an error reply: NOSCRIPT has its caller load the script and run it another way), to
        now: the whole of it, as a call not written ahead is timed."""
        return (self.replied_at or time.perf_counter()) - self.at


def _expire(waiter: asyncio.Future[Any], error: type[Exception], message: str) -> None:
    """A timer's end: the waiter fails with `error(message)`, unless it was answered."""
    if not waiter.done():
        waiter.set_exception(error(message))


class ScriptPool:
    """At most `size` script connections to one Redis (see the module's docstring), used from
    one event loop at a time: a call on another loop (a new one, in tests) starts afresh, since
    transports cannot move between loops. `aclose()` closes the idle connections, and the ones
    in use when they come back; the pool can be used again after it."""

    def __init__(self, *, size: int, timeout: float, wait_timeout: float | None = None,
                 connect_timeout: float | None = None, path: str | None = None,
                 host: str = "localhost", port: int = 6379, db: int = 0,
                 username: str | None = None, password: str | None = None) -> None:
        self.size = size
        self.timeout = timeout
        self.wait_timeout = timeout if wait_timeout is None else wait_timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.path = path
        self.host, self.port = host, port
        self.setup = _setup_commands(db, username, password)
        self.generation = 0
        self.spin = SpinSite()  # whether this Redis answers within the loop's spin
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        # A new generation: connections of the previous one are closed when they come back,
        # and count in no bound any more.
        self.generation += 1
        self.loop = loop
        self.free: list[_ScriptConnection] = []
        self.opened = 0  # this generation's connections open or being opened, free or in use
        self.waiters: deque[asyncio.Future[_ScriptConnection | None]] = deque()

    @property
    def in_use(self) -> int:
        return self.opened - len(self.free)

    async def call(self, args: Sequence[Any]) -> Any:
        """`args` sent as one command (hiredis packs str, bytes, int and float); its reply."""
        return await self.call_packed(hiredis.pack_command(tuple(args)))

    async def call_packed(self, command: bytes) -> Any:
        """A command already packed (hiredis.pack_command, or quotas/resp.py); its reply."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self._bind(loop)
        generation = self.generation
        conn = await self._take(loop)  # holds a slot until _give or _lost
        return await self.reply(self._send(conn, generation, loop, command))

    def send_now(self, command: bytes) -> Sent | None:
        """`command` written at once on a free connection, its reply for `reply()` to wait for;
        None when no connection is free (or none of this event loop): call_packed then takes the
        usual way. For a caller with work to do between its write and its wait (the gateway's
        reserve: its call's task starts meanwhile; its settle: the answer is made while Redis
        runs the script). The caller must pass it to
        `reply()` (in a task made before it awaits anything): the connection stays taken until
        then."""
        loop = self.loop
        if loop is None or loop is not asyncio.get_running_loop():
            return None
        conn = self._free_connection()
        if conn is None:
            return None
        return self._send(conn, self.generation, loop, command)

    def _send(self, conn: _ScriptConnection, generation: int, loop: asyncio.AbstractEventLoop,
              command: bytes) -> Sent:
        try:
            waiter, timer = conn.send(command, self.timeout, loop)
        except BaseException:
            self._lost(conn, generation)  # the write itself failed: closed by send()
            raise
        return Sent(conn, generation, loop, command, waiter, timer, time.perf_counter(),
                    spun=self.spin.kick(loop))

    async def reply(self, sent: Sent) -> Any:
        """The reply to a command sent on one of this pool's connections (call_packed,
        send_now); the connection goes back to the pool, or is closed if its call failed."""
        conn, generation, loop, command = sent.conn, sent.generation, sent.loop, sent.command
        try:
            reply = await conn.finish(sent.waiter, sent.timer)
        except redis.exceptions.ResponseError:
            self._give(conn, generation)  # an error reply: the connection is fine
            raise
        except _ERRORS:
            # Once more on a new connection in the same slot, as redis-py's retry reconnects
            # the connection it holds, without waiting for the pool again.
            try:
                conn = await self._connect()
            except BaseException:
                self._slot_freed(generation)
                raise
            try:
                reply = await conn.request(command, self.timeout, loop)
            except redis.exceptions.ResponseError:
                self._give(conn, generation)
                raise
            except BaseException:
                self._lost(conn, generation)
                raise
        except BaseException:
            self._lost(conn, generation)  # cancelled mid-reply: closed by finish()
            raise
        sent.replied_at = conn.replied_at  # (the new connection's, after a resend)
        # Judged by the reply's arrival: a reserve written ahead is awaited after the call's
        # other work, later than its reply came (perf_counter's clock, in ns).
        self.spin.replied(sent.spun, int(sent.replied_at * 1e9))
        self._give(conn, generation)
        return reply

    async def aclose(self) -> None:
        for conn in self.free:
            conn.close()
        for waiter in self.waiters:  # callers waiting for a connection of the closed pool
            if not waiter.done():
                waiter.set_exception(redis.exceptions.ConnectionError("Connection pool closed."))
        self._reset(self.loop)

    # -- taking and giving back -------------------------------------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        for conn in self.free:  # idle connections of a loop that ran before this one
            try:
                conn.close()
            except RuntimeError:  # that loop is closed: its transports went with it
                pass
        self._reset(loop)

    def _free_connection(self) -> _ScriptConnection | None:
        free = self.free
        while free:
            conn = free.pop()
            if not conn.closed:
                return conn
            self.opened -= 1  # closed by the server while idle (nobody waits: one was free)
        return None

    async def _take(self, loop: asyncio.AbstractEventLoop) -> _ScriptConnection:
        conn = self._free_connection()
        if conn is not None:
            return conn
        if self.opened < self.size and not self.waiters:
            self.opened += 1
            return await self._open(self.generation)
        waiter: asyncio.Future[_ScriptConnection | None] = loop.create_future()
        self.waiters.append(waiter)
        timer = loop.call_at(loop.time() + self.wait_timeout, _expire, waiter,
                             redis.exceptions.ConnectionError, "No connection available.")
        generation = self.generation
        try:
            conn = await waiter
        except BaseException:
            timer.cancel()
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a connection (or a slot) just as this caller was cancelled: pass it on.
                handed = waiter.result()
                if handed is None:
                    self._slot_freed(generation)
                else:
                    self._give(handed, generation)
            else:
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        timer.cancel()
        if conn is None:  # the slot of a connection that closed: open one in it
            return await self._open(generation)
        return conn

    async def _open(self, generation: int) -> _ScriptConnection:
        """A new connection in a slot already counted in `opened`; the slot freed on failure."""
        try:
            return await self._connect()
        except BaseException:
            self._slot_freed(generation)
            raise

    def _give(self, conn: _ScriptConnection, generation: int) -> None:
        if generation != self.generation:
            conn.close()
            return
        if conn.closed:
            self._slot_freed(generation)
        elif not self._hand(conn):
            self.free.append(conn)

    def _lost(self, conn: _ScriptConnection, generation: int) -> None:
        conn.close()
        self._slot_freed(generation)

    def _slot_freed(self, generation: int) -> None:
        """A connection closed (or could not be opened): its slot goes to the first waiter, who
        opens a connection of its own; else the pool has one connection fewer."""
        if generation == self.generation and not self._hand(None):
            self.opened -= 1

    def _hand(self, handed: _ScriptConnection | None) -> bool:
        """Give a connection (or, None, a slot) to the first caller still waiting, if any."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(handed)
                return True
        return False

    async def _connect(self) -> _ScriptConnection:
        """A new connection, ready for scripts: one attempt, as redis-py's asyncio connect()
        makes (its retry covers only its own errors, not the socket's)."""
        loop = self.loop
        assert loop is not None
        where = self.path or f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.path is not None:
                    _, conn = await loop.create_unix_connection(_ScriptConnection, self.path)
                else:
                    _, conn = await loop.create_connection(_ScriptConnection, self.host,
                                                           self.port)
        except TimeoutError:
            raise redis.exceptions.TimeoutError(f"Timeout connecting to {where}.") from None
        except OSError as exc:
            raise redis.exceptions.ConnectionError(
                f"Error connecting to {where}: {exc}") from None
        try:
            for command in self.setup:
                await conn.request(command, self.timeout, loop)
        except BaseException:
            conn.close()
            raise
        return conn


def _setup_commands(db: int, username: str | None, password: str | None) -> list[bytes]:
    """What redis-py sends on a new connection of these settings (RESP2, no client name)."""
    commands = []
    if username or password:
        auth = ("AUTH", username, password or "") if username else ("AUTH", password)
        commands.append(hiredis.pack_command(auth))
    if db:
        commands.append(hiredis.pack_command(("SELECT", db)))
    return commands
