"""The floor of a plain call: how fast this design's one-client call can be in Python, and what
each layer the gateway runs on adds to it (issue 16 item 3; docs/benchmarks.md, "The floor of
a plain call, layer by layer").

    python -m config.bench_floor [--rounds 3] [--duration 3] [--cpu-awake]

The floor server does a plain chat call's work with the least Python: the key's HMAC digest and
lookup, the body's JSON parse, the prompt counted with tiktoken, the real reserve script, the
upstream call, the answer's JSON parse for its usage, the real settle script (its usage event
included), and the answer sent once the settle has answered, as the gateway does. Its scripts'
KEYS and ARGV are the gateway's own: captured (MONITOR) from a call through the gateway, then
replayed with each call's request id, usage and queue deadline (again when a window moves on).
It has none of the gateway's other work: no metrics, logs, spans, breakers, provider pool,
timeouts, client watch, error answers or checks beyond the key. So it is a bound, not a
gateway: what a call of this design costs in Python with nothing else.

Each arm adds one layer to the one before, all on the same embedded system, by turns:
  floor, own protocol   an asyncio protocol per connection (httptools); the scripts, here and
                        in every arm, through the gateway's own script connections
                        (quotas/script_pool.py)
  + uvicorn             the same handler as an ASGI app under uvicorn (uvloop, httptools)
  + httpx transport     the upstream call as the gateway makes it: an httpx.Request through
                        the native transport (handle_async_request, read_answer)
  + Django req/resp     Django's request (ASGIHandler.create_request), HttpResponse and
                        send_response, as the gateway's router uses them
  gateway               the gateway itself (every check on, metrics on)
Printed per arm: added p50 / p99 at one client (against the mock called directly in the same
round), req/s and worker CPU per call at 16 clients.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import http
import http.client
import io
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from config import bench
from config.bench import MOCK_SECRET
from quotas.script_pool import ScriptPool

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_PORT, MOCK_PORT = 18410, 18499
ARMS = [("floor, own protocol", "protocol", 18411), ("+ uvicorn", "uvicorn", 18412),
        ("+ httpx transport", "httpx", 18413), ("+ Django req/resp", "django", 18414)]
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)")
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}
_SETTLE_ARGV = 7  # lua/settle.lua with its wake channel: request id ... fallback, channel
# What the mock answers to the bench's call (input, output tokens), every time: the replayed
# money (the settle's actual_money, the reserve's amounts) are the captured call's, so they are
# right only for this usage, which every call checks.
_MOCK_USAGE = (6, 16)


def _unescape(arg: bytes) -> bytes:
    """One argument of a MONITOR line (Redis quotes it with C escapes, sdscatrepr)."""
    def one(m: re.Match[bytes]) -> bytes:
        e = m.group(1)
        return bytes([int(e[1:], 16)]) if e[:1] == b"x" else _ESCAPES.get(e, e)
    return _ESCAPE.sub(one, arg)


def _redis_path() -> str:
    from config import embedded

    return urlparse(embedded.embedded_redis_url(Path(os.environ["TOLLGATE_DATA_DIR"]))).path


class Template:
    """The gateway's reserve and settle calls for the bench's plain chat call, to replay."""

    def __init__(self, reserve: list[bytes], settle: list[bytes], rid: bytes) -> None:
        self.reserve, self.settle = reserve, settle
        self.reserve_rid = [i for i, a in enumerate(reserve) if rid in a]
        self.settle_rid = [i for i, a in enumerate(settle) if rid in a]
        self.rid = rid
        nkeys = int(reserve[2])
        self.index_key = reserve[4]  # KEYS[2], then the N counters
        argv = 3 + nkeys  # ARGV[1] is reserve[argv]
        n, r = int(reserve[argv + 4]), int(reserve[argv + 5])
        self.counter_keys = reserve[5:5 + n]
        base = argv + 14 + 5 * n + 2 * r  # the queue values follow the counters and buckets
        self.deadline = base + 2 if len(reserve) > base else None
        s_argv = 3 + int(settle[2])
        self.actual, self.event, self.fallback = s_argv + 1, s_argv + 3, s_argv + 5
        self.event_fields = json.loads(settle[self.event])
        self.fallback_fields = json.loads(settle[self.fallback])
        self.usage = (self.event_fields["in"], self.event_fields["out"])

    def reserve_call(self, rid: bytes) -> list[bytes]:
        call = list(self.reserve)
        for i in self.reserve_rid:
            call[i] = call[i].replace(self.rid, rid)
        if self.deadline is not None:
            call[self.deadline] = b"%d" % (time.time() * 1000 + 30_000)
        return call

    def settle_call(self, rid: bytes, usage: dict[str, int], granted: int,
                    created: int) -> list[bytes]:
        if (usage["prompt_tokens"], usage["completion_tokens"]) != self.usage:
            raise ValueError(f"usage {usage} is not the captured call's {self.usage}: its "
                             "replayed money would be wrong")
        call = list(self.settle)
        for i in self.settle_rid:
            call[i] = call[i].replace(self.rid, rid)
        call[self.actual] = b"%d" % (usage["prompt_tokens"] + usage["completion_tokens"])
        event = dict(self.event_fields, **{"in": usage["prompt_tokens"],
                                           "out": usage["completion_tokens"]})
        call[self.event] = json.dumps(event, separators=(",", ":")).encode()
        fallback = dict(self.fallback_fields, amount=str(granted), created=str(created))
        call[self.fallback] = json.dumps(fallback, separators=(",", ":")).encode()
        return call


def capture(key: str, body: bytes) -> Template:
    """One call through the gateway with MONITOR on: its reserve and settle, found by the call's
    request id (x-request-id)."""
    mon = socket.socket(socket.AF_UNIX)
    mon.connect(_redis_path())
    mon.sendall(b"MONITOR\r\n")
    feed = b""
    while b"\r\n" not in feed:
        feed += mon.recv(65536)
    conn = http.client.HTTPConnection("127.0.0.1", GATEWAY_PORT, timeout=10)
    conn.request("POST", "/v1/chat/completions", body, {
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise RuntimeError(f"the gateway answered {answer.status} to the capture's call")
    rid = answer.headers["x-request-id"].encode()
    # The call's scripts: its reserve (again after a window mismatch: the last one counts),
    # then its settle, the first of another script with the settle's 7 ARGV (MONITOR feeds
    # them in the order they ran; a plain call runs no other script between the two).
    calls: list[list[bytes]] = []
    mon.settimeout(1.0)
    give_up = time.monotonic() + 10
    try:
        while not (calls and calls[-1][1] != calls[0][1]):
            if time.monotonic() > give_up:
                raise RuntimeError("the capture did not see the call's reserve and settle")
            try:
                feed += mon.recv(1 << 20)
            except TimeoutError:
                continue
            *lines, feed = feed.split(b"\r\n")
            for line in lines:
                args = [_unescape(a) for a in _ARG.findall(line)]
                if (len(args) > 3 and args[0].upper() == b"EVALSHA" and rid in args[3]
                        and (not calls or args[1] == calls[0][1]
                             or len(args) == 3 + int(args[2]) + _SETTLE_ARGV)):
                    calls.append(args)
                    if args[1] != calls[0][1]:
                        break
    finally:
        mon.close()
        conn.close()
    reserve = [c for c in calls if c[1] == calls[0][1]][-1]
    template = Template(reserve, calls[-1], rid)
    if template.usage != _MOCK_USAGE:
        raise RuntimeError(f"the captured call used {template.usage}, not the mock's "
                           f"{_MOCK_USAGE}: the replayed money would be wrong")
    return template


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to the mock, its answers parsed by httptools."""

    closed = False

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.done: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, part: bytes) -> None:
        self.body.append(part)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        body, self.body = b"".join(self.body), []
        if done is not None:
            done.set_result((self.parser.get_status_code(), body))

    def post(self, payload: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s"
                             % (MOCK_SECRET.encode(), len(payload), payload))
        return self.done


