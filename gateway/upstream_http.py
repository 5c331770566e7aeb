"""A lean HTTP/1.1 client transport for upstream calls, plugged into httpx.

httpx stays the gateway's HTTP API (requests, responses, exceptions, content decoding), but its
default transport (httpcore over anyio, parsing with the pure-Python h11) was the largest share
of the gateway's CPU per request (docs/benchmarks.md). This is an `httpx.AsyncBaseTransport`, the
documented extension point, written for the one thing the gateway does: POST a small JSON body to
an OpenAI-compatible API and read the answer, possibly streamed. It keeps a pool of keep-alive
connections per origin on asyncio protocols and parses responses with httptools (the C parser
uvicorn uses).

Not supported, by design: HTTP/2, proxies, protocol upgrades (a 101 is a RemoteProtocolError;
interim 1xx answers are skipped), request bodies that are not already in memory being streamed
lazily (they are read first).

Errors are httpx's, so callers cannot tell the transports apart: ConnectError / ConnectTimeout
when no connection could be made, PoolTimeout when every connection stayed busy (the gateway
tries the next provider key on these three only: nothing was sent), ReadTimeout between bytes
(a failed write surfaces as one of the read errors), RemoteProtocolError when the server hangs
up mid-response, ReadError when the connection is reset.

GATEWAY_UPSTREAM_TRANSPORT picks the transport (make_transport, at the end, builds each): this
one ("native", the default), httpx-aiohttp's on aiohttp's client ("aiohttp",
gateway/upstream_aiohttp.py) or httpx's own ("httpx"). tests/gateway/test_upstream_http.py is
their common contract and names the cases where the other two behave otherwise; `make bench`
compares their CPU per call (docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator

import certifi
import httptools
import httpx

from gateway.deadlines import deadline_in
from quotas.loop_spin import SpinSite

_HIGH_WATER = 1 << 20  # pause reading an unread body beyond this many buffered bytes
_DEFAULT_PORTS = {b"http": 80, b"https": 443}
Origin = tuple[bytes, bytes, int]


def default_ssl_context() -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.wakeup: asyncio.Future[None] | None = None
        self.paused = False
        self.delimited_by_close = False
        self.interim = False  # parsing a 1xx answer, which the final one follows
        self.encoded = False  # the answer has a Content-Encoding (httpx decodes it)

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # A 101: the connection now speaks another protocol (the parser raises after it).
            self._fail(httpx.RemoteProtocolError("Unexpected protocol upgrade from upstream."))
            self._close_transport()
        except httptools.HttpParserError as exc:
            if not self.complete:  # else the answer is whole; only what came after it was bad
                self._fail(httpx.RemoteProtocolError(f"Malformed upstream response: {exc}"))
            self._close_transport()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if exc is not None:
            # A reset or a socket error, not a close: even a body that ends with the connection
            # did not end here (the upstream crashed mid-stream), so it must not pass as whole.
            self._fail(httpx.ReadError(f"Upstream connection failed: {exc!r}"))
        elif self.headers_done.done() and self.delimited_by_close:
            self.complete = True  # a body without length or chunking ends with the connection
            self._wake()
        else:
            self._fail(httpx.RemoteProtocolError(
                "Server disconnected without sending a complete response."))

    def pause_writing(self) -> None:  # request bodies are small; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes after the whole answer, or on an idle connection, answer no request of ours
            # (a confused server; a 408 before closing an idle connection). Stop parsing (the
            # parser raises HttpParserCallbackError) so they neither extend this body nor
            # answer the next request; data_received then closes the connection.
            raise httpx.RemoteProtocolError("Unsolicited bytes from upstream.")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            # An interim answer (100 Continue, 103 Early Hints) is not the answer: the final one
            # follows on this connection. Returning it would hand the caller an empty response
            # and pool the connection with the real answer still on its way.
            self.interim = True
            self.headers = []
            return
        names = {name.lower() for name, _ in self.headers}
        self.encoded = b"content-encoding" in names
        self.delimited_by_close = b"content-length" not in names and not any(
            name.lower() == b"transfer-encoding" and b"chunked" in value.lower()
            for name, value in self.headers)
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        # The parser found the end (a 204 or 304 has no body whatever its headers say): the
        # body did not end with the connection, and the connection may carry another request.
        self.delimited_by_close = False
        # Read now: once the callback returns, the parser has reset for the next message.
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- helpers ----------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # mark retrieved: a waiter may already be gone
        self._wake()

    def _close_transport(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        # wakeup is set while a read is in flight in another task (forward.py reads in a
        # shielded task of its own): that read would take the next exchange's body.
        # (A body that ended with the connection is complete but closed.)
        return (not self.closed and self.complete and self.error is None
                and self.keep_alive and self.wakeup is None)

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The next piece of the body, None at its end."""
        while True:
            if self.chunks:
                if len(self.chunks) == 1:
                    chunk = self.chunks.popleft()
                else:
                    # Pieces that arrived together (stream events the upstream sent in a burst,
                    # read at once) go up as one: the relay's cost is per piece, not per byte.
                    chunk = b"".join(self.chunks)
                    self.chunks.clear()
                self.buffered -= len(chunk)
                if self.paused and self.buffered <= _HIGH_WATER // 2 and self.transport:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            self.wakeup = asyncio.get_running_loop().create_future()
            try:
                async with deadline_in(timeout):
                    await self.wakeup
            except TimeoutError:
                raise httpx.ReadTimeout("Timed out reading the upstream response.") from None
            finally:
                self.wakeup = None


