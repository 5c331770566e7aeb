"""Benchmark of the quota engine's hot path: one reserve + one settle per request.

Prints, for each concurrency level: requests per second, p50 / p90 / p99 latency of the
reserve + settle pair, Redis round trips per request (counted on the client's connections) and
the server-side microseconds per script call (from INFO commandstats); then the server time of
each script alone (one client: reserves only, then settles only).

`--allotments` adds allotment chains to every request, as the gateway does for a tenant with
allotments (quotas.limits.allotment_chain), in the day and the cycle window: "project" (the
project's tier and the tenant's pool) or "key" (the key's tier, its project's, the pool). The
allotments are tiny, so every call passes through every tier to the pool: the chain's worst case.
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

from quotas.engine import UNLIMITED, AsyncQuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.windows import WindowKind

ALLOTMENTS = ("none", "project", "key")


def request_limits(allotments: str = "none") -> tuple[ScopeLimit, ...]:
    """A realistic request's counters: tenant day + month, project, key and model scopes; with
    allotments, a chain per window ending in the pool (tiny allotments: every token spills)."""
    limits = (
        ScopeLimit("tenant", WindowKind.DAY, 10**15),
        ScopeLimit("tenant", WindowKind.MONTH, UNLIMITED),
        ScopeLimit("project:1", WindowKind.DAY, UNLIMITED),
        ScopeLimit("key:1", WindowKind.DAY, 10**14),
        ScopeLimit("model:gpt-4o-mini", WindowKind.DAY, UNLIMITED),
    )
    chains: list[ScopeLimit] = []
    for window in (WindowKind.DAY, WindowKind.MONTH):
        if allotments == "key":
            chains.append(ScopeLimit("key:1", window, 1, Unit.ALLOTMENT))
        if allotments in ("project", "key"):
            chains += [ScopeLimit("project:1", window, 1, Unit.ALLOTMENT),
                       ScopeLimit("tenant", window, 10**15, Unit.POOL)]
    return limits + tuple(chains)


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


async def _run_level(url: str, requests: int, concurrency: int,
                     allotments: str = "none") -> dict[str, Any]:
    pool = redis.asyncio.ConnectionPool.from_url(url, max_connections=concurrency + 2)
    pool.connection_class = (
        _CountingUnixConnection if url.startswith("unix://") else _CountingConnection
    )
    client = redis.asyncio.Redis(connection_pool=pool, decode_responses=True)
    engine = AsyncQuotaEngine(client)
    tenant = uuid.uuid4().hex[:12]
    limits = request_limits(allotments)
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


def _process_main(url: str, requests: int, concurrency: int,
                  allotments: str = "none") -> dict[str, Any]:
    return asyncio.run(_run_level(url, requests, concurrency, allotments))


async def _script_times(url: str, calls: int, allotments: str) -> dict[str, float]:
    """Server microseconds per reserve and per settle, apart: one client makes `calls`
    reserves, then settles them (INFO commandstats counts EVALSHA, whatever the script)."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    engine = AsyncQuotaEngine(client)
    tenant = uuid.uuid4().hex[:12]
    limits = request_limits(allotments)
    await engine.settle((await engine.reserve(ReserveRequest(tenant, "warm", 10, limits))).hold, 5)

    async def server_us() -> float:
        stats = await client.info("commandstats")
        return float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))

    await client.execute_command("CONFIG", "RESETSTAT")
    holds = [(await engine.reserve(ReserveRequest(tenant, f"r{i}", 1200, limits))).hold
             for i in range(calls)]
    reserve_us = await server_us()
    await client.execute_command("CONFIG", "RESETSTAT")
    for hold in holds:
        await engine.settle(hold, 700)
    settle_us = await server_us()
    await client.aclose()
    return {"reserve_us": reserve_us, "settle_us": settle_us}


def script_times(url: str, calls: int, allotments: str = "none") -> dict[str, float]:
    return asyncio.run(_script_times(url, calls, allotments))


def measure(url: str, requests: int, concurrency: int, processes: int,
            allotments: str = "none") -> dict[str, float]:
    """Spread `concurrency` clients over `processes` OS processes and merge their figures."""
    per_process = max(1, concurrency // processes)
    if processes == 1:
        parts = [_process_main(url, requests, per_process, allotments)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(processes) as pool:
            parts = pool.starmap(_process_main, [(url, requests // processes, per_process,
                                                  allotments)] * processes)
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
        parser.add_argument("--allotments", choices=ALLOTMENTS, nargs="+", default=["none"],
                            help="Allotment chains in every request: none, the project's tier "
                                 "and the pool, or the key's, the project's and the pool (one "
                                 "table per choice).")

    def handle(self, *args: Any, **options: Any) -> None:
        if settings.REDIS_CLUSTER:
            self.stderr.write("bench_quota measures a standalone Redis; REDIS_CLUSTER is set.")
            return
        url = settings.REDIS_URL
        self.stdout.write(f"Redis: {url}  requests per level: {options['requests']}")
        for allotments in options["allotments"]:
            calls = min(options["requests"], 5000)
            # First: it also loads both scripts, so no NOSCRIPT reload counts as a round trip.
            alone = script_times(url, calls, allotments)
            self.stdout.write(f"allotment chains: {allotments}")
            self.stdout.write(
                f"{'clients':>7} {'procs':>5} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} "
                f"{'p99 ms':>8} {'RTT/req':>8} {'server us/script':>17}"
            )
            for level in options["concurrency"]:
                processes = min(options["processes"], level)
                r = measure(url, options["requests"], level, processes, allotments)
                self.stdout.write(
                    f"{level:>7} {processes:>5} {r['rps']:>9.0f} {r['p50_ms']:>8.3f} "
                    f"{r['p90_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['round_trips']:>8.2f} "
                    f"{r['server_us']:>17.1f}"
                )
            self.stdout.write(f"server us per script alone ({calls} calls, 1 client): reserve "
                              f"{alone['reserve_us']:.1f}, settle {alone['settle_us']:.1f}")
