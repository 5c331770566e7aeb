"""Benchmark: the background jobs at 100,000 tenants of which 10 are active.

    python -m config.bench_background [--tenants 100000] [--active 10] [--events 10]
                                      [--repeat 5] [--no-before]

A config module, like config/bench_ledger.py: it starts its own embedded Redis and PostgreSQL
(config/embedded.py) in a temporary directory, migrates, and bulk-inserts `--tenants` tenants
(Tenant.objects.bulk_create, 5,000 a statement: no service, no audit, they are idle). `--active`
of them then call as the gateway does through the quota engine (which marks them in the index
of active tenants, quotas/active.py): `--events` reserve + settle each, and one hold left open.

Timed (the jobs' task functions, as a Celery worker runs them; the index's full walk recorded
just before, so each run visits the index only):

- before (unless --no-before): what each job did per run before the index, on the same data:
  the drain's one XRANGE per tenant of PostgreSQL and the sweep's one engine.sweep per tenant;
- billing.tasks.drain_usage with the active tenants' events waiting (the rows written): the
  process's first run, then its next run with as many new events waiting (a worker drains every
  5 s: only its first run pays the process's one-time costs), then idle runs (nothing waiting;
  the median of --repeat);
- quotas.tasks.sweep_stale_holds with the open holds stale (the engine's stale threshold set to
  1 s for the bench), then idle runs;
- the detectors' tasks (check_quota_thresholds, check_pending_health, check_quota_forecasts)
  and the backlog measure (billing.ledger.usage_backlog: check_ledger_backlog, /metrics);
- the backstop: one drain run and one sweep run doing their full walk (every tenant probed,
  pipelined).

docs/benchmarks.md ("Background jobs at 100,000 tenants") keeps the figures of a run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

BULK = 5_000


def services() -> AbstractContextManager[Path]:
    """This benchmark's own embedded Redis and PostgreSQL (config.embedded.scratch_system)."""
    from config import embedded

    return embedded.scratch_system("bench-background")


def bulk_tenants(count: int) -> list[int]:
    """`count` idle tenants on the free plan, inserted in bulk; their ids, ascending."""
    from tenants.models import Plan, Tenant

    plan = Plan.objects.get(name="free")
    for start in range(0, count, BULK):
        Tenant.objects.bulk_create([Tenant(slug=f"bg-{i:06d}", name=f"bg {i}", plan=plan)
                                    for i in range(start, min(start + BULK, count))])
    return list(Tenant.objects.order_by("pk").values_list("pk", flat=True))


def make_active(engine: Any, tenant_ids: list[int], events: int, prefix: str = "bg",
                open_hold: bool = True) -> None:
    """Calls as the gateway makes them: `events` reserve + settle per tenant (each leaves a
    usage event for the drain) and one hold left open (for the sweep) unless not `open_hold`."""
    from quotas.engine import ReserveRequest, ScopeLimit
    from quotas.keys import tenant_tag
    from quotas.windows import WindowKind

    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**12),)
    meta = json.dumps({"m": "gpt-4o", "served": "gpt-4o", "ep": "chat/completions"})
    event = json.dumps({"in": 300, "out": 120, "st": 200, "lat": 700, "outcome": "complete",
                        "pk": None, "stream": False, "soft": False})
    for tenant_id in tenant_ids:
        tag = tenant_tag(tenant_id)
        for i in range(events):
            hold = engine.reserve(ReserveRequest(tag, f"{prefix}-{tag}-{i}", 1000, limits,
                                                 meta=meta)).hold
            engine.settle(hold, 420, event)
        if open_hold:
            engine.reserve(ReserveRequest(tag, f"{prefix}-{tag}-open", 1000, limits, meta=meta))


def walked_now(client: Any) -> None:
    """Every job's full walk done just now: the runs below visit the index only."""
    from quotas import active

    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    for job in active.JOBS:
        active.walked(client, active.Visit(job, True, (), (), now_ms))


