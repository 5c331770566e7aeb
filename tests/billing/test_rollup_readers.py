"""Readers of the ledger's daily rollup: a report, the usage API's totals and /metrics give what
the raw rows give, to the micro-dollar, computed here independently from the raw rows (Kolkata,
UTC+05:30, over two months; corrections, a deleted project, a redelivered batch, unmetered and
released calls), and read no raw row where the rollup holds the whole days."""
from __future__ import annotations

from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing import metrics
from billing.ledger import drain_tenant
from billing.models import UsageRecord
from billing.reports import Month, platform_month, tenant_period, tenant_report, usd
from billing.usage import usage_totals, window_totals
from quotas.cycles import Span, change_cycle
from tenants.models import Project, Tenant
from tenants.services import create_project, issue_key
from tests.billing import rollup_events as ev
from tests.billing.test_rollups import KOLKATA, at, stream_of, tenant_in

pytestmark = pytest.mark.django_db
RAW_TABLE = UsageRecord._meta.db_table


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def drained(client: redis.Redis, slug: str, zone: str) -> tuple[Tenant, Project]:
    """A tenant's two months of calls drained, redelivered once, w1 corrected late, and a
    second project's calls whose project is then deleted."""
    tenant, project, key = tenant_in(slug, zone)

    def own(events: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{**e, "request_id": f"{slug}-{e['request_id']}"} for e in events]

    events = own(stream_of(project.pk, key))
    ev.push(client, tenant.pk, events)
    drain_tenant(client, tenant.pk)
    ev.push(client, tenant.pk, events[:4])  # redelivered
    gone = create_project(tenant, "gone", actor="test")
    gone_key = issue_key(gone, actor="test").api_key.pk
    ev.push(client, tenant.pk, own([
        ev.corrected("w1", at(11, 21, 0, 10), project=project.pk, key=key),
        ev.settled("gone1", at(11, 10, 19), project=gone.pk, key=gone_key, money=4_321),
        ev.settled("gone2", at(11, 11, 3), project=gone.pk, key=gone_key, money=1)]))
    drain_tenant(client, tenant.pk)
    Project.objects.filter(pk=gone.pk).delete()
    return tenant, project


def expected_rows(tenant: Tenant, zone: str, start: datetime, end: datetime) -> list[tuple]:
    """The tenant report's cells, from the raw rows, in Python."""
    tz = ZoneInfo(zone)
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0] * 11)
    for r in UsageRecord.objects.filter(tenant=tenant, ended_at__gte=start, ended_at__lt=end
                                        ).select_related("project", "api_key"):
        key = (r.ended_at.astimezone(tz).date().isoformat(),
               r.project.slug if r.project else "(deleted)",
               r.api_key.public_id if r.api_key else "(deleted)", r.served_model)
        g = groups[key]
        corrected = r.corrected_at is not None
        for i, v in enumerate((1, r.input_tokens, r.output_tokens, r.cached_input_tokens,
                               r.cache_write_tokens, r.reasoning_tokens, r.cost_micros,
                               r.status == "swept", corrected,
                               r.swept_cost_micros if corrected else 0,
                               r.cost_micros if corrected else 0)):
            g[i] += int(v)
    return sorted((*k, *g[:6], usd(g[6]), g[7], g[8], usd(g[9]), usd(g[10] - g[9]))
                  for k, g in groups.items())


def raw_queries(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if RAW_TABLE in q["sql"]]


def test_a_kolkata_tenants_reports_from_the_rollup_equal_the_raw_rows(
        client: redis.Redis) -> None:
    tenant, _ = drained(client, "read-kolkata", KOLKATA)
    for period in ("2026-10", "2026-11", "2026-12"):
        with CaptureQueriesContext(connection) as queries:
            report = tenant_period(tenant, period)
        assert raw_queries(queries) == []  # whole days, always in this zone: rollup only
        want = expected_rows(tenant, KOLKATA, report_start(period), report_start(period, 1))
        assert sorted(r[:15] for r in report.rows) == want
        assert report.cost_micros == sum(
            UsageRecord.objects.filter(tenant=tenant, ended_at__gte=report_start(period),
                                       ended_at__lt=report_start(period, 1))
            .values_list("cost_micros", flat=True))
    november = tenant_period(tenant, "2026-11")
    deleted = [r for r in november.rows if r[1] == "(deleted)"]
    assert [(r[0], r[4], r[10]) for r in deleted] == [
        ("2026-11-11", 2, Decimal("0.004322"))]  # 19:00 UTC and 03:00 UTC: both Nov 11 there
    assert november.totals[11:13] == (0, 2)  # w2 is swept on Dec 1 in Kolkata; w1, c-only


def report_start(period: str, months_after: int = 0) -> datetime:
    year, month = map(int, period.split("-"))
    month += months_after
    year, month = year + (month - 1) // 12, (month - 1) % 12 + 1
    return datetime(year, month, 1, tzinfo=ZoneInfo(KOLKATA))


def test_a_window_cut_mid_day_reads_raw_rows_for_its_edge_days_only(
        client: redis.Redis) -> None:
    tenant, _ = drained(client, "read-cut", KOLKATA)
    tz = ZoneInfo(KOLKATA)
    start, end = datetime(2026, 11, 1, 0, 15, tzinfo=tz), datetime(2026, 11, 21, 5, 40, tzinfo=tz)
    with CaptureQueriesContext(connection) as queries:
        report = tenant_report(tenant, Span("c2026-11-01@1", start, end, KOLKATA))
    assert len(raw_queries(queries)) == 1  # the two edge days, one query
    assert sorted(r[:15] for r in report.rows) == expected_rows(tenant, KOLKATA, start, end)
    # s2 ended at 00:00 there (before the cut): out; the rest of Nov 1 is in.
    assert "2026-11-01" in {r[0] for r in report.rows}


