"""Benchmark: the ledger's readers and the drain at a small and a large ledger, in one run.

    python -m config.bench_ledger [--rows 20000000] [--small 20000] [--tenants 5] [--months 2]
                                  [--drain-events 10000] [--repeat 3] [--migration-rows 0]

A config module, like config/bench.py: it starts its own embedded Redis and PostgreSQL
(config/embedded.py) in a temporary directory, migrates, makes `--tenants` tenants (one of them,
"big", gets a fifth of all rows), and for each size (`--small`, then `--rows`) empties the ledger
and its rollups and:

1. writes that many synthetic usage rows with COPY (psycopg's COPY FROM STDIN, in batches), spread
   evenly over the last `--months` months up to now (each in its month partition: the months are
   made first), 7 models, mostly settled rows with some partial, released, swept, corrected and
   over-hold ones. Each day's first rows are one per rollup group (tenant x model x status,
   corrected apart; every tenant has one key), the rest random: the group set, and so the
   rollup's row count that the readers' cost follows, is the same at both sizes (the defaults, 5
   tenants x 7 models x 6 statuses x ~31-59 days = 6,510-12,390 groups, fit in 20,000 rows);
   then fills the daily rollups and the hourly table the forecasts read from those rows
   (billing.rollups.rebuild, every tenant, every zone; hours of the last
   TOLLGATE_FORECAST_HISTORY_DAYS + 2 days) and ANALYZEs;
2. times, once cold and then `--repeat` times (the median printed): the big tenant's report of
   the last whole month (billing.reports.tenant_period), the platform report of that month
   (billing.reports.platform_month), the big tenant's dashboard (billing.dashboard.build) and a
   /metrics scrape (billing.metrics.render, the collector /metrics serves);
3. puts `--drain-events` usage events on the big tenant's Redis usage stream the way the gateway
   does (the quota engine's reserve, then settle with the event; not timed) and times
   billing.ledger.drain_all over that tenant (what the drain_usage job runs) until the stream is
   empty: rows per second into the ledger of that size (the insert, the rollups in the same
   transaction, and the XDEL).

With `--migration-rows N`, first: the ledger taken back to the plain table before migration
0013, N rows COPYed into it, and `migrate billing 0013` timed (partitioning an existing ledger).

Printed: the load and rollup times, the table's size, the rollup's row count (beside the groups
expected), each reader's time and the drain's rate, per size. docs/benchmarks.md ("The ledger at
scale") keeps the figures of a run.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any


# The bench's synthetic traffic: models with their share of calls and a price per token pair.
MODELS = (("gpt-4o-mini", 40), ("gpt-4o", 20), ("claude-haiku-4-5", 15),
          ("claude-sonnet-4-5", 10), ("gpt-4.1", 7), ("o3-mini", 5), ("text-embedding-3-small", 3))
STATUSES = (("settled", 90), ("partial", 4), ("released", 3), ("swept", 2), ("unmetered", 1))
BIG_SHARE = 0.2  # of all rows, the big tenant's
COPY_BATCH = 200_000


def services() -> AbstractContextManager[Path]:
    """This benchmark's own embedded Redis and PostgreSQL (config.embedded.scratch_system)."""
    from config import embedded

    return embedded.scratch_system("bench-ledger")


def _setup_tenants(count: int) -> list[tuple[int, int, int]]:
    """`count` tenants with a project and a key each; (tenant, project, key) ids, "big" first."""
    from gateway.models import ModelPrice  # noqa: F401 - the catalog is seeded by migrations
    from tenants.services import create_project, create_tenant, issue_key

    out = []
    for i in range(count):
        slug = "big" if i == 0 else f"t{i:03d}"
        tenant = create_tenant(slug, plan_name="enterprise", actor="bench",
                               requests_per_second=1_000_000, tokens_per_minute=10**12,
                               monthly_token_budget=10**15)
        project = create_project(tenant, "app", actor="bench")
        key = issue_key(project, actor="bench").api_key
        out.append((tenant.pk, project.pk, key.pk))
    return out


def _columns() -> list[str]:
    from billing.models import UsageRecord

    return [f.column for f in UsageRecord._meta.concrete_fields if not f.primary_key]