class _Body(httpx.AsyncByteStream):
    def __init__(self, transport: NativeTransport, conn: _Connection, read_timeout: float | None
                 ) -> None:
        self.transport = transport
        self.conn = conn
        self.read_timeout = read_timeout
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # finally, not only at the end: a read that fails or is cancelled (the gateway's view is
        # cancelled when its client leaves, possibly inside response.aread(), and then never
        # calls aclose()) must still give the slot back, or the pool shrinks by one each time.
        try:
            while (chunk := await self.conn.next_chunk(self.read_timeout)) is not None:
                yield chunk
        finally:
            await self.aclose()

    async def read_all(self) -> bytes:
        """The whole body, read straight from the connection (see read_answer)."""
        chunks: list[bytes] = []
        try:
            while (chunk := await self.conn.next_chunk(self.read_timeout)) is not None:
                chunks.append(chunk)
        finally:
            await self.aclose()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.transport._finished(self.conn)


async def read_answer(response: httpx.Response) -> bytes:
    """`await response.aread()`, the whole body of an upstream answer, with its errors. An
    unencoded body of the native transport is read straight from its connection: aread() passes
    the same bytes through a content decoder, a chunker and two async generators (-3.5 %
    instructions per plain call, docs/benchmarks.md). Afterwards the response is as aread()
    leaves it (content set, stream consumed and closed, the connection back in the pool, or
    closed after a failure); only an error raised here has no `request` attribute set (httpx's
    request context), which no caller reads."""
    stream = response.stream
    if (type(stream) is _Body and not stream.conn.encoded and not stream.done
            and not response.is_stream_consumed and not response.is_closed):
        response.is_stream_consumed = True
        response._content = await stream.read_all()
        response.is_closed = True  # as aread() leaves a body read to its end
        return response._content
    return await response.aread()


def answer_arrived(response: httpx.Response) -> bool:
    """Whether the whole body of `response` is here already, so that reading it (read_answer)
    cannot wait: an unencoded answer of the native transport whose connection has it all (a
    short answer usually comes with its headers). False when it cannot tell (another transport)."""
    stream = response.stream
    if type(stream) is not _Body or stream.done:
        return False
    conn = stream.conn
    return conn.complete and conn.error is None and not conn.encoded


class NativeTransport(httpx.AsyncBaseTransport):
    # Below the 5 s idle timeout of uvicorn, vLLM and many proxies: a connection the server is
    # about to close is dropped by us first, instead of racing its FIN with a request (a 502).
    def __init__(self, *, max_connections: int, keepalive_expiry: float = 4.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._slots = asyncio.BoundedSemaphore(max_connections)
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._expiry = keepalive_expiry
        self._ssl = ssl_context
        self._closed = False
        # Per origin, whether its answers come within the loop's spin (quotas/loop_spin.py): a
        # real model's never do, so its calls soon stop spinning for them.
        self._spin_sites: dict[Origin, SpinSite] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        # Encoded ahead (encode_ahead), once: a second send of the same request encodes it again.
        ahead: _Wire | None = request.__dict__.pop(_WIRE, None)
        if ahead is not None:
            origin, data = ahead
        else:
            origin, data = await _encode(request)

        if self._slots.locked():  # every slot in use: wait for one, up to the pool timeout
            try:
                async with deadline_in(timeouts.get("pool")):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("No upstream connection became free in time.") from None
        else:
            await self._slots.acquire()  # a free slot: taken at once, no timer to arm
        conn: _Connection | None = None
        try:
            conn = await self._connection(origin, timeouts.get("connect"))
            conn.transport.write(data)  # type: ignore[union-attr]
            spin = self._spin_sites.get(origin) or self._spin_sites.setdefault(origin, SpinSite())
            spun = spin.kick(conn.headers_done.get_loop())
            async with deadline_in(timeouts.get("read")):
                await conn.headers_done
            spin.replied(spun)
        except BaseException as exc:
            # Timed out, failed or cancelled (the client left) before the answer's headers:
            # this connection is mid-exchange and can never carry another request.
            if conn is not None:
                conn._close_transport()
            self._slots.release()
            if isinstance(exc, TimeoutError):
                raise httpx.ReadTimeout("Timed out waiting for the upstream's answer.") from None
            raise
        stream = _Body(self, conn, timeouts.get("read"))
        return httpx.Response(
            conn.status, headers=conn.headers, stream=stream, request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _connection(self, origin: Origin, connect_timeout: float | None) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: least likely to have been closed
            if (not conn.closed and now - conn.idle_since < self._expiry
                    and not _undelivered_input(conn.transport)):  # type: ignore[arg-type]
                conn._reset()
                return conn
            conn._close_transport()
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == b"https":
            tls = self._ssl or default_ssl_context()
        try:
            async with deadline_in(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin), host.decode("ascii"), port, ssl=tls,
                    server_hostname=host.decode("ascii") if tls else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"Timed out connecting to {host.decode()}:{port}.") from None
        except OSError as exc:
            raise httpx.ConnectError(f"Could not connect to {host.decode()}:{port}: {exc}") from None
        return conn

    def _finished(self, conn: _Connection) -> None:
        """The response's body was read or closed: keep the connection if it can carry another
        request, and free its slot."""
        if conn.reusable() and not self._closed:
            if conn.paused:  # the whole body arrived but was not read: read the next answer
                conn.paused = False
                conn.transport.resume_reading()  # type: ignore[union-attr]
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.origin, deque()).append(conn)
        else:
            conn._close_transport()
        self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn._close_transport()
        self._idle.clear()