def test_days_before_a_change_of_time_zone_are_read_from_raw_rows(
        client: redis.Redis) -> None:
    """The tenant's days were in UTC when these calls ended: their rollups are UTC's. Read in
    Kolkata's days (the zone it moves to), those days come from the raw rows, exactly."""
    tenant, _ = drained(client, "read-moved", "UTC")
    change_cycle(tenant, cycle="", time_zone=KOLKATA, actor="test")
    tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
    tz = ZoneInfo(KOLKATA)
    start, end = datetime(2026, 11, 1, tzinfo=tz), datetime(2026, 12, 1, tzinfo=tz)
    with CaptureQueriesContext(connection) as queries:
        report = tenant_report(tenant, Span("2026-11", start, end, KOLKATA))
    assert len(raw_queries(queries)) == 1  # no day of it has Kolkata rollups
    assert sorted(r[:15] for r in report.rows) == expected_rows(tenant, KOLKATA, start, end)
    # Its UTC month still comes from the rollup alone.
    with CaptureQueriesContext(connection) as queries:
        utc = tenant_period(tenant, "2026-11")
    assert raw_queries(queries) == [] and utc.rows[0][-1] == "UTC"


def test_usage_totals_and_window_totals_from_the_rollup(client: redis.Redis) -> None:
    tenant, project = drained(client, "read-usage", KOLKATA)
    with CaptureQueriesContext(connection) as queries:
        rows = usage_totals(tenant, date(2026, 11, 1), date(2026, 11, 30), ("project", "model"))
    assert raw_queries(queries) == []
    tz = ZoneInfo(KOLKATA)
    want: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in UsageRecord.objects.filter(
            tenant=tenant, ended_at__gte=datetime(2026, 11, 1, tzinfo=tz),
            ended_at__lt=datetime(2026, 12, 1, tzinfo=tz)).select_related("project"):
        w = want[(r.project.public_id if r.project else None, r.served_model)]
        w[0] += 1
        w[1] += r.input_tokens + r.output_tokens
        w[2] += r.cost_micros
    assert {(r["project"], r["model"]): [r["requests"], r["total_tokens"], r["cost_micros"]]
            for r in rows} == want
    only = usage_totals(tenant, date(2026, 11, 1), date(2026, 11, 30), ("day",),
                        project=project.public_id)
    assert sum(r["requests"] for r in only) == sum(
        n for (p, _m), (n, _t, _c) in want.items() if p == project.public_id)
    start = datetime(2026, 11, 1, tzinfo=tz)
    window = window_totals(tenant, start, start + timedelta(days=30), ("project",))
    assert sum(r["cost_micros"] for r in window) == sum(c for _n, _t, c in want.values())


def test_the_platform_month_reads_utc_rollups_only(client: redis.Redis) -> None:
    kolkata, _ = drained(client, "read-plat-a", KOLKATA)
    utc, _ = drained(client, "read-plat-b", "UTC")
    with CaptureQueriesContext(connection) as queries:
        report = platform_month(Month.parse("2026-11"))
    assert raw_queries(queries) == []
    for tenant in (kolkata, utc):
        [row] = [r for r in report.rows if r[0] == tenant.slug]
        raws = UsageRecord.objects.filter(
            tenant=tenant, ended_at__gte=datetime(2026, 11, 1, tzinfo=UTC),
            ended_at__lt=datetime(2026, 12, 1, tzinfo=UTC))
        assert row[2] == raws.count()
        assert row[8] == usd(sum(raws.values_list("cost_micros", flat=True)))


def test_metrics_ledger_families_read_the_rollup_not_the_raw_rows(
        client: redis.Redis) -> None:
    tenant, _ = drained(client, "read-metrics", KOLKATA)
    with CaptureQueriesContext(connection) as queries:
        ledger = metrics._ledger_sums()
        counts = dict((labels["status"], n) for labels, n in metrics.usage_record_counts(ledger))
        fixed = metrics.corrections(ledger)
        over = metrics.over_hold(ledger)
    # Two queries: the closed days' totals (billing.LedgerTotal, empty here: every rollup row
    # is then summed) and the rollups' sums; neither reads a raw row.
    assert raw_queries(queries) == [] and len(queries.captured_queries) == 2
    raw = UsageRecord.objects.all()
    recorded: dict[str, int] = defaultdict(int)
    for r in raw:
        recorded["swept" if r.corrected_at is not None else r.status] += 1
    assert {k: v for k, v in counts.items() if v} == dict(recorded)
    assert fixed == raw.filter(corrected_at__isnull=False).count()
    over_rows = [r.over_hold_tokens for r in raw if r.over_hold_tokens > 0]
    assert over == (len(over_rows), sum(over_rows))


def test_a_released_and_an_unmetered_call_count_as_requests(client: redis.Redis) -> None:
    tenant, _ = drained(client, "read-kinds", "UTC")
    rows = usage_totals(tenant, date(2026, 11, 15), date(2026, 11, 15), ("day",))
    assert [(r["requests"], r["total_tokens"]) for r in rows] == [(2, 100)]




def test_a_zone_the_tenant_never_had_is_read_from_raw_rows(client: redis.Redis) -> None:
    tenant, _ = drained(client, "read-never", "UTC")
    tz = ZoneInfo(KOLKATA)
    start, end = datetime(2026, 11, 1, tzinfo=tz), datetime(2026, 12, 1, tzinfo=tz)
    report = tenant_report(tenant, Span("2026-11", start, end, KOLKATA))
    assert sorted(r[:15] for r in report.rows) == expected_rows(tenant, KOLKATA, start, end)
    assert report.rows
