"""Benchmark: small calls through the gateway with and without a flood of random API keys.

    python -m config.bench_auth [--duration 5] [--concurrency 8] [--flood-clients 32]

Starts what config/bench.py starts (embedded Redis and PostgreSQL in a temporary directory, the
mock upstream, the gateway under uvicorn with `--gateway-workers`; the gateway trusts
X-Forwarded-For from loopback, as behind a reverse proxy), then measures one real key's small
non-streamed calls three times: alone; while `--flood-clients` connections send well-formed
random `tgk_` keys as fast as the gateway answers, all from one client address; and while the
same flood comes from a new address on every request (so no per-address bucket ever fills, and
only the negative cache and the database stand between the flood and the real calls).

Printed: the real calls' requests per second and p50 / p90 / p99 latency in each case, the
flood's answers per second by status (401: looked up or remembered unknown; 429: refused by the
per-address lookup bucket, with no database query), and the database transactions per flood
request.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from config.bench import (
    Result,
    _load,
    _request_bytes,
    _server_counters,
    _setup_tenant,
    _wait_http,
)

ROOT = Path(__file__).resolve().parent.parent


def _random_key() -> str:
    from tenants.api_key_format import generate_key

    return generate_key()[0]


def _flood_request(key: str, address: str) -> bytes:
    payload = b'{"model": "gpt-4o-mini", "max_tokens": 1, "messages": []}'
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + key.encode() + b"\r\nX-Forwarded-For: " + address.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload)


async def _flooder(port: int, deadline: float, rotate: bool, addresses: Any,
                   statuses: Counter[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            address = next(addresses) if rotate else "198.51.100.1"
            writer.write(_flood_request(_random_key(), address))
            head = await reader.readuntil(b"\r\n\r\n")
            statuses[int(head[9:12])] += 1
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                await reader.readuntil(b"\r\n0\r\n\r\n")
                continue
            start = lower.index(b"content-length: ") + 16
            await reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
    finally:
        writer.close()


async def _measure(port: int, key: str, concurrency: int, seconds: float, flood_clients: int,
                   flood: str | None) -> tuple[Result, Counter[int]]:
    statuses: Counter[int] = Counter()
    addresses = (f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}" for n in itertools.count(1))
    deadline = time.monotonic() + seconds
    floods = [asyncio.ensure_future(_flooder(port, deadline, flood == "rotating", addresses,
                                             statuses))
              for _ in range(flood_clients if flood else 0)]
    result = await _load(port, _request_bytes(key, False), concurrency, seconds)
    await asyncio.gather(*floods)
    return result, statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench_auth",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=8, help="real clients")
    parser.add_argument("--flood-clients", type=int, default=32)
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--gateway-port", type=int, default=18100)
    parser.add_argument("--mock-port", type=int, default=18199)
    args = parser.parse_args(argv)

    data_dir = Path(tempfile.mkdtemp(prefix="tgba-", dir="/tmp"))
    os.environ.update({"TOLLGATE_DATA_DIR": str(data_dir), "TOLLGATE_ENV": "development",
                       "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING",
                       "TOLLGATE_TRUSTED_PROXIES": "127.0.0.1/32"})
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
        import uvloop

        django.setup()
        key = _setup_tenant(args.mock_port)
        mock = subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port",
                                 str(args.mock_port)], cwd=ROOT, env=env)
        children.append(mock)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "config.asgi:application", "--port",
             str(args.gateway_port), "--workers", str(args.gateway_workers), "--loop", "uvloop",
             "--http", "httptools", "--log-level", "warning", "--no-access-log"],
            cwd=ROOT, env=env)
        children.append(gateway)
        _wait_http(f"http://127.0.0.1:{args.mock_port}/v1/models", mock)
        _wait_http(f"http://127.0.0.1:{args.gateway_port}/healthz", gateway)
        uvloop.run(_measure(args.gateway_port, key, 4, 1.0, 0, None))  # warm up

        print(f"{'real calls':<26} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} "
              f"{'p99 ms':>8}   flood answers/s by status, DB xacts per flood request")
        for flood in (None, "one address", "rotating"):
            before = _server_counters()
            real, statuses = uvloop.run(_measure(args.gateway_port, key, args.concurrency,
                                                 args.duration, args.flood_clients, flood))
            after = _server_counters()
            name = "no flood" if flood is None else f"flood, {flood}"
            flooded = sum(statuses.values())
            by_status = ", ".join(f"{status}: {count / real.seconds:.0f}"
                                  for status, count in sorted(statuses.items())) or "-"
            # The real calls make no database transaction (their key is cached).
            xacts = (after["db_xacts"] - before["db_xacts"]) / flooded if flooded else 0.0
            print(f"{name:<26} {args.concurrency:>7} {real.rps:>8.0f} {real.pct(50):>8.2f} "
                  f"{real.pct(90):>8.2f} {real.pct(99):>8.2f}   {by_status}"
                  + (f", {xacts:.2f}" if flooded else ""))
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
