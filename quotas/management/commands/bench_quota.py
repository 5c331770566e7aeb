"""Benchmark of the quota engine's hot path: one reserve + one settle per request.

Prints, for each concurrency level: requests per second, p50 / p90 / p99 latency of the
reserve + settle pair, Redis round trips per request (counted on the client's connections) and
the server-side microseconds per script call (from INFO commandstats).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
import uuid
from argparse import ArgumentParser
from typing import Any

import redis.asyncio
from django.conf import settings
from django.core.management.base import BaseCommand

from quotas.engine import UNLIMITED, AsyncQuotaEngine, ReserveRequest, ScopeLimit
from quotas.windows import WindowKind


class _CountingConnection(redis.asyncio.Connection):
    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        await super().send_packed_command(command, check_health)


class _CountingUnixConnection(redis.asyncio.UnixDomainSocketConnection):
    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


def _percentile(sorted_values: list[float], p: float) -> float:
    index = min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


async def _run_level(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    pool = redis.asyncio.ConnectionPool.from_url(url, max_connections=concurrency + 2)
    pool.connection_class = (
        _CountingUnixConnection if url.startswith("unix://") else _CountingConnection
    )
    client = redis.asyncio.Redis(connection_pool=pool, decode_responses=True)
    engine = AsyncQuotaEngine(client)
    tenant = uuid.uuid4().hex[:12]
    # A realistic request: tenant day + month, project, key and model scopes.
    limits = (
        ScopeLimit("tenant", WindowKind.DAY, 10**15),
        ScopeLimit("tenant", WindowKind.MONTH, UNLIMITED),
        ScopeLimit("project:1", WindowKind.DAY, UNLIMITED),
        ScopeLimit("key:1", WindowKind.DAY, 10**14),
        ScopeLimit("model:gpt-4o-mini", WindowKind.DAY, UNLIMITED),
    )
    # Warm up: load the scripts, open the connections, learn the clock offset.
    await asyncio.gather(*(engine.reserve(ReserveRequest(tenant, f"w{i}", 10, limits))
                           for i in range(concurrency)))
    await client.execute_command("CONFIG", "RESETSTAT")  # server us/script: this run only
    latencies: list[float] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            start = time.perf_counter()
            result = await engine.reserve(ReserveRequest(tenant, f"r{i}", 1200, limits))
            await engine.settle(result.hold, 700)
            latencies.append(time.perf_counter() - start)

    _CountingConnection.sends = 0
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    stats = await client.info("commandstats")
    await client.aclose()
    return {
        "elapsed": elapsed,
        "latencies": latencies,
        "round_trips": _CountingConnection.sends,
        "server_us": float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0)),
    }


def _process_main(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    return asyncio.run(_run_level(url, requests, concurrency))


def measure(url: str, requests: int, concurrency: int, processes: int) -> dict[str, float]:
    """Spread `concurrency` clients over `processes` OS processes and merge their figures."""
    per_process = max(1, concurrency // processes)
    if processes == 1:
        parts = [_process_main(url, requests, per_process)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(processes) as pool:
            parts = pool.starmap(_process_main, [(url, requests // processes, per_process)] * processes)
    latencies = sorted(x for p in parts for x in p["latencies"])
    done = len(latencies)
    return {
        "rps": done / max(p["elapsed"] for p in parts),
        "p50_ms": _percentile(latencies, 50) * 1000,
        "p90_ms": _percentile(latencies, 90) * 1000,
        "p99_ms": _percentile(latencies, 99) * 1000,
        "round_trips": sum(p["round_trips"] for p in parts) / done,
        "server_us": statistics.fmean(p["server_us"] for p in parts),
    }


class Command(BaseCommand):
    help = "Measure reserve + settle throughput and latency against the configured Redis."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--requests", type=int, default=20000)
        parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 50])
        parser.add_argument("--processes", type=int, default=1,
                            help="Spread the clients of each level over this many processes.")

    def handle(self, *args: Any, **options: Any) -> None:
        if settings.REDIS_CLUSTER:
            self.stderr.write("bench_quota measures a standalone Redis; REDIS_CLUSTER is set.")
            return
        url = settings.REDIS_URL
        self.stdout.write(f"Redis: {url}  requests per level: {options['requests']}")
        self.stdout.write(
            f"{'clients':>7} {'procs':>5} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
            f"{'RTT/req':>8} {'server us/script':>17}"
        )
        for level in options["concurrency"]:
            processes = min(options["processes"], level)
            r = measure(url, options["requests"], level, processes)
            self.stdout.write(
                f"{level:>7} {processes:>5} {r['rps']:>9.0f} {r['p50_ms']:>8.3f} {r['p90_ms']:>8.3f} "
                f"{r['p99_ms']:>8.3f} {r['round_trips']:>8.2f} {r['server_us']:>17.1f}"
            )
