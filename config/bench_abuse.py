"""Benchmark: what hostile traffic does to other tenants' small calls on the same gateway worker.

    python -m config.bench_abuse [--duration 5] [--clients 8] [--abusers 2] [--prompt-kb 400]

Starts what `config/bench.py` starts (embedded Redis and PostgreSQL in a temporary directory,
the mock upstream, one gateway worker: uvicorn, uvloop, every check on) with its helpers, then
measures one tenant's small chat completions (`--clients` keep-alive connections, back to back)
in three scenarios, each for `--duration` seconds:

- alone;
- with a concurrent stream of large prompts (`--abusers` connections from another tenant, each
  sending a `--prompt-kb` KB prompt, back to back): each one is parsed and token-counted;
- with a concurrent flood of random well-formed `tgk_` keys (`--abusers` connections, a new
  random key every request): each one is a 401.

Printed per scenario: the small calls' requests per second, p50 / p90 / p99 latency, and how
many abusive requests were answered meanwhile. Then, in this process, the cost of parsing and
counting a chat body inline by size against handing it to a thread (the figures behind
GATEWAY_ESTIMATE_THREAD_BYTES). Figures only; nothing is asserted (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from config.bench import ROOT, Result, _request_bytes, _setup_tenant, _wait_http

_BASE62 = string.ascii_letters + string.digits


def _random_key() -> str:
    """A well-formed API key that exists nowhere (tenants/api_key_format.py's shape)."""
    return ("tgk_" + "".join(secrets.choice(_BASE62) for _ in range(12)) + "_"
            + "".join(secrets.choice(_BASE62) for _ in range(40)))


def _large_prompt_request(key: str, kilobytes: int) -> bytes:
    words = ("lorem ipsum dolor sit amet " * (kilobytes * 1024 // 27 + 1))[:kilobytes * 1024]
    payload = json.dumps({"model": "gpt-4o-mini", "max_tokens": 16,
                          "messages": [{"role": "user", "content": words}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload)


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        await reader.readuntil(b"\r\n0\r\n\r\n")
    else:
        start = lower.index(b"content-length: ") + 16
        await reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
    return head


async def _small_client(port: int, request: bytes, deadline: float,
                        latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            writer.write(request)
            head = await _read_response(reader)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer to a small call: {head[:200]!r}")
            latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


async def _abuser(port: int, make_request: Callable[[], bytes], stop: asyncio.Event,
                  answered: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            writer.write(make_request())
            await _read_response(reader)
            answered.append(1)
    finally:
        writer.close()


async def _scenario(port: int, small: bytes, clients: int, seconds: float, abusers: int,
                    make_abusive: Callable[[], bytes] | None) -> tuple[Result, int]:
    stop = asyncio.Event()
    answered: list[int] = []
    background = [asyncio.create_task(_abuser(port, make_abusive, stop, answered))
                  for _ in range(abusers if make_abusive is not None else 0)]
    if background:
        await asyncio.sleep(0.5)  # the abuse is under way before the measurement starts
    latencies: list[float] = []
    started = time.monotonic()
    await asyncio.gather(*(_small_client(port, small, started + seconds, latencies)
                           for _ in range(clients)))
    result = Result(len(latencies), time.monotonic() - started, latencies)
    stop.set()
    await asyncio.gather(*background)
    return result, len(answered)


def scenario(port: int, small: bytes, clients: int, seconds: float, abusers: int,
             make_abusive: Callable[[], bytes] | None) -> tuple[Result, int]:
    import uvloop

    return uvloop.run(_scenario(port, small, clients, seconds, abusers, make_abusive))


def estimation_costs(sizes_kb: list[int], repeats: int = 20) -> None:
    """Parsing and counting a chat body of each size inline, against the same work handed to
    an estimation thread and awaited (what a large /v1 body costs its own call either way)."""
    from gateway.bodies import Endpoint, parse_body
    from gateway.tokens import estimate_chat_prompt, off_loop

    def work(raw: bytes) -> int:
        parsed = parse_body(Endpoint.CHAT, raw)
        return estimate_chat_prompt(parsed.body["messages"], model="gpt-4o-mini",
                                    tokenizer="o200k_base")

    async def threaded(raw: bytes) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            await off_loop(work, raw)
        return (time.perf_counter() - started) / repeats

    print()
    print(f"{'body KB':>8} {'inline ms':>10} {'thread ms':>10} {'hand-off ms':>12}")
    for kb in sizes_kb:
        words = ("lorem ipsum dolor sit amet " * (kb * 1024 // 27 + 1))[:kb * 1024]
        raw = json.dumps({"model": "gpt-4o-mini",
                          "messages": [{"role": "user", "content": words}]}).encode()
        work(raw)  # warm: the encoding is loaded once
        started = time.perf_counter()
        for _ in range(repeats):
            work(raw)
        inline = (time.perf_counter() - started) / repeats
        thread = asyncio.run(threaded(raw))
        print(f"{kb:>8} {inline * 1000:>10.3f} {thread * 1000:>10.3f} "
              f"{(thread - inline) * 1000:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench_abuse",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    parser.add_argument("--clients", type=int, default=8, help="small-call connections")
    parser.add_argument("--abusers", type=int, default=2,
                        help="connections sending large prompts / random keys")
    parser.add_argument("--prompt-kb", type=int, default=400, help="size of a large prompt")
    parser.add_argument("--sizes-kb", type=int, nargs="*", default=[1, 4, 16, 32, 64, 256],
                        help="body sizes for the inline / thread cost table (none: skip it)")
    parser.add_argument("--gateway-port", type=int, default=18100)
    parser.add_argument("--mock-port", type=int, default=18199)
    args = parser.parse_args(argv)

    data_dir = Path(tempfile.mkdtemp(prefix="tgba-", dir="/tmp"))
    os.environ.update({"TOLLGATE_DATA_DIR": str(data_dir), "TOLLGATE_ENV": "development",
                       "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING"})
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    from config import embedded

    embedded.start_all(data_dir, persistent=False)
    children: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env,
                       check=True)
        import django

        django.setup()
        small_key = _setup_tenant(args.mock_port)
        from tenants.services import create_project, create_tenant, issue_key

        # The abusing tenant: limits far from binding, so every large prompt is counted.
        abuser = create_tenant("abuser", plan_name="enterprise", actor="bench",
                               requests_per_second=1_000_000, tokens_per_minute=10**12,
                               monthly_token_budget=10**13)
        big_key = issue_key(create_project(abuser, "big", actor="bench"), actor="bench",
                            requests_per_minute=10**8, max_concurrency=10_000).plaintext

        mock = subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port",
                                 str(args.mock_port)], cwd=ROOT, env=env)
        children.append(mock)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "config.asgi:application", "--port",
             str(args.gateway_port), "--workers", "1", "--loop", "uvloop", "--http",
             "httptools", "--log-level", "warning", "--no-access-log"], cwd=ROOT, env=env)
        children.append(gateway)
        _wait_http(f"http://127.0.0.1:{args.mock_port}/v1/models", mock)
        _wait_http(f"http://127.0.0.1:{args.gateway_port}/healthz", gateway)

        small = _request_bytes(small_key, False)
        large = _large_prompt_request(big_key, args.prompt_kb)
        port = args.gateway_port
        scenario(port, small, 4, 1.0, 1, lambda: large)  # warm up both tenants' keys
        print(f"one gateway worker; {args.clients} small-call clients; {args.abusers} abusive "
              f"connections; {args.duration:g} s per scenario")
        print(f"{'small calls':<34} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'abusive answered':>17}")
        for name, make in (("alone", None),
                           (f"with {args.prompt_kb} KB prompts", lambda: large),
                           ("with random-key flood",
                            lambda: _request_bytes(_random_key(), False))):
            result, answered = scenario(port, small, args.clients, args.duration, args.abusers,
                                        make)
            print(f"{name:<34} {result.rps:>8.0f} {result.pct(50):>8.2f} {result.pct(90):>8.2f} "
                  f"{result.pct(99):>8.2f} {answered:>17}")
        if args.sizes_kb:
            estimation_costs(args.sizes_kb)
        return 0
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=15)
        embedded.stop_all(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