def _undelivered_input(transport: asyncio.Transport) -> bool:
    """Whether an idle connection's socket holds input the event loop has not delivered yet:
    almost always the server's FIN or RST after its keep-alive timeout. A busy loop may not call
    connection_lost for a whole iteration, and a request written meanwhile fails with
    RemoteProtocolError although no request was lost; httpcore makes the same check."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    if not hasattr(select, "poll"):  # Windows; select() is fine for its few descriptors
        return bool(select.select([sock], [], [], 0)[0])
    poller = select.poll()  # not select(): descriptors past 1023 are normal under load
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


# A request's origin and its bytes on the wire, encoded ahead of its send (encode_ahead).
_Wire = tuple[Origin, bytes]
_WIRE = "_tollgate_wire"  # the attribute of an httpx.Request that holds its _Wire


def _origin(url: httpx.URL) -> Origin:
    scheme = url.raw_scheme
    if scheme not in _DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"Unsupported URL scheme {url.scheme!r}.")
    return (scheme, url.raw_host, url.port or _DEFAULT_PORTS[scheme])


async def _encode(request: httpx.Request) -> _Wire:
    """The request's origin and its bytes: its head, then its body (read whole, sent with a
    length: a streamed body's chunk framing is dropped)."""
    origin = _origin(request.url)  # an unsupported scheme is refused before the body is read
    body = request.content if isinstance(request.stream, httpx.ByteStream) else \
        await request.aread()
    if "transfer-encoding" in request.headers:
        # A streamed body was read whole above: send it with a length, not chunk framing.
        del request.headers["transfer-encoding"]
        request.headers["content-length"] = str(len(body))
    return _wire(origin, request, body)


def _wire(origin: Origin, request: httpx.Request, body: bytes) -> _Wire:
    return origin, _request_head(request) + body


def encode_ahead(transport: httpx.AsyncBaseTransport, request: httpx.Request) -> None:
    """Encode `request` for `transport` now, if it is a NativeTransport (the others have
    nothing to do ahead), so that its send is its write: the gateway calls it for the request
    it makes while the call's reserve is in flight (forward.Prepared), which takes the
    encoding's 15-20 us of a one-client call (the origin, the head's bytes, the header lookups)
    off the way from the reserve's reply to the upstream (docs/benchmarks.md). `request` must
    not change afterwards: its send uses these bytes, once. A body in memory only, with no
    chunk framing to drop (anything else is encoded at its send, as without this); an
    unsupported scheme is left for the send to refuse."""
    if (not isinstance(transport, NativeTransport)
            or not isinstance(request.stream, httpx.ByteStream)
            or "transfer-encoding" in request.headers
            or request.url.raw_scheme not in _DEFAULT_PORTS):
        return
    request.__dict__[_WIRE] = _wire(_origin(request.url), request, request.content)


def _request_head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines.extend(name + b": " + value for name, value in request.headers.raw)
    return b"\r\n".join(lines) + b"\r\n\r\n"


TRANSPORTS = ("native", "aiohttp", "httpx")
# Below the 5 s idle timeout of uvicorn, vLLM and many proxies, for every transport (see
# NativeTransport).
KEEPALIVE_EXPIRY = 4.0


def make_transport(kind: str, *, max_connections: int,
                   ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncBaseTransport:
    """The upstream transport named by GATEWAY_UPSTREAM_TRANSPORT, the one place any is built:
    "native" (NativeTransport), "aiohttp" (httpx-aiohttp's AiohttpTransport: aiohttp's client
    and its C parser) or "httpx" (httpx's own, on httpcore and h11). Each keeps at most
    `max_connections` upstream connections, idle ones for KEEPALIVE_EXPIRY seconds, and checks
    certificates against `ssl_context` (default: certifi's public CAs)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown upstream transport {kind!r}: one of {', '.join(TRANSPORTS)}")
    tls = ssl_context or default_ssl_context()
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections,
                          keepalive_expiry=KEEPALIVE_EXPIRY)
    if kind == "httpx":
        return httpx.AsyncHTTPTransport(verify=tls, limits=limits)
    if kind == "aiohttp":
        from gateway.upstream_aiohttp import aiohttp_transport  # aiohttp loads only if chosen

        return aiohttp_transport(tls, limits)
    return NativeTransport(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY,
                           ssl_context=tls)