def _row(ids: tuple[int, int, int], model: str, status: str, corrected: bool,
         rng: random.Random) -> str:
    """One row's columns other than the request id and the times, as COPY text (tab separated,
    NULL as \\N). `corrected`: a swept row corrected afterwards (stored as settled)."""
    tenant, project, key = ids
    inp = rng.randint(50, 4000)
    out_tokens = 0 if status == "released" else rng.randint(10, 1500)
    held = inp + 1500
    if status == "settled" and rng.random() < 0.01:
        out_tokens = 1500 + rng.randint(1, 500)  # the tokenizer's estimate was low
    values = [
        tenant, project, key, None, "chat/completions", model, model, inp, out_tokens,
        inp // 4, 0, 0, held, inp * 3 + out_tokens * 12, "settled" if corrected else status,
        "complete", 200, rng.randint(80, 9000), "t" if rng.random() < 0.5 else "f", "f",
        "forwarded" if status == "swept" else "",
        inp if corrected else None, 1500 if corrected else None,
        inp * 3 + 1500 * 12 if corrected else None, max(inp + out_tokens - held, 0)]
    return "\t".join("\\N" if v is None else str(v) for v in values)


def _templates(tenants: list[tuple[int, int, int]], rng: random.Random,
               count: int = 4096) -> list[tuple[str, bool]]:
    """`count` random rows (see _row), each with whether it is a corrected row; the big tenant
    in BIG_SHARE of them. Rows pick one at random: building each row in Python would make the
    script, not PostgreSQL, the bottleneck of the load."""
    model_names = [m for m, _ in MODELS]
    model_weights = [w for _, w in MODELS]
    status_names = [s for s, _ in STATUSES]
    status_weights = [w for _, w in STATUSES]
    others = tenants[1:] or tenants
    out = []
    for _ in range(count):
        ids = tenants[0] if rng.random() < BIG_SHARE else rng.choice(others)
        model = rng.choices(model_names, model_weights)[0]
        status = rng.choices(status_names, status_weights)[0]
        corrected = status == "swept" and rng.random() < 0.3
        out.append((_row(ids, model, status, corrected, rng), corrected))
    return out


def groups(tenants: list[tuple[int, int, int]], rng: random.Random) -> list[tuple[str, bool]]:
    """One row (see _row) per rollup group of a day: every tenant (its one key) x model x
    status, a corrected swept row counted as its own status (the rollup keeps it apart), in a
    shuffled order so that a day with fewer rows than groups still gets a fair sample.

    load() writes these first on each day and random rows after, so that the rollup's group set
    is the same at 20 thousand rows as at 20 million: the readers' cost follows the number of
    rollup rows, and without this the small size would have fewer of them (measuring the data's
    shape, not its size)."""
    out = [(_row(ids, model, status, corrected, rng), corrected)
           for ids in tenants for model, _ in MODELS
           for status, corrected in [(s, False) for s, _ in STATUSES] + [("swept", True)]]
    rng.shuffle(out)
    return out


# The COPY's columns: the request id and the times first (made per row), then the template's.
_TEMPLATE_COLUMNS = (
    "tenant_id", "project_id", "api_key_id", "provider_key_id", "endpoint", "model",
    "served_model", "input_tokens", "output_tokens", "cached_input_tokens", "cache_write_tokens",
    "reasoning_tokens", "held_tokens", "cost_micros", "status", "detail", "http_status",
    "latency_ms", "streamed", "over_soft_limit", "sweep_basis", "swept_input_tokens",
    "swept_output_tokens", "swept_cost_micros", "over_hold_tokens")
_COPY_COLUMNS = ("request_id", "started_at", "ended_at", "recorded_at", "corrected_at",
                 *_TEMPLATE_COLUMNS)


def load(rows: int, tenants: list[tuple[int, int, int]], months: int, seed: int = 15, *,
         partitioned: bool = True) -> float:
    """COPY `rows` synthetic usage rows, ended evenly over the last `months` months up to now
    (started and recorded at their end); returns the seconds taken. `partitioned`: the ledger
    is (its months are made first); else it is the plain table before migration 0013."""
    from django.db import connection

    from billing.partitions import create_month, ensure_partitions, month_of, shift

    assert set(_COPY_COLUMNS) == set(_columns()), "the ledger's columns changed"
    now = datetime.now(UTC)
    first = shift(month_of(now), -(months - 1))
    if partitioned:
        for n in range(months):
            create_month(shift(first, n))
        ensure_partitions(now)
    rng = random.Random(seed)
    templates = _templates(tenants, rng)
    cover = groups(tenants, rng)
    base, end = first.start.timestamp(), now.timestamp()
    # Every UTC day from the first month's start to today, each with one row per group
    # (groups()) spread over the part of the day that has passed, so that the group set is
    # the same whatever the size and whatever the hour of the run (today may have begun minutes
    # ago); the other rows random, ended evenly over the whole span.
    day_starts = [float(d) for d in range(int(base), int(end), 86400)]
    covering = len(day_starts) * len(cover)
    if rows < covering:
        raise ValueError(f"{rows} rows cannot cover {len(cover)} groups on {len(day_starts)} "
                         f"days: at least {covering}")

    def stamped() -> Iterator[tuple[float, tuple[str, bool]]]:
        for start in day_starts:
            span = min(start + 86400, end) - start
            for j, row in enumerate(cover):
                yield start + span * (j + 0.5) / len(cover), row
        step = (end - base) / max(rows - covering, 1)
        for i in range(rows - covering):
            yield base + step * i, templates[rng.getrandbits(12)]

    sql = f"COPY billing_usagerecord ({', '.join(_COPY_COLUMNS)}) FROM STDIN"
    started = time.perf_counter()
    lines: list[str] = []

    def copy() -> None:
        with connection.cursor() as cursor, cursor.cursor.copy(sql) as out:
            out.write("".join(lines))
        lines.clear()

    for i, (at_s, (template, corrected)) in enumerate(stamped()):
        ended = datetime.fromtimestamp(at_s, UTC)
        at = ended.isoformat()
        fixed = (ended + timedelta(minutes=11)).isoformat() if corrected else "\\N"
        lines.append(f"bench-{i:010d}\t{at}\t{at}\t{at}\t{fixed}\t{template}\n")
        if len(lines) == COPY_BATCH:
            copy()
    if lines:
        copy()
    return time.perf_counter() - started