class Floor:
    """The floor's per-call work (see the module's docstring)."""

    def __init__(self, key: str, body: bytes,
                 upstream: Callable[[bytes], Awaitable[tuple[int, bytes]]] | None = None) -> None:
        from gateway.tokens import count_text

        self.count = count_text
        self.server_secret = secrets.token_bytes(32)
        self.keys = {self._digest(key.encode()): "the bench key"}
        self.template = capture(key, body)
        self.body = body
        self.key = key
        # The scripts go through the gateway's own script connections (quotas/script_pool.py).
        self.redis = ScriptPool(size=32, timeout=5.0, path=_redis_path())
        self.pool: list[_Upstream] = []
        self.capturing: asyncio.Future[Template] | None = None
        self.upstream = upstream or self._raw_upstream

    async def _capture_again(self) -> Template:
        """A new capture, shared by the calls that found the window moved on meanwhile."""
        if self.capturing is None or self.capturing.done():
            self.capturing = asyncio.ensure_future(asyncio.to_thread(capture, self.key, self.body))
        self.template = await asyncio.shield(self.capturing)
        return self.template

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self.server_secret, key, hashlib.sha256).digest()

    async def _raw_upstream(self, payload: bytes) -> tuple[int, bytes]:
        while self.pool and self.pool[-1].closed:
            self.pool.pop()
        if self.pool:
            conn = self.pool.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(
                _Upstream, "127.0.0.1", MOCK_PORT)
        answer = await conn.post(payload)
        self.pool.append(conn)
        return answer

    async def call(self, authorization: bytes,
                   body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """(status, headers, body) of one plain chat call."""
        if self.keys.get(self._digest(authorization.removeprefix(b"Bearer "))) is None:
            return 401, [], b""
        request = json.loads(body)
        prompt = sum(self.count(m["content"], "o200k_base") for m in request["messages"])
        redis = self.redis
        rid = b"req_" + secrets.token_hex(12).encode()  # the gateway's form (new_request_id)
        template = self.template
        reply = await redis.call(template.reserve_call(rid))
        if reply[0] == -1:  # a window moved on since the capture: capture again, once
            template = await self._capture_again()
            reply = await redis.call(template.reserve_call(rid))
        if reply[0] != 1:
            raise RuntimeError(f"the floor's reserve was refused: {reply!r}")
        payload = json.dumps({"model": request["model"], "messages": request["messages"],
                              "max_tokens": request["max_tokens"]}).encode()
        status, answer = await self.upstream(payload)
        usage = json.loads(answer)["usage"]
        # The settle names the counters its reserve held (a capture meanwhile does not move it).
        settled = asyncio.get_running_loop().create_task(
            redis.call(template.settle_call(rid, usage, reply[1], reply[2])))
        headers = [(b"content-type", b"application/json"), (b"x-request-id", rid),
                   (b"x-ratelimit-remaining-tokens", b"%d" % reply[3]),
                   (b"x-prompt-tokens-counted", b"%d" % prompt)]
        outcome = await settled
        if not isinstance(outcome, list) or outcome[0] != "settled":
            raise RuntimeError(f"the floor's settle did not settle: {outcome!r}")
        return status, headers, answer


def _body() -> bytes:
    """The bench's plain chat call (config/bench.py)."""
    return json.dumps(bench.request_body(bench.Api.CHAT, False, bench.CHAT_MODEL, bench.PROMPT,
                                         None)).encode()


def _floor() -> Floor:
    return Floor(os.environ["FLOOR_KEY"], _body())


class _Connection(asyncio.Protocol):
    """The own-protocol arm: httptools per keep-alive connection. Each request is answered in a
    task of its own: enough for the bench's clients, which wait for each answer (a pipelining
    client could get its answers out of order)."""

    def __init__(self, floor: Floor) -> None:
        import httptools

        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, part: bytes) -> None:
        self.body.append(part)

    def on_message_complete(self) -> None:
        headers, self.headers = self.headers, {}
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self.answer(headers, body))

    async def answer(self, headers: dict[bytes, bytes], body: bytes) -> None:
        if not body:  # the readiness probe
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            status, extra, answer = await self.floor.call(headers.get(b"authorization", b""),
                                                          body)
        except Exception:
            self.transport.close()  # the load's client fails at once, not at its timeout
            raise
        head = b"".join(b"%s: %s\r\n" % h for h in extra)
        reason = http.HTTPStatus(status).phrase.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n\r\n%s"
                             % (status, reason, head, len(answer), answer))


