"""/metrics: Prometheus text format behind a bearer token, from the session's Redis and
PostgreSQL."""
from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.models import Q
from django.test import Client

from billing import metrics
from billing.ledger import drain_tenant
from billing.models import WebhookDelivery
from billing.webhooks import create_endpoint, create_deliveries
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.services import create_tenant
from tests.support.prometheus import samples

pytestmark = [pytest.mark.django_db, pytest.mark.urls("config.urls")]

TOKEN = "metrics-token-for-tests"


@pytest.fixture
def token(settings: Any) -> str:
    settings.TOLLGATE_METRICS_TOKEN = TOKEN
    return TOKEN


def test_metrics_are_closed_when_no_token_is_set(client: Client, settings: Any) -> None:
    settings.TOLLGATE_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 403
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN,
                                    f"Bearer {TOKEN}x"])
def test_a_missing_or_wrong_token_is_refused(client: Client, token: str,
                                             header: str | None) -> None:
    extra = {"HTTP_AUTHORIZATION": header} if header is not None else {}
    response = client.get("/metrics", **extra)
    assert response.status_code == 403 and b"tollgate" not in response.content


def test_metrics_report_holds_ledger_webhooks_and_reconciliation(
        client: Client, token: str, settings: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    engine: QuotaEngine = get_engine()
    acme = create_tenant("acme", plan_name="free", actor="t")
    quiet = create_tenant("quiet", plan_name="free", actor="t")
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
    tag = tenant_tag(acme.pk)
    for i in range(3):
        engine.reserve(ReserveRequest(tag, f"open-{i}", 10, limits))
    done = engine.reserve(ReserveRequest(tag, "done", 10, limits)).hold
    engine.settle(done, 5)
    engine.reserve(ReserveRequest(tag, "stale", 10, limits))
    engine.sweep(tag, stale_s=0)  # sweeps the four open holds
    engine.reserve(ReserveRequest(tag, "open-now-1", 10, limits))
    engine.reserve(ReserveRequest(tag, "open-now-2", 10, limits))
    drain_tenant(engine.client, acme.pk)
    endpoint, _ = create_endpoint(acme, "http://127.0.0.1:9/x", ["quota.threshold"], actor="t")
    create_deliveries(acme, "quota.threshold", {"id": "evt_1"})
    create_deliveries(acme, "quota.threshold", {"id": "evt_2"})
    WebhookDelivery.objects.filter(endpoint=endpoint).filter(
        pk=WebhookDelivery.objects.filter(endpoint=endpoint).order_by("pk").first().pk
    ).update(status="failed")

    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.content.decode()
    assert "# TYPE tollgate_open_holds gauge" in text
    assert "# TYPE tollgate_usage_records_total counter" in text
    got = samples(text)
    # All tenants' holds in one series (a series per tenant was 4.4 MB a scrape at 100,000
    # tenants); per tenant only for TOLLGATE_METRICS_TENANTS, empty here: no such family.
    assert got["tollgate_open_holds"] == 2
    assert not any(name.startswith("tollgate_tenant_open_holds") for name in got)
    assert quiet.slug not in text
    assert got['tollgate_usage_records_total{status="swept"}'] == 4
    assert got['tollgate_usage_records_total{status="settled"}'] == 1
    assert got['tollgate_usage_records_total{status="released"}'] == 0
    assert got['tollgate_webhook_deliveries_total{status="pending"}'] == 1
    assert got['tollgate_webhook_deliveries_total{status="failed"}'] == 1
    assert got['tollgate_webhook_deliveries_total{status="delivered"}'] == 0
    assert got["tollgate_reconciliation_difference_rate"] == 0


def test_open_holds_are_the_index_tenants_and_per_tenant_only_when_listed(
        settings: Any) -> None:
    """The total reads the index of active tenants' hold indexes while the index is whole (a
    tenant the index missed is not counted until the sweep's full walk marks it again), every
    tenant's when it is not; a tenant label only for the tenants TOLLGATE_METRICS_TENANTS lists
    (by slug or public id: the entry as written)."""
    from quotas import active, keys

    engine: QuotaEngine = get_engine()
    client = engine.client
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
    acme = create_tenant("acme", plan_name="free", actor="t")
    globex = create_tenant("globex", plan_name="free", actor="t")
    missed = create_tenant("missed", plan_name="free", actor="t")
    for tenant, holds in ((acme, 2), (globex, 1), (missed, 4)):
        for i in range(holds):
            engine.reserve(ReserveRequest(tenant_tag(tenant.pk), f"m-{i}", 10, limits))
    shards = active.ActiveSettings.from_django().shards
    # `missed` out of the index, as if its gateway worker died before flushing its mark.
    client.zrem(keys.active_shard_key(active.shard_of(tenant_tag(missed.pk), shards)),
                tenant_tag(missed.pk))
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    active.walked(client, active.Visit(active.SWEEP, True, (), (), now_ms))
    assert metrics.open_holds(client) == 3
    settings.TOLLGATE_METRICS_TENANTS = ["acme", globex.public_id, "nobody"]
    got = samples(metrics.render(client))
    assert got["tollgate_open_holds"] == 3
    assert got['tollgate_tenant_open_holds{tenant="acme"}'] == 2
    assert got[f'tollgate_tenant_open_holds{{tenant="{globex.public_id}"}}'] == 1
    assert not any("missed" in name or "nobody" in name for name in got)
    # The index lost (a shard without the sweep's full-walk member): every tenant's.
    client.zrem(keys.active_shard_key(0), keys.active_walk_member(active.SWEEP, shards))
    assert metrics.open_holds(client) == 7


def test_reconciliation_rate_is_the_latest_runs_maximum() -> None:
    models = pytest.importorskip("billing.models")
    run_model = getattr(models, "ReconciliationRun", None)
    if run_model is None:
        pytest.skip("the reconciliation models are not installed")
    assert metrics.reconciliation_difference_rate() == 0.0

    def run(day: int, rate: str, started: int) -> Any:
        return run_model.objects.create(
            period_start=date(2026, 11, day), period_end=date(2026, 11, day + 1), source="csv",
            started_at=datetime(2026, 11, 30, started, tzinfo=UTC),
            finished_at=datetime(2026, 11, 30, started, 1, tzinfo=UTC), status="drift",
            max_difference_rate=Decimal(rate))

    run(28, "0.300000", started=1)
    run(29, "0.070000", started=2)
    assert metrics.reconciliation_difference_rate() == pytest.approx(0.07)
    assert 'tollgate_reconciliation_difference_rate 0.07' in metrics.render()


class _Families:
    def __init__(self, *families: Any) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


def test_label_values_are_escaped() -> None:
    family = metrics._gauge("m", "h", [({"tenant": 'a"b\\c\nd'}, 1)])
    lines = metrics.exposition(_Families(family)).splitlines()
    assert lines[-1] == 'm{tenant="a\\"b\\\\c\\nd"} 1.0'


def test_corrections_over_hold_usage_and_backlog_are_exported(client: Client, token: str) -> None:
    import json

    from quotas.engine import Phase

    engine: QuotaEngine = get_engine()
    acme = create_tenant("acme", plan_name="free", actor="t")
    tag = tenant_tag(acme.pk)
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)

    def hold(rid: str, amount: int) -> Any:
        return engine.reserve(ReserveRequest(tag, rid, amount, limits, input_tokens=amount // 2,
                                             meta=json.dumps({"m": "gpt-4o"}))).hold

    def event(inp: int, out: int) -> str:
        return json.dumps({"in": inp, "out": out, "outcome": "complete"})

    late = hold("late", 1000)
    engine.progress(late, Phase.FORWARDED)
    engine.sweep(tag, stale_s=0)
    engine.settle(hold("over-1", 100), 130, event(60, 70))  # 30 above its hold
    engine.settle(hold("over-2", 100), 101, event(60, 41))  # 1 above
    engine.settle(hold("fits", 100), 100, event(60, 40))
    drain_tenant(engine.client, acme.pk)
    before = samples(metrics.render())
    assert before['tollgate_usage_records_total{status="swept"}'] == 1
    assert before["tollgate_usage_corrections_total"] == 0

    engine.settle(late, 700, event(500, 200))  # after the sweep: corrects the swept row
    pending = samples(metrics.render())
    assert pending["tollgate_usage_backlog_events"] == 1
    drain_tenant(engine.client, acme.pk)

    got = samples(metrics.render())
    # The corrected row is settled now, yet still counted as swept: no counter goes down.
    assert got['tollgate_usage_records_total{status="swept"}'] == 1
    assert got['tollgate_usage_records_total{status="settled"}'] == 3
    assert got["tollgate_usage_corrections_total"] == 1
    assert got["tollgate_over_hold_requests_total"] == 2
    assert got["tollgate_over_hold_tokens_total"] == 31
    assert got["tollgate_usage_backlog_events"] == 0
    assert got["tollgate_usage_backlog_oldest_seconds"] == 0


