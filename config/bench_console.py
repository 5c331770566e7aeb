"""Benchmark: every console page and management API list of one tenant at its real size.

    python -m config.bench_console [--keys 20000] [--projects 200] [--events 1000000]
                                   [--repeat 5]

A config module, like config/bench.py: it starts its own embedded Redis and PostgreSQL
(config/embedded.py) in a temporary directory (never the caller's), migrates, and makes one
tenant "big" with an owner, `--projects` projects and `--keys` API keys spread over them, and
`--events` audit events over the last year. The keys are bulk-inserted (bulk_create, 5,000 rows
a statement), each with a real secret (tenants.api_key_format.generate_key); a tenth have
sub-limits of their own (so the live counters read them), a tenth are revoked, a twentieth
expired, a tenth rotating (an old secret in its grace period), a third used in the last month.
The audit events are COPYed (psycopg's COPY FROM STDIN) with distinct times and a mix of actions
and actors; then VACUUM ANALYZE. Writing rows straight into the tables is the benchmark's only
shortcut around tenants.services: a million audited calls through it would take hours.

Then each page and list is read through Django's test client (in-process: the view, its queries
and its template, not a network) as the tenant's owner: once to warm the caches, then `--repeat`
times; printed: the median and the worst time in ms, the body's size in KB, and whether the page
is within the budget (100 ms and 200 KB). docs/benchmarks.md ("The console at a tenant's real
size") keeps the figures of a run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

BUDGET_MS = 100.0
BUDGET_KB = 200.0
BATCH = 5_000
ACTIONS = ("key.issued", "key.rotated", "key.revoked", "key.updated", "project.created",
           "project.updated", "tenant.updated", "webhook.created", "member.invited",
           "token.issued")


def services() -> AbstractContextManager[Path]:
    """This benchmark's own embedded Redis and PostgreSQL (config.embedded.scratch_system)."""
    from config import embedded

    return embedded.scratch_system("bench-console")


def make_tenant(projects: int, keys: int, events: int, seed: int = 15) -> dict[str, Any]:
    """The big tenant, its owner, projects, keys and audit events; what the URLs need."""
    from django.contrib.auth import get_user_model
    from django.db import connection

    from tenants.api_key_format import generate_key
    from tenants.models import ApiKey, ApiKeySecret, AuditEvent, Membership, Project
    from tenants.services import create_project, create_tenant, issue_management_token

    rng = random.Random(seed)
    started = time.perf_counter()
    tenant = create_tenant("big", plan_name="enterprise", actor="bench", name="Big Corp")
    owner = get_user_model().objects.create_user("owner", "owner@big.test", "bench-password")
    Membership.objects.create(user=owner, tenant=tenant, role=Membership.Role.OWNER)
    for i in range(5):
        member = get_user_model().objects.create_user(f"member{i}", f"m{i}@big.test", "x")
        Membership.objects.create(user=member, tenant=tenant, role=Membership.Role.MEMBER)
    issue_management_token(tenant, name="ci", actor="bench")
    made = [create_project(tenant, f"p{i:04d}", actor="bench", name=f"Project {i}")
            for i in range(projects)]
    now = datetime.now(UTC)
    rows: list[ApiKey] = []
    for n in range(keys):
        state = n % 20
        rows.append(ApiKey(
            project=made[n % projects], name=f"svc-{n:05d}-{rng.choice(('api', 'ci', 'etl'))}",
            tokens_per_day=100_000 if n % 10 == 0 else None,
            revoked_at=now - timedelta(days=rng.randint(1, 90)) if state in (1, 2) else None,
            expires_at=now - timedelta(days=1) if state == 3 else None,
            last_used_at=(now - timedelta(minutes=rng.randint(1, 43_000)) if n % 3 == 0
                          else None),
            created_by="bench"))
    ApiKey.objects.bulk_create(rows, batch_size=BATCH)
    secrets: list[ApiKeySecret] = []
    for n, api_key in enumerate(rows):
        for old in range(2 if n % 20 in (4, 5) else 1):
            _, prefix, digest, last4 = generate_key()
            secrets.append(ApiKeySecret(
                api_key=api_key, prefix=prefix, digest=digest, last4=last4,
                expires_at=now + timedelta(hours=12) if old else None))
    ApiKeySecret.objects.bulk_create(secrets, batch_size=BATCH)
    keys_done = time.perf_counter()
    # COPY the audit trail: distinct times over the last year, newest last.
    with connection.cursor() as cursor:
        raw = cursor.cursor
        table = AuditEvent._meta.db_table
        span = 365 * 86_400
        with raw.copy(f"COPY {table} (tenant_id, actor, action, target, data, created_at) "
                      "FROM STDIN") as copy:
            for n in range(events):
                moment = now - timedelta(seconds=span * (events - n) / max(events, 1))
                copy.write_row((tenant.pk, f"user:{rng.choice(('owner', 'alice', 'bob'))}",
                                ACTIONS[n % len(ACTIONS)], f"key_bench{n % keys:05d}",
                                '{"changes": {"tokens_per_day": {"from": null, "to": 1000}}}',
                                moment))
    with connection.cursor() as cursor:
        for table in (AuditEvent._meta.db_table, ApiKey._meta.db_table,
                      ApiKeySecret._meta.db_table, Project._meta.db_table):
            cursor.execute(f"VACUUM ANALYZE {table}")
    events_done = time.perf_counter()
    sample = ApiKey.objects.filter(project__tenant=tenant, revoked_at__isnull=True,
                                   tokens_per_day__isnull=False).order_by("-id").first()
    assert sample is not None
    print(f"made {projects:,} projects and {keys:,} keys in {keys_done - started:.1f} s, "
          f"{events:,} audit events in {events_done - keys_done:.1f} s")
    return {"tenant": tenant, "owner": owner, "key": sample.public_id,
            "project": made[-1].public_id}