async def _read(receive: Callable[[], Any]) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def asgi_app(layer: str) -> Callable[..., Any]:
    """The floor as an ASGI app with `layer` ("uvicorn", "httpx" or "django") and those before."""
    floor: Floor | None = None
    handler: Any = None
    upstream: Callable[[bytes], Awaitable[tuple[int, bytes]]] | None = None
    if layer in ("httpx", "django"):
        import httpx

        from gateway.upstream_http import NativeTransport, read_answer

        transport = NativeTransport(max_connections=100)
        url = f"http://127.0.0.1:{MOCK_PORT}/v1/chat/completions"
        headers = {"authorization": f"Bearer {MOCK_SECRET}", "content-type": "application/json"}
        timeouts = {"connect": 5.0, "read": 60.0, "write": 60.0, "pool": 5.0}

        async def through_transport(payload: bytes) -> tuple[int, bytes]:
            response = await transport.handle_async_request(httpx.Request(
                "POST", url, headers=headers, content=payload, extensions={"timeout": timeouts}))
            answer = await read_answer(response)
            await response.aclose()
            return response.status_code, answer

        upstream = through_transport
    if layer == "django":
        import django
        from django.core.handlers.asgi import ASGIHandler

        django.setup()
        handler = ASGIHandler()

    async def app(scope: dict[str, Any], receive: Callable[[], Any],
                  send: Callable[..., Any]) -> None:
        nonlocal floor
        if scope["type"] != "http":
            return
        body = await _read(receive)
        if not body:  # the readiness probe
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if floor is None:
            floor = _floor()
            if upstream is not None:
                floor.upstream = upstream
        if handler is None:
            authorization = dict(scope["headers"]).get(b"authorization", b"")
            status, extra, answer = await floor.call(authorization, body)
            await send({"type": "http.response.start", "status": status,
                        "headers": [*extra, (b"content-length", b"%d" % len(answer))]})
            await send({"type": "http.response.body", "body": answer})
            return
        from django.http import HttpResponse

        request, _ = handler.create_request(scope, io.BytesIO(body))
        status, extra, answer = await floor.call(
            request.headers.get("authorization", "").encode(), request.body)
        response = HttpResponse(answer, status=status, content_type="application/json")
        for name, value in extra[1:]:
            response[name.decode()] = value.decode()
        response["Content-Length"] = str(len(answer))
        await handler.send_response(response, send)

    return app


