"""Bytes per ledger row and per rollup row, measured (docs/capacity.md).

    TOLLGATE_ENV=development python -m config.bench_storage [--rows 100000]

On embedded services of its own (a temporary TOLLGATE_DATA_DIR, removed at the end): migrates,
then copies the ledger's table (billing.UsageRecord) and the rollup's (billing.UsageRollup) into
scratch tables with every column, default, check and index (CREATE TABLE ... (LIKE ... INCLUDING
ALL): no foreign keys, no partitions, the rest as in production), fills each with `--rows`
realistic rows (one INSERT ... SELECT over generate_series: request ids of the gateway's shape,
1,000 tenants, a few models, token counts and latencies of short chat calls, strictly increasing
times), VACUUM ANALYZEs them and prints pg_total_relation_size (heap, TOAST and every index)
divided by the rows, the heap and the indexes apart.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

LEDGER_ROWS = """
INSERT INTO scratch_usage (request_id, tenant_id, project_id, api_key_id, provider_key_id,
    endpoint, model, served_model, input_tokens, output_tokens, cached_input_tokens,
    cache_write_tokens, reasoning_tokens, held_tokens, cost_micros, status, detail, http_status,
    latency_ms, streamed, over_soft_limit, started_at, ended_at, recorded_at, sweep_basis,
    swept_input_tokens, swept_output_tokens, swept_cost_micros, corrected_at, over_hold_tokens)
SELECT 'req_' || substr(md5(i::text), 1, 24),
       1 + i %% 1000, 1 + i %% 3000, 1 + i %% 9000, 1 + i %% 20,
       CASE WHEN i %% 10 = 0 THEN 'responses' ELSE 'chat/completions' END,
       (ARRAY['gpt-4o-mini', 'gpt-4o', 'claude-3-5-sonnet-latest', 'o3-mini'])[1 + i %% 4],
       (ARRAY['gpt-4o-mini', 'gpt-4o', 'claude-3-5-sonnet-latest', 'o3-mini'])[1 + i %% 4],
       200 + i %% 3000, 20 + i %% 800, (i %% 5) * 40, 0, CASE WHEN i %% 4 = 3 THEN i %% 20 ELSE 0 END,
       1200 + i %% 4000, 150 + i %% 9000,
       CASE WHEN i %% 50 = 0 THEN 'partial' ELSE 'settled' END,
       CASE WHEN i %% 50 = 0 THEN 'client_left' ELSE 'complete' END,
       200, 300 + i %% 5000, i %% 3 = 0, false,
       t - interval '1 second', t, t + interval '3 seconds', '',
       NULL, NULL, NULL, NULL, 0
FROM (SELECT i, timestamptz '2026-11-01' + i * interval '10 milliseconds' AS t
      FROM generate_series(1, %(rows)s) AS i) AS g
"""

# One row per (tenant, zone, day, project, key, provider key, model, served model, status,
# corrected) group: the sums' columns filled, the group's columns spread.
ROLLUP_ROWS = """
INSERT INTO scratch_rollup ({columns})
SELECT {values}
FROM generate_series(1, %(rows)s) AS i
"""


def _rollup_values(columns: list[tuple[str, str]]) -> tuple[str, str]:
    """A value per column of the rollup table, by its name and type."""
    names, values = [], []
    for name, kind in columns:
        if name == "id":
            continue
        names.append(name)
        if name == "tenant_id":
            values.append("1 + i % 1000")
        elif name.endswith("_id"):
            values.append("1 + i % 9000")
        elif name == "zone":
            values.append("CASE WHEN i % 2 = 0 THEN 'UTC' ELSE 'Asia/Kolkata' END")
        elif name == "day":
            values.append("date '2026-11-01' + (i / 9000)")
        elif name in ("model", "served_model"):
            values.append("(ARRAY['gpt-4o-mini', 'gpt-4o', 'claude-3-5-sonnet-latest'])[1 + i % 3]")
        elif name == "status":
            values.append("'settled'")
        elif kind == "boolean":
            values.append("false")
        elif kind in ("bigint", "integer", "smallint"):
            values.append("(i % 100000) * 37")
        elif kind.startswith("timestamp"):
            values.append("now()")
        elif kind == "date":
            values.append("date '2026-11-01'")
        else:
            values.append("''")
    return ", ".join(names), ", ".join(values).replace(" % ", " %% ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench_storage",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="tgst-", dir="/tmp"))
    os.environ.update({"TOLLGATE_DATA_DIR": str(data_dir),
                       "TOLLGATE_ENV": os.environ.get("TOLLGATE_ENV", "development")})
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from config import embedded

    embedded.start_all(data_dir, persistent=False)
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            for scratch, table in (("scratch_usage", "billing_usagerecord"),
                                   ("scratch_rollup", "billing_usagerollup")):
                cursor.execute(f"CREATE TABLE {scratch} (LIKE {table} INCLUDING ALL)")
            cursor.execute(LEDGER_ROWS, {"rows": args.rows})
            cursor.execute("SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = 'scratch_rollup' ORDER BY ordinal_position")
            names, values = _rollup_values(cursor.fetchall())
            cursor.execute(ROLLUP_ROWS.format(columns=names, values=values), {"rows": args.rows})
        connection.close()
        with connection.cursor() as cursor:
            for scratch in ("scratch_usage", "scratch_rollup"):
                cursor.execute(f"VACUUM ANALYZE {scratch}")
        print(f"{'table':<16} {'rows':>9} {'total B/row':>12} {'heap B/row':>11} "
              f"{'indexes B/row':>14} indexes")
        with connection.cursor() as cursor:
            for scratch, label in (("scratch_usage", "ledger"), ("scratch_rollup", "rollup")):
                cursor.execute(
                    f"SELECT count(*), pg_total_relation_size('{scratch}'), "
                    f"pg_table_size('{scratch}'), pg_indexes_size('{scratch}'), "
                    f"(SELECT count(*) FROM pg_indexes WHERE tablename = '{scratch}') "
                    f"FROM {scratch}")
                rows, total, heap, indexes, count = cursor.fetchone()
                print(f"{label:<16} {rows:>9} {total / rows:>12.0f} {heap / rows:>11.0f} "
                      f"{indexes / rows:>14.0f} {count}")
        connection.close()
    finally:
        embedded.stop_all(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