def timed(work: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def median_of(work: Callable[[], Any], repeat: int) -> float:
    return statistics.median(timed(work)[0] for _ in range(repeat))


def before(engine: Any, tenant_ids: list[int]) -> tuple[float, float, float]:
    """One run of each job as it was before the index: the drain read every tenant's stream
    (one XRANGE each, the tenants from PostgreSQL), the sweep swept every tenant (one
    engine.sweep each), the backlog (check_ledger_backlog, /metrics) measured every tenant's
    stream (pipelined XLEN + XRANGE). On idle tenants that is all they did."""
    from quotas import keys
    from tenants.models import Tenant

    client = engine.client

    def drain() -> None:
        for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
            client.xrange(keys.usage_stream_key(keys.tenant_tag(tenant_id)), count=500)

    def sweep() -> None:
        for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
            engine.sweep(keys.tenant_tag(tenant_id))

    def backlog() -> None:  # the backlog alert's and /metrics' gauges: every tenant's stream
        from billing.ledger import usage_backlog

        usage_backlog(client, [keys.usage_stream_key(keys.tenant_tag(t)) for t in
                               Tenant.objects.order_by("pk").values_list("pk", flat=True)])

    return timed(drain)[0], timed(sweep)[0], timed(backlog)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from billing import tasks as billing_tasks
    from billing.ledger import usage_backlog
    from billing.models import UsageRecord
    from quotas import active, keys, runtime
    from quotas import tasks as quota_tasks
    from quotas.engine import QuotaEngine

    figures: dict[str, Any] = {}
    figures["insert_s"], ids = timed(lambda: bulk_tenants(args.tenants))
    # Holds are stale after 1 s for the bench's sweep (QUOTA_STALE_HOLD_SECONDS cannot go below
    # twice the gateway's call deadline); everything else as configured.
    base = runtime.get_engine()
    engine = QuotaEngine(base.client, dataclasses.replace(base.settings, stale_hold_s=1))
    runtime._engine = engine
    active_ids = ids[:: max(len(ids) // args.active, 1)][: args.active]
    make_active(engine, active_ids, args.events)
    walked_now(engine.client)
    if not args.no_before:
        # At the configured stale threshold: the old sweep's cost, without ending the holds
        # the new one is timed on.
        figures["before"] = before(base, ids)
    time.sleep(1.1)  # the open holds are stale now

    # A worker's Celery app is finalized when it starts; the first task call of this process
    # would otherwise do it (about 16 ms) inside the drain's timing.
    from config.celery import app as celery_app

    celery_app.finalize()
    rows_before = UsageRecord.objects.count()
    cpu = time.process_time()
    figures["drain_busy_s"], moved = timed(billing_tasks.drain_usage)
    # This process's CPU (the drain's Python; PostgreSQL's and Redis' work is theirs).
    figures["drain_busy_cpu_s"] = time.process_time() - cpu
    figures["drain_moved"] = moved
    figures["rows"] = UsageRecord.objects.count() - rows_before
    # The same again: a worker drains every 5 s, and only its first run pays this process's
    # one-time costs (Django compiling the run's queries, the drain's SQL built and cached).
    make_active(engine, active_ids, args.events, prefix="bg-next", open_hold=False)
    cpu = time.process_time()
    figures["drain_next_s"], figures["drain_next_moved"] = timed(billing_tasks.drain_usage)
    figures["drain_next_cpu_s"] = time.process_time() - cpu
    figures["drain_idle_s"] = median_of(billing_tasks.drain_usage, args.repeat)
    figures["sweep_busy_s"], swept = timed(quota_tasks.sweep_stale_holds)
    figures["swept"] = swept
    figures["sweep_idle_s"] = median_of(quota_tasks.sweep_stale_holds, args.repeat)
    billing_tasks.drain_usage()  # the swept holds' events
    figures["thresholds_s"] = median_of(billing_tasks.check_quota_thresholds, args.repeat)
    figures["pending_s"] = median_of(billing_tasks.check_pending_health, args.repeat)
    figures["forecasts_s"] = median_of(billing_tasks.check_quota_forecasts, args.repeat)
    figures["backlog_s"] = median_of(lambda: usage_backlog(engine.client), args.repeat)
    # A /metrics scrape's billing families (billing/metrics.py: the open holds, the ledger's
    # rollup sums, the backlog...), as Prometheus reads them every 15 s or so.
    from billing import metrics as billing_metrics

    figures["scrape_bytes"] = len(billing_metrics.render(engine.client))
    figures["scrape_s"] = median_of(lambda: billing_metrics.render(engine.client), args.repeat)
    # The backstop: the same jobs when their full walk is due (every tenant, pipelined probes).
    for shard in range(engine.settings.active_shards):
        engine.client.zrem(keys.active_shard_key(shard),
                           *(keys.active_walk_member(job, engine.settings.active_shards)
                             for job in (active.DRAIN, active.SWEEP)))
    figures["drain_full_s"] = timed(billing_tasks.drain_usage)[0]
    figures["sweep_full_s"] = timed(quota_tasks.sweep_stale_holds)[0]
    return figures


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    ms = 1000
    print(f"\n== {args.tenants:,} tenants, {args.active} active "
          f"({args.events} settled calls and 1 open hold each), load average "
          f"{os.getloadavg()[0]:.1f} ==")
    print(f"  tenants inserted in {figures['insert_s']:.1f} s")
    if "before" in figures:
        drain_s, sweep_s, backlog_s = figures["before"]
        print(f"  before the index (every tenant): drain run {drain_s * ms:,.0f} ms, "
              f"sweep run {sweep_s * ms:,.0f} ms, backlog {backlog_s * ms:,.0f} ms")
    print(f"  drain run, {figures['drain_moved']} events waiting ({figures['rows']} rows "
          f"written): {figures['drain_busy_s'] * ms:.1f} ms "
          f"(CPU {figures['drain_busy_cpu_s'] * ms:.1f} ms), the process's first run; its "
          f"next run, {figures['drain_next_moved']} events waiting: "
          f"{figures['drain_next_s'] * ms:.1f} ms (CPU {figures['drain_next_cpu_s'] * ms:.1f} "
          f"ms); idle: {figures['drain_idle_s'] * ms:.1f} ms (median of {args.repeat})")
    print(f"  sweep run, {figures['swept']} stale holds ended: "
          f"{figures['sweep_busy_s'] * ms:.1f} ms; idle: {figures['sweep_idle_s'] * ms:.1f} ms")
    print(f"  threshold catch-up {figures['thresholds_s'] * ms:.1f} ms, pending health "
          f"{figures['pending_s'] * ms:.1f} ms, forecasts {figures['forecasts_s'] * ms:.1f} ms, "
          f"backlog (alert, /metrics) {figures['backlog_s'] * ms:.1f} ms")
    print(f"  /metrics scrape, billing families: {figures['scrape_s'] * ms:.1f} ms, "
          f"{figures['scrape_bytes']:,} bytes (median of {args.repeat})")
    print(f"  backstop (full walk, every tenant probed): drain {figures['drain_full_s'] * ms:,.0f}"
          f" ms, sweep {figures['sweep_full_s'] * ms:,.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=100_000)
    parser.add_argument("--active", type=int, default=10)
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-before", action="store_true",
                        help="skip the one-call-per-tenant runs (they take seconds)")
    args = parser.parse_args(argv)
    if min(args.tenants, args.active, args.events, args.repeat) <= 0:
        parser.error("every count must be > 0")
    if args.active > args.tenants:
        parser.error("--active must not exceed --tenants")
    with services():
        report(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