def application_from_env() -> Callable[..., Any]:
    return asgi_app(os.environ["FLOOR_LAYER"])


async def _serve(port: int) -> None:
    floor = _floor()
    server = await asyncio.get_running_loop().create_server(
        lambda: _Connection(floor), "127.0.0.1", port)
    await server.serve_forever()


def _start(layer: str, port: int, key: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOOR_KEY": key, "FLOOR_LAYER": layer}
    if layer == "protocol":
        command = [sys.executable, "-m", "config.bench_floor", "--serve", str(port)]
    else:
        command = [sys.executable, "-m", "uvicorn", "config.bench_floor:application_from_env",
                   "--factory", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
                   "--log-level", "warning", "--no-access-log", "--no-proxy-headers"]
    return subprocess.Popen(command, cwd=ROOT, env=env)


def _wait(port: int, process: subprocess.Popen[bytes]) -> None:
    for _ in range(200):
        if process.poll() is not None:
            raise RuntimeError(f"the floor server on {port} exited ({process.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/")
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the floor server on {port} did not answer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench_floor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--cpu-awake", action="store_true",
                        help="hold the CPUs out of their idle states (as make bench's option)")
    parser.add_argument("--halt-poll-us", type=int, metavar="US", help=bench.HALT_POLL_HELP)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the own-protocol arm
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(_serve(args.serve))
        return 0
    with bench.cpus_kept_awake(args.cpu_awake) as idle, \
            bench.guest_halt_polling(args.halt_poll_us) as halting, \
            bench.running_system("tgfloor-", GATEWAY_PORT, MOCK_PORT, 1) as (gateway, key):
        print(f"CPU idle states: {idle}; {halting}")
        servers = [(name, _start(layer, port, key), port) for name, layer, port in ARMS]
        try:
            for _, process, port in servers:
                _wait(port, process)
            arms = [(name, process.pid, port) for name, process, port in servers]
            arms.append(("gateway", gateway.pid, GATEWAY_PORT))
            for _, _, port in arms:  # warm each: its connections, caches and first capture
                bench.load(port, key, False, 4, 0.5)
            print(f"{'arm':<22} {'round':>5} {'added p50':>10} {'added p99':>10} "
                  f"{'c=16 req/s':>11} {'CPU ms/call':>12}   (ms; 1 client, then 16)")
            for round_ in range(1, args.rounds + 1):
                direct = bench.load(MOCK_PORT, MOCK_SECRET, False, 1, args.duration)
                for name, pid, port in arms:
                    one = bench.load(port, key, False, 1, args.duration)
                    before = bench.cpu_seconds(pid)
                    many = bench.load(port, key, False, 16, args.duration)
                    cpu_ms = (bench.cpu_seconds(pid) - before) * 1000 / many.requests
                    print(f"{name:<22} {round_:>5} {one.pct(50) - direct.pct(50):>10.3f} "
                          f"{one.pct(99) - direct.pct(99):>10.3f} {many.rps:>11.0f} "
                          f"{cpu_ms:>12.3f}", flush=True)
            holds, pending = _left_open(key)
            print(f"after the runs: {holds} holds open, {pending} pending in the call's counters")
            if holds or pending:
                raise SystemExit("a call was left unsettled: the figures above are not a floor")
        finally:
            for _, process, _ in servers:
                process.terminate()
            for _, process, _ in servers:
                process.wait(timeout=15)
    return 0


def _left_open(key: str) -> tuple[int, int]:
    """Holds still open, and what is still pending (tokens, micro-dollars) in the counters of the
    bench's call in the current windows (named by a last capture, whose own call settles too)."""
    import redis

    template = capture(key, _body())
    client = redis.Redis(unix_socket_path=_redis_path())
    pending = sum(int(client.hget(name, "pending") or 0) for name in template.counter_keys)
    return int(client.zcard(template.index_key)), pending


if __name__ == "__main__":
    sys.exit(main())