def migration_time(rows: int, tenants: list[tuple[int, int, int]], months: int) -> float:
    """The ledger back to the plain table of migration 0012 (empty), `rows` rows COPYed into it,
    then `migrate billing 0013` timed: what partitioning an existing ledger of that size takes
    (one transaction; the drain waits for it). The ledger is partitioned again at the end."""
    from django.core.management import call_command
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE billing_usagerecord, billing_usagerollup, billing_usagehourly, "
                       "billing_ledgertotal")
    call_command("migrate", "billing", "0012", verbosity=0)
    load(rows, tenants, months, partitioned=False)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE billing_usagerecord")
    started = time.perf_counter()
    call_command("migrate", "billing", verbosity=0)
    return time.perf_counter() - started


def fill_rollups(months: int) -> float:
    """The daily rollups of every loaded day and the hourly table's hours, computed by SQL from
    the raw rows."""
    from billing.partitions import month_of, shift
    from billing.rollups import rebuild

    now = datetime.now(UTC)
    first = shift(month_of(now), -(months - 1))
    started = time.perf_counter()
    rebuild(first.start.date() - timedelta(days=1), (now + timedelta(days=2)).date())
    return time.perf_counter() - started


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(cold seconds, median of `repeat` more)."""
    started = time.perf_counter()
    fn()
    cold = time.perf_counter() - started
    warm = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - started)
    return cold, statistics.median(warm)


def drain_rate(tenant_ids: tuple[int, int, int], events: int) -> tuple[int, float]:
    """`events` usage events on the tenant's stream as the gateway makes them, then the drain
    timed until the stream is empty: (rows written, seconds)."""
    from billing.ledger import drain_all
    from billing.models import UsageRecord
    from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
    from quotas.keys import tenant_tag
    from quotas.runtime import get_engine
    from quotas.windows import WindowKind

    tenant, project, key = tenant_ids
    client = get_engine().client
    engine = QuotaEngine(client)
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**15),)
    prefix = f"drain-{time.time_ns()}"
    for i in range(events):
        model = MODELS[i % len(MODELS)][0]
        meta = json.dumps({"p": project, "k": key, "m": model, "served": model,
                           "ep": "chat/completions"})
        hold = engine.reserve(ReserveRequest(tenant_tag(tenant), f"{prefix}-{i}", 2000, limits,
                                             meta=meta)).hold
        event = json.dumps({"in": 300, "out": 120, "st": 200, "lat": 700,
                            "outcome": "complete", "pk": None, "stream": False, "soft": False})
        engine.settle(hold, 420, event, actual_money=300 * 3 + 120 * 12)
    before = UsageRecord.objects.filter(request_id__startswith=prefix).count()
    started = time.perf_counter()
    # As the drain_usage job does (its defaults: batches of 500, 20 a tenant per run).
    while drain_all(client, tenant_ids=[tenant]).events:
        pass
    seconds = time.perf_counter() - started
    written = UsageRecord.objects.filter(request_id__startswith=prefix).count() - before
    return written, seconds


def table_size() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_size_pretty(sum(pg_total_relation_size(inhrelid))) "
                       "FROM pg_inherits WHERE inhparent = 'billing_usagerecord'::regclass")
        return str(cursor.fetchone()[0])


def run_size(rows: int, tenants: list[tuple[int, int, int]], months: int, events: int,
             repeat: int) -> dict[str, Any]:
    from django.db import connection

    from billing import dashboard, metrics
    from billing.forecast import scope_forecasts
    from billing.models import UsageHourly, UsageRecord, UsageRollup
    from billing.partitions import month_of, shift
    from billing.reports import platform_month, tenant_period
    from quotas.limits import PROJECT, TENANT
    from quotas.runtime import get_engine
    from tenants.models import Tenant

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE billing_usagerecord, billing_usagerollup, billing_usagehourly, "
                       "billing_ledgertotal")
    loaded = load(rows, tenants, months)
    rolled = fill_rollups(months)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE billing_usagerecord")
        cursor.execute("ANALYZE billing_usagerollup")
        cursor.execute("ANALYZE billing_usagehourly")
    big = Tenant.objects.select_related("plan").get(pk=tenants[0][0])
    now = datetime.now(UTC)
    days = (now.date() - shift(month_of(now), -(months - 1)).start.date()).days + 1
    last_month = shift(month_of(datetime.now(UTC)), -1)
    client = get_engine().client
    figures: dict[str, Any] = {
        "rows": rows, "load_s": loaded, "rollups_s": rolled, "size": table_size(),
        "rollup_rows": UsageRollup.objects.count(),
        "groups": len(tenants) * len(MODELS) * (len(STATUSES) + 1) * days,
        "tenant_report": timed(lambda: tenant_period(big, str(last_month)), repeat),
        "platform_report": timed(lambda: platform_month(last_month), repeat),
        "dashboard": timed(lambda: dashboard.build(big), repeat),
        # The dashboard's forecasts read the hourly table (billing.forecast): today's hours of
        # the big tenant (before it, they summed that many raw rows of today).
        "forecasts": timed(lambda: scope_forecasts(big, kinds=(TENANT, PROJECT)), repeat),
        "today_rows": UsageRecord.objects.filter(
            tenant=big, ended_at__gte=now.replace(hour=0, minute=0, second=0,
                                                  microsecond=0)).count(),
        "today_hourly": UsageHourly.objects.filter(
            tenant=big, hour__gte=now.replace(hour=0, minute=0, second=0,
                                              microsecond=0)).count(),
        "hourly_rows": UsageHourly.objects.count(),
        "metrics": timed(lambda: metrics.render(client), repeat),
    }
    written, seconds = drain_rate(tenants[0], events)
    figures["drain"] = (written, seconds)
    return figures


def _print(figures: dict[str, Any]) -> None:
    rows = figures["rows"]
    print(f"\n== {rows:,} rows ({figures['size']} with indexes), "
          f"{figures['rollup_rows']:,} rollup rows (of {figures['groups']:,} groups: tenants x "
          f"models x statuses x days), {figures['hourly_rows']:,} hourly rows ==")
    print(f"  load (COPY): {figures['load_s']:.1f} s ({rows / figures['load_s']:,.0f} rows/s); "
          f"rollups from raw rows: {figures['rollups_s']:.1f} s")
    for name, label in (("tenant_report", "tenant month report (big tenant, last month)"),
                        ("platform_report", "platform month report (last month)"),
                        ("dashboard", "dashboard build (big tenant)"),
                        ("forecasts", "  of which the forecasts (big tenant's hourly rows of "
                                      f"today: {figures['today_hourly']:,}, for "
                                      f"{figures['today_rows']:,} raw rows)"),
                        ("metrics", "/metrics scrape (billing collector)")):
        cold, warm = figures[name]
        print(f"  {label}: cold {cold * 1000:,.0f} ms, then median {warm * 1000:,.0f} ms "
              f"({figures['rollup_rows']:,} rollup rows)")
    written, seconds = figures["drain"]
    print(f"  drain: {written:,} events in {seconds:.2f} s = {written / seconds:,.0f} rows/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--months", type=int, default=2)
    parser.add_argument("--drain-events", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--migration-rows", type=int, default=0,
                        help="First time migration 0013 over a plain ledger of this many rows "
                             "(0: not measured).")
    args = parser.parse_args(argv)
    if min(args.rows, args.small, args.tenants, args.months, args.drain_events,
           args.repeat) <= 0:
        parser.error("every count must be > 0")
    with services():
        tenants = _setup_tenants(args.tenants)
        if args.migration_rows > 0:
            seconds = migration_time(args.migration_rows, tenants, args.months)
            print(f"\n== migration 0013 over a plain ledger of {args.migration_rows:,} rows: "
                  f"{seconds:.1f} s ({args.migration_rows / seconds:,.0f} rows/s) ==")
        for rows in (args.small, args.rows):
            _print(run_size(rows, tenants, args.months, args.drain_events, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