def test_the_ledger_counters_sum_the_closed_days_once_a_day_and_the_last_days_live(
        redis_url: str) -> None:
    """The counters are LedgerTotal (every UTC day before today - LIVE_DAYS, written by the
    daily job) plus the rollups of the days since: equal to the sum of every rollup row, while
    a scrape reads only the last days'. A late row into a closed day counts from the next
    refresh on."""
    import redis

    from billing.ledger import drain_all
    from billing.models import LedgerTotal
    from billing.tasks import ensure_ledger_partitions
    from quotas import keys
    from tenants.services import create_project, issue_key
    from tests.billing import rollup_events as ev

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    acme = create_tenant("acme", plan_name="free", actor="t")
    project = create_project(acme, "web", actor="t")
    key = issue_key(project, actor="t").api_key.pk
    stream = keys.usage_stream_key(tenant_tag(acme.pk))
    now = datetime.now(UTC).replace(microsecond=0)

    def drained(*events: dict[str, str]) -> None:
        for fields in events:
            client.xadd(stream, fields)
        assert drain_all(client, tenant_ids=[acme.pk]).events == len(events)

    drained(ev.settled("d0", now, project=project.pk, key=key),
            ev.settled("d2", now - timedelta(days=2), project=project.pk, key=key),
            ev.settled("d10", now - timedelta(days=10), project=project.pk, key=key, out=900,
                       inp=300),
            ev.swept("s10", now - timedelta(days=10), project=project.pk, key=key),
            ev.swept("s40", now - timedelta(days=40), project=project.pk, key=key))
    drained(ev.corrected("s40", now - timedelta(days=40), project=project.pk, key=key))
    everything = metrics._rollup_sums()
    assert LedgerTotal.objects.count() == 0 and metrics._ledger_sums() == everything

    ensure_ledger_partitions()  # the daily job writes the totals
    through = LedgerTotal.objects.values_list("through", flat=True).distinct().get()
    today = datetime.now(UTC).date()  # (the job's own day, unless it just turned midnight)
    assert through in {now.date() - timedelta(days=metrics.LIVE_DAYS),
                       today - timedelta(days=metrics.LIVE_DAYS)}
    # The days that moved out of the scrape's live part were summed with the rollups held
    # still (the test's transaction keeps the lock): no drain commit fell between the sum and
    # the totals' commit, so no counter went down at the switch.
    with connection.cursor() as cursor:
        cursor.execute("SELECT mode FROM pg_locks WHERE pid = pg_backend_pid() "
                       "AND relation = 'billing_usagerollup'::regclass")
        assert "ShareLock" in {mode for (mode,) in cursor.fetchall()}
    assert metrics._ledger_sums() == everything
    closed = metrics._rollup_sums(Q(day__lt=through))
    assert {(t.status, t.corrected): (t.requests, t.over_hold_requests, t.over_hold_tokens)
            for t in LedgerTotal.objects.all()} == closed
    assert sum(n for n, _, _ in closed.values()) == 3  # d10, s10, s40 (corrected)
    counted = dict((labels["status"], n) for labels, n in metrics.usage_record_counts())
    assert (counted["settled"], counted["swept"]) == (3, 2)

    drained(ev.settled("d0-2", now, project=project.pk, key=key))  # today: counted at once
    assert metrics._ledger_sums() == metrics._rollup_sums()
    drained(ev.settled("late", now - timedelta(days=20), project=project.pk, key=key))
    late = metrics._ledger_sums()
    assert late != metrics._rollup_sums()  # a closed day: not until the next refresh
    assert sum(n for n, _, _ in late.values()) == sum(
        n for n, _, _ in metrics._rollup_sums().values()) - 1
    assert metrics.refresh_closed_days(today) == through  # the same day again: nothing moves
    assert metrics._ledger_sums() == late
    tomorrow = metrics.refresh_closed_days(today + timedelta(days=1))
    assert tomorrow == through + timedelta(days=1)
    assert metrics._ledger_sums() == metrics._rollup_sums()  # the late row now counts