def pages(ids: dict[str, Any], keys: int) -> list[tuple[str, str]]:
    """(label, url) of every console page and API list of the tenant."""
    t = ids["tenant"].public_id
    c, a = f"/console/t/{t}", f"/api/tenants/{t}"
    last_keys_page = max(1, -(-keys // 50))
    return [
        ("console dashboard", f"{c}/"),
        ("console projects", f"{c}/projects/"),
        ("console projects page 8", f"{c}/projects/?page=8"),
        ("console keys", f"{c}/keys/"),
        ("console keys last page", f"{c}/keys/?page={last_keys_page}"),
        ("console keys 100 a page", f"{c}/keys/?per_page=100"),
        ("console keys search", f"{c}/keys/?q=svc-1999"),
        ("console keys rotating", f"{c}/keys/?status=rotating"),
        ("console keys idle by last use", f"{c}/keys/?used=idle&sort=last_used"),
        ("console keys of a project", f"{c}/keys/?project={ids['project']}&sort=name"),
        ("console key", f"{c}/keys/{ids['key']}/"),
        ("console limits", f"{c}/limits/"),
        ("console audit", f"{c}/audit/"),
        ("console audit one action", f"{c}/audit/?action=key.rotated"),
        ("console audit a day", f"{c}/audit/?from={datetime.now(UTC):%Y-%m-%d}"),
        ("console webhooks", f"{c}/webhooks/"),
        ("console reports", f"{c}/reports/"),
        ("console tokens", f"{c}/tokens/"),
        ("console members", f"{c}/members/"),
        ("api tenants", "/api/tenants/"),
        ("api projects", f"{a}/projects/"),
        ("api keys", f"{a}/keys/"),
        ("api keys deep offset", f"{a}/keys/?offset={max(0, keys - 50)}"),
        ("api keys 200", f"{a}/keys/?limit=200"),
        ("api keys rotating", f"{a}/keys/?status=rotating"),
        ("api keys search", f"{a}/keys/?q=svc-1999"),
        ("api key", f"{a}/keys/{ids['key']}/"),
        ("api audit events", f"{a}/audit-events/"),
        ("api audit events 200", f"{a}/audit-events/?limit=200"),
        ("api audit one action", f"{a}/audit-events/?action=key.revoked"),
        ("api members", f"{a}/members/"),
        ("api invitations", f"{a}/invitations/"),
        ("api tokens", f"{a}/tokens/"),
        ("api webhooks", f"{a}/webhooks/"),
        ("api limits", f"{a}/limits"),
        ("api quota", f"{a}/quota"),
    ]


def measure(client: Any, url: str, repeat: int) -> tuple[float, float, int, int]:
    """(median ms, worst ms, bytes, status) of `repeat` reads after a warm-up."""
    client.get(url)
    times, size, status = [], 0, 0
    for _ in range(repeat):
        began = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - began) * 1000)
        size, status = len(response.content), response.status_code
    return statistics.median(times), max(times), size, status


def follow(client: Any, url: str, hops: int) -> str:
    """The URL `hops` pages deeper through the audit API's `next` links."""
    for hop in range(hops):
        url = client.get(url).json()["next"]
        if url is None:
            raise SystemExit(f"the audit trail ends after {hop + 1} pages, not {hops}: "
                             "give more --events")
        parsed = urlparse(url)
        url = f"{parsed.path}?{parsed.query}"
    return url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--projects", type=int, default=200)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.keys, args.projects, args.events, args.repeat) <= 0:
        parser.error("every count must be > 0")
    with services():
        from django.test import Client

        ids = make_tenant(args.projects, args.keys, args.events)
        client = Client(SERVER_NAME="localhost")
        client.force_login(ids["owner"])
        urls = pages(ids, args.keys)
        deep = follow(client, f"/api/tenants/{ids['tenant'].public_id}/audit-events/", 100)
        urls.append(("api audit events, 100 pages in", deep))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"\n{'page':<36} {'median ms':>9} {'worst ms':>9} {'KB':>8}  status")
        over = 0
        for label, url in urls:
            median, worst, size, status = measure(client, url, args.repeat)
            kb = size / 1024
            within = median <= BUDGET_MS and kb <= BUDGET_KB and status == 200
            over += not within
            print(f"{label:<36} {median:9.1f} {worst:9.1f} {kb:8.1f}  {status}"
                  f"{'' if within else '  OVER'}")
        print(f"\n{len(urls) - over} of {len(urls)} within {BUDGET_MS:.0f} ms (median) and "
              f"{BUDGET_KB:.0f} KB; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs (a loaded machine's times are not the code's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
