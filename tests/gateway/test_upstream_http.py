"""gateway/upstream_http.py: the upstream transports, against small real servers that answer in
every shape an upstream may (lengths, chunks, close-delimited, hang-ups, silence).

These tests are the transports' contract: each runs against every kind GATEWAY_UPSTREAM_TRANSPORT
can name. Where a transport is known to behave otherwise, its case is a strict xfail saying how
(a fix in a new release shows up as an XPASS); the native transport passes them all."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from gateway.upstream_http import (
    _WIRE,
    TRANSPORTS,
    answer_arrived,
    encode_ahead,
    make_transport,
    read_answer,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUTS = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0}


def run(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))  # type: ignore[arg-type]

    return wrapper


def transports(**differs: str) -> pytest.MarkDecorator:
    """Run the test once per transport kind (its `kind` argument); `differs` maps a kind that
    is known to fail the case to how it behaves instead."""
    unknown = set(differs) - set(TRANSPORTS)
    assert not unknown, unknown
    return pytest.mark.parametrize("kind", [
        pytest.param(kind, marks=pytest.mark.xfail(strict=True, reason=differs[kind]))
        if kind in differs else kind for kind in TRANSPORTS])


# The two ways the gateway reads a whole answer: httpx's aread(), and read_answer (what forward.py
# uses), which takes the native transport's unencoded body straight from its connection. The
# body-reading cases run with both, so the shortcut keeps aread's contract.
readers = pytest.mark.parametrize("how", ["aread", "read_answer"])


async def read(response: httpx.Response, how: str) -> bytes:
    return await (response.aread() if how == "aread" else read_answer(response))


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length)
    return head + body


class Server:
    """An asyncio TCP server on a free port, counting connections and requests."""

    def __init__(self, answer: Callable[[int], list[bytes | float]], keep_open: bool = True
                 ) -> None:
        self.answer = answer  # request number -> pieces to send (float: sleep seconds)
        self.keep_open = keep_open
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    self.requests.append(await _read_request(reader))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                for piece in self.answer(len(self.requests)):
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
                if not self.keep_open:
                    return
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def _request(base: str, path: str = "/v1/chat/completions") -> httpx.Request:
    return httpx.Request("POST", f"{base}{path}", content=b'{"model":"m"}',
                         headers={"content-type": "application/json"},
                         extensions={"timeout": TIMEOUTS})


def _json_answer(body: bytes = b'{"ok":true}') -> list[bytes | float]:
    return [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body]


@transports()
@readers
@run
async def test_reuses_one_keep_alive_connection(kind: str, how: str) -> None:
    server = Server(lambda n: _json_answer(b'{"n":%d}' % n))
    async with server as base:
        transport = make_transport(kind, max_connections=4)
        bodies = []
        for _ in range(5):
            response = await transport.handle_async_request(_request(base))
            bodies.append(await read(response, how))
            assert response.content == bodies[-1]  # as after aread(): .content is the body
            await response.aclose()
        await transport.aclose()
    assert bodies == [b'{"n":%d}' % n for n in range(1, 6)]
    assert server.connections == 1
    head = server.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/chat/completions http/1.1")
    assert b"host: 127.0.0.1:" in head and b"content-length: 13" in head
    assert server.requests[0].endswith(b'{"model":"m"}')


@transports()
@run
async def test_chunked_body_streams_piece_by_piece(kind: str) -> None:
    answer: list[bytes | float] = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"6\r\ndata:1\r\n", 0.05, b"6\r\ndata:2\r\n", 0.05, b"0\r\n\r\n"]
    server = Server(lambda n: answer)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        chunks = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()
        # The connection went back to the pool and carries the next request.
        again = await transport.handle_async_request(_request(base))
        await again.aread()
        await transport.aclose()
    assert chunks == [b"data:1", b"data:2"]
    assert server.connections == 1


@transports()
@run
async def test_close_delimited_body_is_complete_and_not_reused(kind: str) -> None:
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"],
                    keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        for _ in range(2):
            response = await transport.handle_async_request(_request(base))
            assert await response.aread() == b"all of it"
        await transport.aclose()
    assert server.connections == 2


@transports()
@run
async def test_error_status_and_headers_pass_through(kind: str) -> None:
    body = b'{"error":{"message":"slow down"}}'
    server = Server(lambda n: [b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body])
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert (await response.aread()) == body
        await transport.aclose()


@transports()
@run
async def test_connection_refused_is_connect_error(kind: str) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    transport = make_transport(kind, max_connections=1)
    with pytest.raises(httpx.ConnectError):
        await transport.handle_async_request(_request(f"http://127.0.0.1:{port}"))
    # The slot was given back: the next call does not wait for the pool.
    with pytest.raises(httpx.ConnectError):
        await transport.handle_async_request(_request(f"http://127.0.0.1:{port}"))
    await transport.aclose()


@transports()
@run
async def test_silence_before_headers_is_read_timeout_and_frees_the_slot(kind: str) -> None:
    server = Server(lambda n: [3.0] if n == 1 else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "read": 0.2}
        with pytest.raises(httpx.ReadTimeout):
            await transport.handle_async_request(request)
        response = await transport.handle_async_request(_request(base))
        assert await response.aread() == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 2  # the timed-out connection was not reused


@transports()
@readers
@run
async def test_hang_up_mid_body_is_a_protocol_error(kind: str, how: str) -> None:
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"],
                    keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        with pytest.raises(httpx.RemoteProtocolError):
            await read(response, how)
        await transport.aclose()


@transports()
@run
async def test_malformed_answer_is_a_protocol_error(kind: str) -> None:
    server = Server(lambda n: [b"NOT HTTP AT ALL\r\n\r\n"], keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        with pytest.raises(httpx.RemoteProtocolError):
            await transport.handle_async_request(_request(base))
        await transport.aclose()


@transports(aiohttp="aiohttp frees a connection as soon as the whole body has arrived, read or "
                    "not, so this pool is not full; a wait for a slot that does time out is a "
                    "ConnectTimeout (its connect timeout covers both), which the gateway treats "
                    "alike (try the next key)")
@run
async def test_busy_pool_times_out_with_pool_timeout(kind: str) -> None:
    server = Server(lambda n: _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        held = await transport.handle_async_request(_request(base))  # body not read: slot busy
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.1}
        with pytest.raises(httpx.PoolTimeout):
            await transport.handle_async_request(request)
        await held.aclose()
        response = await transport.handle_async_request(_request(base))
        assert response.status_code == 200
        await response.aclose()
        await transport.aclose()


@transports()
@run
async def test_client_cancelled_mid_wait_closes_the_connection(kind: str) -> None:
    server = Server(lambda n: [1.0] + _json_answer() if n == 1 else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        task = asyncio.ensure_future(transport.handle_async_request(_request(base)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        response = await transport.handle_async_request(_request(base))
        assert await response.aread() == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 2


@transports()
@run
async def test_idle_connection_closed_by_the_server_is_not_reused(kind: str) -> None:
    server = Server(lambda n: _json_answer(), keep_open=False)  # answers, then hangs up
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        for _ in range(3):
            response = await transport.handle_async_request(_request(base))
            assert await response.aread() == b'{"ok":true}'
            await asyncio.sleep(0.05)  # let the server's FIN arrive
        await transport.aclose()
    assert server.connections == 3


def _self_signed(tmp_path: Any) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@transports()
def test_https_upstream_with_certificate_checks(kind: str, tmp_path: Any) -> None:
    import ssl

    cert_file, key_file = _self_signed(tmp_path)

    async def scenario() -> None:
        server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_tls.load_cert_chain(cert_file, key_file)
        server = Server(lambda n: _json_answer())
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=server_tls)
        port = listener.sockets[0].getsockname()[1]
        try:
            trusting = ssl.create_default_context(cafile=cert_file)
            transport = make_transport(kind, max_connections=1, ssl_context=trusting)
            for _ in range(2):
                response = await transport.handle_async_request(
                    _request(f"https://127.0.0.1:{port}"))
                assert await response.aread() == b'{"ok":true}'
            await transport.aclose()
            assert server.connections == 1  # kept alive over TLS too
            # The default context (public CAs) refuses the self-signed certificate.
            public_cas = make_transport(kind, max_connections=1)
            with pytest.raises(httpx.ConnectError):
                await public_cas.handle_async_request(_request(f"https://127.0.0.1:{port}"))
            await public_cas.aclose()
        finally:
            listener.close()

    asyncio.run(scenario())


@transports()
@readers
@run
async def test_client_cancelled_mid_body_frees_the_slot(kind: str, how: str) -> None:
    # The gateway's view is cancelled when its client leaves, possibly inside response.aread()
    # (gateway/forward.py, _complete), which then never calls aclose(): the transport must give
    # the slot back by itself, as httpx's own transport does.
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\npart", 5.0]
                    if n == 1 else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        reading = asyncio.ensure_future(read(response, how))
        await asyncio.sleep(0.1)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.5}
        again = await transport.handle_async_request(request)  # not PoolTimeout
        assert await again.aread() == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 2  # the half-read connection was not reused


@transports()
@readers
@run
async def test_failed_body_read_frees_the_slot_without_aclose(kind: str, how: str) -> None:
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\npart"]
                    if n == 1 else _json_answer(), keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        with pytest.raises(httpx.RemoteProtocolError):
            await read(response, how)
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.5}
        again = await transport.handle_async_request(request)
        assert await again.aread() == b'{"ok":true}'
        await transport.aclose()


@transports()
@run
async def test_interim_1xx_answers_are_skipped(kind: str) -> None:
    # A 100 Continue or 103 Early Hints is not the answer: returning it gave the caller an empty
    # "success" and put the connection back in the pool with the real answer still on its way,
    # where the next request would have read it.
    interim: list[bytes | float] = [b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
                                    0.05, b"HTTP/1.1 100 Continue\r\n\r\n", 0.05]
    server = Server(lambda n: interim + _json_answer(b'{"n":%d}' % n))
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        for n in (1, 2):
            response = await transport.handle_async_request(_request(base))
            assert response.status_code == 200
            assert "link" not in response.headers
            assert await response.aread() == b'{"n":%d}' % n
        await transport.aclose()
    assert server.connections == 1


@transports(aiohttp="aiohttp returns the 101 as the answer (status 101, no error)")
@run
async def test_upgrade_answer_is_a_protocol_error(kind: str) -> None:
    server = Server(lambda n: [(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                b"Connection: Upgrade\r\n\r\nbinary")], keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        with pytest.raises(httpx.RemoteProtocolError):
            await transport.handle_async_request(_request(base))
        await transport.aclose()


@transports(httpx="httpcore closes a connection whose body was not read instead of reusing "
                  "it: a new connection, nothing wrong")
def test_connection_paused_by_an_unread_body_reads_again_when_reused(kind: str,
                                                                     monkeypatch: Any) -> None:
    # A caller that closes a fully received but unread body (forward.py does for a 429 or 401)
    # used to pool the connection with reading still paused: the next answer never arrived.
    monkeypatch.setattr("gateway.upstream_http._HIGH_WATER", 10)
    big = b"x" * 100

    async def scenario() -> None:
        server = Server(lambda n: _json_answer(big) if n == 1 else _json_answer())
        async with server as base:
            transport = make_transport(kind, max_connections=1)
            response = await transport.handle_async_request(_request(base))
            await asyncio.sleep(0.05)
            await response.aclose()  # received in full, read by nobody
            request = _request(base)
            request.extensions["timeout"] = {**TIMEOUTS, "read": 0.5}
            again = await transport.handle_async_request(request)
            assert await again.aread() == b'{"ok":true}'
            await transport.aclose()
        assert server.connections == 1

    asyncio.run(scenario())


@transports(httpx="httpcore keeps the connection and hands the stray answer to the next "
                  "request")
@run
async def test_bytes_after_the_answer_are_not_taken_for_it_nor_for_the_next(kind: str) -> None:
    # Whatever follows a complete answer was asked for by no request (a confused server, or a
    # 408 on an idle connection): it must neither extend this body nor answer the next request.
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nstrayed"
    server = Server(lambda n: [_json_answer()[0] + extra] if n == 1 else _json_answer(b'{"n":2}'))
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.05)
        assert await response.aread() == b'{"ok":true}'
        again = await transport.handle_async_request(_request(base))
        assert await again.aread() == b'{"n":2}'
        await transport.aclose()
    assert server.connections == 2


@transports(aiohttp="aiohttp keeps the idle connection and hands the 408 sent to it to the "
                    "next request as its answer")
@run
async def test_answer_sent_to_an_idle_connection_closes_it(kind: str) -> None:
    server = Server(lambda n: _json_answer() + [0.05] + [
        b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"] if n == 1
        else _json_answer(b'{"n":2}'))
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        assert await response.aread() == b'{"ok":true}'
        await asyncio.sleep(0.15)  # the 408 arrives while the connection is idle
        again = await transport.handle_async_request(_request(base))
        assert again.status_code == 200 and await again.aread() == b'{"n":2}'
        await transport.aclose()
    assert server.connections == 2


@transports(aiohttp="aiohttp does not look at an idle socket before reusing it: the request "
                    "written to the closed connection fails (ReadError, a 502 to the client)")
@run
async def test_idle_connection_the_server_closed_unnoticed_is_not_reused(kind: str) -> None:
    # The server's FIN can reach the socket while the event loop is busy and has not yet called
    # connection_lost (under load, for a whole loop iteration): such a connection looks alive,
    # and a request written to it failed with RemoteProtocolError (a 502 to the client).
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    connections = 0

    def serve() -> None:  # in a thread, so it hangs up while the test's loop is blocked
        nonlocal connections
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            connections += 1
            with sock:
                data = b""
                while not data.endswith(b'{"model":"m"}'):
                    data += sock.recv(65536)
                sock.sendall(_json_answer()[0])  # keep-alive answer, then hang up at once

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    transport = make_transport(kind, max_connections=1)
    try:
        for _ in range(3):
            response = await transport.handle_async_request(_request(base))
            assert await response.aread() == b'{"ok":true}'
            time.sleep(0.1)  # noqa: ASYNC251 - block the loop: the FIN arrives unseen
        await transport.aclose()
    finally:
        listener.close()
    assert connections == 3


@transports(aiohttp="aiohttp ends a close-delimited body on a reset as if the server had closed "
                    "it: the truncated stream passes as complete")
@run
async def test_reset_ends_no_close_delimited_body(kind: str) -> None:
    # A body without length ends with the connection, but only a clean close ends it: a reset
    # (the upstream crashed) mid-stream used to pass the truncated body off as complete.
    import socket
    import struct

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # with SO_LINGER 0: a RST, not a FIN

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    transport = make_transport(kind, max_connections=1)
    response = await transport.handle_async_request(_request(base))
    with pytest.raises(httpx.ReadError):
        await response.aread()
    await transport.aclose()
    listener.close()


@run
async def test_read_in_flight_when_closed_cannot_take_the_next_answer() -> None:
    # forward.py reads in a task of its own (shielded) and may close the response while that
    # read has been woken by the body's last bytes but has not run yet. Pooled then, the
    # connection's next exchange had two readers, and the stale one took the new body.
    # Native only: the race is staged by feeding the native connection's parser directly.
    server = Server(lambda n: [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n"] if n == 1
        else [b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n", 0.05, b'{"ok":true}'])
    async with server as base:
        transport = make_transport("native", max_connections=1)
        response = await transport.handle_async_request(_request(base))
        chunks = response.aiter_raw()
        assert await chunks.__anext__() == b"hi"
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)  # the read waits for more
        conn = response.stream.conn  # type: ignore[attr-defined]
        conn.data_received(b"0\r\n\r\n")  # the body's end wakes it; it has not run yet
        await response.aclose()
        again = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.1)  # the body arrives before its reader starts
        assert await again.aread() == b'{"ok":true}'
        with pytest.raises((StopAsyncIteration, httpx.HTTPError)):
            await reading
        await transport.aclose()


@transports()
@run
async def test_bodiless_answers_without_length_keep_the_connection(kind: str) -> None:
    # A 204 or 304 has no body whatever its headers say: it does not end with the connection.
    answers = {1: b"HTTP/1.1 204 No Content\r\n\r\n", 2: b"HTTP/1.1 304 Not Modified\r\n\r\n"}
    server = Server(lambda n: [answers[n]] if n in answers else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        statuses = []
        for _ in range(3):
            response = await transport.handle_async_request(_request(base))
            statuses.append(response.status_code)
            await response.aread()
        await transport.aclose()
    assert statuses == [204, 304, 200]
    assert server.connections == 1


@transports(aiohttp="sent with chunked framing (the gateway only sends bodies in memory)",
            httpx="sent with chunked framing (the gateway only sends bodies in memory)")
@run
async def test_streamed_request_body_is_sent_with_a_length(kind: str) -> None:
    async def parts() -> Any:
        yield b'{"model":'
        yield b'"m"}'

    server = Server(lambda n: _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        request = httpx.Request("POST", f"{base}/v1/chat/completions", content=parts(),
                                extensions={"timeout": TIMEOUTS})
        response = await transport.handle_async_request(request)
        assert await response.aread() == b'{"ok":true}'
        await transport.aclose()
    head, body = server.requests[0].split(b"\r\n\r\n", 1)
    assert b"content-length: 13" in head.lower() and b"transfer-encoding" not in head.lower()
    assert body == b'{"model":"m"}'


@transports()
@run
async def test_closing_a_response_ends_a_read_waiting_in_another_task(kind: str) -> None:
    # forward.py's stream drain reads in a task of its own and, when it gives up (its time is
    # out), closes the response with that read still waiting: the read must end (an error or the
    # end of the body), not wait forever holding the task, and the slot must be free again.
    server = Server(lambda n: [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n", 5.0] if n == 1
        else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        chunks = response.aiter_raw()
        assert await chunks.__anext__() == b"hi"
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)  # the read waits for more
        await response.aclose()
        with pytest.raises((StopAsyncIteration, httpx.HTTPError)):
            await asyncio.wait_for(reading, 2.0)
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.5}
        again = await transport.handle_async_request(request)
        assert await again.aread() == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 2  # the half-read connection was not reused


@transports()
@pytest.mark.parametrize("how", ["close", "reset"])
@run
async def test_a_hang_up_after_the_request_is_no_connect_error(kind: str, how: str) -> None:
    # The gateway tries the next provider key on ConnectError, ConnectTimeout and PoolTimeout
    # (gateway/forward.py), taking them for "nothing was sent". A server that read the request
    # and then hung up may be running it: its error must be another one, or the call would be
    # sent twice (test_e2e_breakers: a reset is not retried elsewhere).
    import socket
    import struct

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    transport = make_transport(kind, max_connections=1)
    try:
        with pytest.raises(httpx.TransportError) as info:
            await transport.handle_async_request(_request(base))
        assert not isinstance(info.value, httpx.ConnectError | httpx.ConnectTimeout
                              | httpx.PoolTimeout), repr(info.value)
    finally:
        await transport.aclose()
        listener.close()


def test_the_setting_names_one_of_the_transports() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    def load(value: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c",
             "import config.settings as s; print(s.GATEWAY_UPSTREAM_TRANSPORT)"],
            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60,
            env={**os.environ, "GATEWAY_UPSTREAM_TRANSPORT": value})

    for kind in TRANSPORTS:
        loaded = load(kind)
        assert loaded.returncode == 0, loaded.stderr
        assert loaded.stdout.strip() == kind
    refused = load("httpcore")
    assert refused.returncode != 0
    assert "GATEWAY_UPSTREAM_TRANSPORT must be native, aiohttp or httpx, got 'httpcore'" \
        in refused.stderr
    with pytest.raises(ValueError, match="unknown upstream transport 'h2'"):
        make_transport("h2", max_connections=1)


@transports(httpx="httpcore hands each chunk of the chunked framing up on its own")
@run
async def test_stream_pieces_that_arrive_together_come_up_as_one(kind: str) -> None:
    # The relay's cost is per piece it is handed (a read, a split, a write to the client): a
    # burst of events read at once is handed over whole, in order, nothing lost.
    answer: list[bytes | float] = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\ndata:1\r\n6\r\ndata:2\r\n6\r\ndata:3\r\n", 0.1, b"6\r\ndata:4\r\n0\r\n\r\n"]
    server = Server(lambda n: answer)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.05)  # the burst is in before the first read
        chunks = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()
        await transport.aclose()
    assert chunks == [b"data:1data:2data:3", b"data:4"]


@transports(aiohttp="aiohttp's reader raises the hang-up before the pieces that came with it: a "
                    "cut stream's last events (all of them, when they came in one read) are "
                    "neither relayed nor charged")
@run
async def test_pieces_that_arrived_before_a_hang_up_are_read_before_its_error(kind: str) -> None:
    # An upstream that crashes mid-stream: the events it sent before are what the client is
    # relayed and the tenant is charged for (forward.py counts a cut stream's text), so they
    # must be handed up even when the hang-up arrives with them, before anything was read.
    server = Server(lambda n: [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\ndata:1\r\n6\r\ndata:2\r\n"], keep_open=False)
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.1)  # the pieces and the hang-up are in before the first read
        received = b""
        with pytest.raises(httpx.TransportError):
            async for chunk in response.aiter_raw():
                received += chunk
        await response.aclose()
        await transport.aclose()
    assert received == b"data:1data:2"


@transports()
@run
async def test_read_answer_decodes_an_encoded_body_as_aread_does(kind: str) -> None:
    # An upstream that compresses its answer: read_answer leaves it to httpx's decoder.
    import gzip

    packed = gzip.compress(b'{"ok":true}')
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: "
                               + str(len(packed)).encode() + b"\r\n\r\n" + packed])
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        assert await read_answer(response) == b'{"ok":true}'
        await response.aclose()
        again = await transport.handle_async_request(_request(base))
        assert await read_answer(again) == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 1  # the slot and the connection came back after each read


@transports()
@run
async def test_read_answer_joins_a_chunked_body_and_frees_the_slot(kind: str) -> None:
    server = Server(lambda n: [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n", 0.05,
        b"4\r\ntrue\r\n", 0.05, b"1\r\n}\r\n0\r\n\r\n"])
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        for _ in range(2):  # one slot: the second call waits for none
            request = _request(base)
            request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.5}
            response = await transport.handle_async_request(request)
            assert await read_answer(response) == b'{"a":true}'
        await transport.aclose()
    assert server.connections == 1


@transports()
@run
async def test_read_answer_silence_mid_body_is_read_timeout_and_frees_the_slot(kind: str) -> None:
    server = Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\npart", 3.0]
                    if n == 1 else _json_answer())
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "read": 0.2}
        response = await transport.handle_async_request(request)
        with pytest.raises(httpx.ReadTimeout):
            await read_answer(response)
        request = _request(base)
        request.extensions["timeout"] = {**TIMEOUTS, "pool": 0.5}
        again = await transport.handle_async_request(request)  # not PoolTimeout
        assert await read_answer(again) == b'{"ok":true}'
        await transport.aclose()
    assert server.connections == 2  # the half-read connection was not reused


@transports()
@run
async def test_read_answer_of_a_closed_response_fails_as_aread_does(kind: str) -> None:
    # Closed before its body was read (its connection back in the pool, or carrying another
    # call): read_answer must not read that connection, as aread() refuses a closed stream.
    server = Server(lambda n: _json_answer(b'{"n":%d}' % n))
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        response = await transport.handle_async_request(_request(base))
        await response.aclose()
        with pytest.raises(httpx.StreamClosed):
            await read_answer(response)
        again = await transport.handle_async_request(_request(base))
        assert await read_answer(again) == b'{"n":2}'
        assert again.is_closed and again.is_stream_consumed  # as aread() leaves them
        await transport.aclose()


@transports()
@run
async def test_a_request_encoded_ahead_is_sent_as_it_would_be_and_only_once(kind: str) -> None:
    # forward.Prepared encodes its request while the reserve runs (encode_ahead): the upstream
    # must get the very bytes the send would have made, and a second send of the same request
    # (whose headers changed meanwhile) must encode it again, not replay the first bytes. The
    # other transports encode nothing ahead: the same bytes reach the server either way.
    server = Server(lambda n: _json_answer(b'{"n":%d}' % n))
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        plain = _request(base)
        response = await transport.handle_async_request(plain)
        assert await read_answer(response) == b'{"n":1}'
        ahead = _request(base)
        encode_ahead(transport, ahead)
        assert (_WIRE in ahead.__dict__) is (kind == "native")
        response = await transport.handle_async_request(ahead)
        assert _WIRE not in ahead.__dict__  # the bytes made ahead were taken by the send
        assert await read_answer(response) == b'{"n":2}'
        ahead.headers["x-again"] = "1"
        response = await transport.handle_async_request(ahead)
        assert await read_answer(response) == b'{"n":3}'
        await transport.aclose()
    assert server.requests[1] == server.requests[0]
    assert b"x-again: 1" in server.requests[2].lower()


@run
async def test_encoding_ahead_leaves_what_only_the_send_may_refuse_or_read() -> None:
    # A scheme the transport refuses is refused by the send, as without encode_ahead; a streamed
    # body is not read ahead (the send reads it, and sends it with a length).
    transport = make_transport("native", max_connections=1)
    refused = httpx.Request("POST", "ftp://127.0.0.1/x", content=b"{}",
                            extensions={"timeout": TIMEOUTS})
    encode_ahead(transport, refused)
    with pytest.raises(httpx.UnsupportedProtocol):
        await transport.handle_async_request(refused)

    async def parts() -> Any:
        yield b'{"model":"m"}'

    server = Server(lambda n: _json_answer())
    async with server as base:
        streamed = httpx.Request("POST", f"{base}/v1/chat/completions", content=parts(),
                                 extensions={"timeout": TIMEOUTS})
        encode_ahead(transport, streamed)
        response = await transport.handle_async_request(streamed)
        assert await read_answer(response) == b'{"ok":true}'
        await transport.aclose()
    head, body = server.requests[0].split(b"\r\n\r\n", 1)
    assert b"content-length: 13" in head.lower() and body == b'{"model":"m"}'


@transports()
@run
async def test_answer_arrived_says_whether_reading_the_answer_could_wait(kind: str) -> None:
    # forward.py reads an answer that is all here without arming the call's deadline: only the
    # native transport's unencoded answer whose connection has all of it qualifies.
    server = Server(lambda n: _json_answer() if n == 1 else
                    [b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\"", 0.2, b":true}"])
    async with server as base:
        transport = make_transport(kind, max_connections=1)
        whole = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.05)  # the rest of what came with the headers, read
        assert answer_arrived(whole) is (kind == "native")
        assert await read_answer(whole) == b'{"ok":true}'
        assert not answer_arrived(whole)  # read: nothing left to read
        part = await transport.handle_async_request(_request(base))
        await asyncio.sleep(0.05)
        assert not answer_arrived(part)  # the rest is 0.2 s away
        assert await read_answer(part) == b'{"ok":true}'
        await transport.aclose()
