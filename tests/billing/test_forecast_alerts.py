"""Forecast warnings (billing/forecast_alerts.py) and the forecast reader (billing/forecast.py)
over the session's Redis and PostgreSQL: the ledger holds a synthetic history, the counters are
read at a fixed instant (an engine whose clock stands still), and the windows are the tenant's
(Europe/Paris). One `quota.forecast` webhook and one owners' email per scope per window, whatever
the number of runs; a new window warns again; threshold 0, a scope below its threshold, an idle
tenant and a quota already used up warn nothing."""
from __future__ import annotations

import json
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.forecast import DAILY_SHAPE, TRAILING_RATE, scope_forecasts
from billing.forecast_alerts import check_forecasts, forecast_tenant_ids
from billing.models import ForecastAlert, UsageHourly, UsageRecord, WebhookDelivery
from billing.webhooks import create_endpoint, deliver, verify_signature
from quotas import keys
from quotas.engine import QuotaEngine
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import RedisClock
from tenants.models import ApiKey, Membership, Project, Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.rollup_events import create_usage
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

PARIS = "Europe/Paris"
NOON = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # 13:00 in Paris
_ids = itertools.count()


def at(moment: datetime, client: Any = None) -> QuotaEngine:
    """The session's Redis (or `client`), read at a fixed instant (the forecasts' "now")."""
    return QuotaEngine(client or get_engine().client,
                       clock=RedisClock(lambda: moment.timestamp()))


def make_tenant(slug: str, *, day_limit: int = 10_000, **fields: Any) -> Tenant:
    tenant = create_tenant(slug, plan_name="standard", actor="test", tokens_per_day=day_limit)
    # A fresh tenant in its own time zone (no window to finish on the old zone yet).
    Tenant.objects.filter(pk=tenant.pk).update(time_zone=PARIS, **fields)
    return Tenant.objects.select_related("plan").get(pk=tenant.pk)


def add_person(tenant: Tenant, username: str, role: str = "owner") -> None:
    user = get_user_model().objects.create_user(username, email=f"{username}@{tenant.slug}.test")
    Membership.objects.create(user=user, tenant=tenant, role=role)


def counter(tenant: Tenant, scope: str, window_id: str, *, limit: int, used: int,
            pending: int = 0, credit: int = 0, client: Any = None) -> None:
    """A counter as the reserve and settle scripts leave it (quotas/keys.py layout)."""
    client = client or get_engine().client
    key = keys.counter_key(tenant_tag(tenant.pk), scope, window_id)
    client.hset(key, mapping={"limit": limit, "used": used, "pending": pending,
                              "credit": credit})
    client.expire(key, 3 * 86400)


def record(tenant: Tenant, when: datetime, tokens: int, *, project: Project | None = None,
           api_key: ApiKey | None = None) -> None:
    # Through the drain's insert (rows, rollup and hourly table together): the forecasts read
    # the hourly table, which only the ledger's writers keep.
    create_usage(
        request_id=f"fc-{next(_ids)}", tenant=tenant, project=project, api_key=api_key,
        model="gpt-4o", served_model="gpt-4o", input_tokens=tokens, output_tokens=0,
        cost_micros=0, status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)


def burn(tenant: Tenant, start: datetime, hours: int, per_hour: int, *, every: int = 4,
         project: Project | None = None, api_key: ApiKey | None = None) -> None:
    """`every` ledger rows an hour, `per_hour` tokens an hour, from `start` for `hours`."""
    for hour in range(hours):
        for i in range(every):
            record(tenant, start + timedelta(hours=hour, minutes=7 + i * 60 // every),
                   per_hour // every, project=project, api_key=api_key)


def busy_tenant(slug: str = "acme", client: Any = None) -> tuple[Tenant, Project]:
    """A tenant (10,000 tokens a day) at 6,000 used and held at 13:00 Paris time, burning 400
    tokens an hour over the last three hours (100 of them in project web, 4,000 a day)."""
    acme = make_tenant(slug)
    web = create_project(acme, "web", actor="test", tokens_per_day=4_000)
    batch = create_project(acme, "batch", actor="test")
    burn(acme, NOON - timedelta(hours=3), 3, 300, every=3, project=batch)
    burn(acme, NOON - timedelta(hours=3), 3, 100, every=1, project=web)
    counter(acme, "tenant", "d2026-12-01", limit=10_000, used=5_500, pending=500, client=client)
    counter(acme, keys.project_scope(web.pk), "d2026-12-01", limit=4_000, used=1_000,
            client=client)
    return acme, web


def test_the_reader_forecasts_each_limited_scope_in_the_tenants_windows() -> None:
    acme, web = busy_tenant()
    key = issue_key(web, actor="test", name="ci").api_key
    ApiKey.objects.filter(pk=key.pk).update(tokens_per_month=50_000)
    counter(acme, keys.api_key_scope(key.pk), "m2026-12", limit=50_000, used=0)
    found = {(f.kind, f.window_kind.value): f for f in scope_forecasts(acme, engine=at(NOON))}
    # The tenant's cycle has no limit (no monthly budget): no forecast for it.
    assert set(found) == {("tenant", "day"), ("project", "day"), ("key", "month")}
    tenant = found["tenant", "day"].forecast
    assert (tenant.window.id, tenant.method) == ("d2026-12-01", TRAILING_RATE)
    # Paris: the day ends at 23:00 UTC, 11 hours after noon UTC; 400 an hour.
    assert (tenant.so_far, tenant.inputs["rate_per_hour"], tenant.tokens) == (6_000, 400, 10_400)
    assert tenant.reach_ms == int(datetime(2026, 12, 1, 22, tzinfo=UTC).timestamp() * 1000)
    project = found["project", "day"].forecast
    assert (project.tokens, project.percent, project.reach_ms) == (2_100, 52.5, None)
    month = found["key", "month"].forecast
    assert month.window.id == "m2026-12" and (month.tokens, month.percent) == (0, 0.0)


def test_the_reader_uses_the_days_shape_with_a_week_of_history() -> None:
    """Eight days at 100 tokens an hour at night and 1,000 in office hours (08:00-18:00 Paris);
    today ran at twice that. The day's end is known: twice a usual day."""
    acme = make_tenant("shaped", day_limit=100_000)
    start = datetime(2026, 11, 23, tzinfo=UTC) - timedelta(hours=1)  # Paris midnight
    for hour in range(8 * 24 + 13):
        moment = start + timedelta(hours=hour)
        local_hour = (moment + timedelta(hours=1)).hour
        tokens = 1_000 if 8 <= local_hour < 18 else 100
        record(acme, moment + timedelta(minutes=30), tokens * (2 if hour >= 8 * 24 else 1))
    usual_day = 10 * 1_000 + 14 * 100
    today_so_far = 2 * (8 * 100 + 5 * 1_000)
    counter(acme, "tenant", "d2026-12-01", limit=100_000, used=today_so_far)
    [item] = scope_forecasts(acme, engine=at(NOON))
    fc = item.forecast
    assert fc.method == DAILY_SHAPE and fc.inputs["history_days"] == 8
    assert (fc.inputs["usual_day_tokens"], fc.inputs["ratio"]) == (usual_day, 2.0)
    assert fc.tokens == 2 * usual_day


# The ledger as the forecasts read it: its hourly table (billing.UsageHourly), and the raw rows,
# which no forecast reads any more (counted too, so that a raw read coming back fails here).
_LEDGER_TABLES = (UsageRecord._meta.db_table, UsageHourly._meta.db_table)


def _ledger_queries(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if any(table in q["sql"] for table in _LEDGER_TABLES)]


def test_every_scopes_history_comes_from_one_ledger_query() -> None:
    """Limited projects and keys do not cost a ledger query each (an N+1 on the dashboard and
    GET /quota): one grouped query per tenant, split per project and key; the tenant's history
    is the sum of every row. Past days are cached: the next read asks only for today's hours."""
    acme = make_tenant("grouped", day_limit=100_000)
    yesterday = NOON - timedelta(days=1)
    scopes: dict[str, dict[datetime, int]] = {"tenant": {}}
    for i in range(4):
        project = create_project(acme, f"p{i}", actor="test", tokens_per_day=50_000)
        key = issue_key(project, actor="test", name=f"k{i}", tokens_per_day=10_000).api_key
        other = issue_key(project, actor="test", name=f"o{i}").api_key  # unlimited: no forecast
        for moment, tokens, api_key in ((yesterday, 100 * (i + 1), key),
                                        (NOON - timedelta(hours=1), 10 * (i + 1), key),
                                        (NOON - timedelta(hours=1), 1, other)):
            record(acme, moment + timedelta(minutes=5), tokens, project=project, api_key=api_key)
            hour = moment - timedelta(minutes=moment.minute)
            for scope in ("tenant", keys.project_scope(project.pk), keys.api_key_scope(key.pk)
                          if api_key == key else None):
                if scope is not None:
                    hours = scopes.setdefault(scope, {})
                    hours[hour] = hours.get(hour, 0) + tokens
    record(acme, NOON - timedelta(minutes=30), 7)  # no project, no key: the tenant's only
    scopes["tenant"][NOON - timedelta(hours=1)] += 7
    expected = {scope: {int(h.timestamp() * 1000): t for h, t in hours.items()}
                for scope, hours in scopes.items()}

    with CaptureQueriesContext(connection) as cold:
        found = scope_forecasts(acme, engine=at(NOON))
    assert {(f.kind, f.window_kind.value) for f in found} == {
        ("tenant", "day"), *((kind, "day") for kind in ("project", "key"))}
    assert len(found) == 1 + 4 + 4
    assert {f.scope: dict(f.history.hours) for f in found} == expected
    assert len(_ledger_queries(cold)) == 1  # the 28 days and today, split at today
    key_reads = [q for q in cold.captured_queries
                 if f'FROM "{ApiKey._meta.db_table}"' in q["sql"]]
    assert len(key_reads) == 1  # the limited keys, once
    with CaptureQueriesContext(connection) as warm:
        again = scope_forecasts(acme, engine=at(NOON))
    assert len(_ledger_queries(warm)) == 1  # today only: the past days are cached
    assert {f.scope: dict(f.history.hours) for f in again} == expected
    assert [f.forecast for f in again] == [f.forecast for f in found]
    # The dashboard asks for the tenant and its projects only: no key is read or forecast.
    with CaptureQueriesContext(connection) as drawn:
        shown = scope_forecasts(acme, engine=at(NOON), kinds=("tenant", "project"))
    assert {f.kind for f in shown} == {"tenant", "project"} and len(shown) == 5
    assert not [q for q in drawn.captured_queries
                if f'FROM "{ApiKey._meta.db_table}"' in q["sql"]]
    assert len(_ledger_queries(drawn)) == 1


def test_a_warned_scope_costs_no_ledger_read() -> None:
    """The beat reads the warnings of the current windows first: once every active scope was
    warned, a run reads no history (and an idle tenant not even the warnings)."""
    hot = make_tenant("hot")
    burn(hot, NOON - timedelta(hours=3), 3, 400)
    counter(hot, "tenant", "d2026-12-01", limit=10_000, used=6_000)
    [warning] = check_forecasts([hot.pk], engine=at(NOON))
    assert warning.scope.scope == "tenant"
    with CaptureQueriesContext(connection) as queries:
        assert check_forecasts([hot.pk], engine=at(NOON + timedelta(minutes=5))) == []
    assert _ledger_queries(queries) == []
    assert len([q for q in queries.captured_queries
                if ForecastAlert._meta.db_table in q["sql"]]) == 1
    # A project that becomes active is still forecast (one ledger read, for it alone) and warned.
    web = create_project(hot, "web", actor="test", tokens_per_day=1_000)
    burn(hot, NOON - timedelta(hours=3), 3, 90, every=1, project=web)
    counter(hot, keys.project_scope(web.pk), "d2026-12-01", limit=1_000, used=700)
    with CaptureQueriesContext(connection) as queries:
        [second] = check_forecasts([hot.pk], engine=at(NOON + timedelta(minutes=10)))
    assert second.scope.scope == keys.project_scope(web.pk)
    assert len(_ledger_queries(queries)) == 1
    assert ForecastAlert.objects.filter(tenant=hot).count() == 2


def test_one_warning_per_scope_per_window_and_again_in_the_next(settings: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    acme, web = busy_tenant()
    add_person(acme, "olga")
    add_person(acme, "mike", role="member")
    with Receiver() as receiver:
        subscribed, secret = create_endpoint(acme, receiver.url, ["quota.forecast"], actor="t")
        create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")

        [warning] = check_forecasts([acme.pk], engine=at(NOON))
        assert check_forecasts([acme.pk], engine=at(NOON)) == []  # once per window
        assert check_forecasts([acme.pk], engine=at(NOON + timedelta(minutes=30))) == []
        assert (warning.scope.who, warning.scope.forecast.window.id) == ("tenant", "d2026-12-01")
        # The project (forecast 2,100 of 4,000: 52.5 %) is below the threshold: nothing.
        assert list(ForecastAlert.objects.filter(tenant=acme).values_list(
            "scope", "window", "threshold", "limit", "used", "forecast", "method")) == [
            ("tenant", "d2026-12-01", 80, 10_000, 6_000, 10_400, "trailing_rate")]

        [delivery] = WebhookDelivery.objects.filter(endpoint__tenant=acme)
        assert delivery.endpoint_id == subscribed.pk and delivery.pk in warning.delivery_ids
        expected = {
            "type": "quota.forecast", "tenant": "acme", "scope": "tenant", "scope_kind": "tenant",
            "scope_id": acme.public_id, "window_kind": "day", "window": "d2026-12-01",
            "window_start": "2026-11-30T23:00:00+00:00",
            "window_end": "2026-12-01T23:00:00+00:00", "used": 5_500, "pending": 500,
            "limit": 10_000, "credit": 0, "forecast": 10_400, "percent": 104.0,
            "would_reach_limit_at": "2026-12-01T22:00:00+00:00", "threshold": 80,
            "method": "trailing_rate", "inputs": {
                "trailing_hours": 3, "trailing_tokens": 1_200, "rate_per_hour": 400,
                "remaining_hours": 11.0, "why": "fewer than 7 days of history"}}
        assert {k: v for k, v in delivery.payload.items() if k not in ("id", "created")} == expected
        assert deliver(delivery.pk).status == WebhookDelivery.Status.DELIVERED
        [request] = receiver.requests
        assert request["headers"]["Tollgate-Event"] == "quota.forecast"
        assert verify_signature(secret, request["headers"]["Tollgate-Timestamp"], request["body"],
                                request["headers"]["Tollgate-Signature"])
        assert json.loads(request["body"]) == delivery.payload

    [message] = mail.outbox
    assert message.to == ["olga@acme.test"] and warning.emailed == ("olga@acme.test",)
    assert "forecast to reach 104%" in message.subject
    assert "10,400 tokens" in message.body and "2026-12-01 22:00 UTC" in message.body
    assert "400 tokens per hour" in message.body

    # The next day: a new window, a new warning (once again).
    tomorrow = NOON + timedelta(days=1)
    burn(acme, tomorrow - timedelta(hours=3), 3, 400)
    counter(acme, "tenant", "d2026-12-02", limit=10_000, used=7_000)
    [again] = check_forecasts([acme.pk], engine=at(tomorrow))
    assert (again.scope.forecast.window.id, again.scope.forecast.tokens) == ("d2026-12-02", 11_400)
    assert check_forecasts([acme.pk], engine=at(tomorrow)) == []
    assert ForecastAlert.objects.filter(tenant=acme).count() == 2
    assert WebhookDelivery.objects.filter(endpoint=subscribed).count() == 2
    assert len(mail.outbox) == 2


def test_threshold_zero_warns_nothing() -> None:
    acme, _ = busy_tenant()
    add_person(acme, "olga")
    Tenant.objects.filter(pk=acme.pk).update(forecast_threshold_percent=0)
    assert acme.pk not in forecast_tenant_ids()
    assert check_forecasts([acme.pk], engine=at(NOON)) == []
    assert check_forecasts(engine=at(NOON)) == []
    assert not ForecastAlert.objects.filter(tenant=acme).exists() and mail.outbox == []


def test_a_scope_below_the_threshold_warns_nothing_until_the_threshold_is_lower() -> None:
    calm = make_tenant("calm")
    add_person(calm, "olga")
    burn(calm, NOON - timedelta(hours=3), 3, 200)
    counter(calm, "tenant", "d2026-12-01", limit=10_000, used=3_000)  # forecast 5,200: 52 %
    assert check_forecasts([calm.pk], engine=at(NOON)) == []
    assert not ForecastAlert.objects.exists() and mail.outbox == []
    Tenant.objects.filter(pk=calm.pk).update(forecast_threshold_percent=50)
    [warning] = check_forecasts([calm.pk], engine=at(NOON))
    assert (warning.threshold, warning.scope.forecast.percent) == (50, 52.0)


def test_a_quota_used_up_gets_no_forecast_warning() -> None:
    acme = make_tenant("full")
    burn(acme, NOON - timedelta(hours=3), 3, 400)
    counter(acme, "tenant", "d2026-12-01", limit=10_000, used=10_000)
    assert check_forecasts([acme.pk], engine=at(NOON)) == []


def test_idle_tenants_cost_no_ledger_query() -> None:
    """A tenant with no counter in its current windows (nothing reserved today) is skipped
    before its history is read."""
    idle = make_tenant("idle")
    burn(idle, NOON - timedelta(days=1, hours=3), 3, 4_000)  # yesterday's burst
    with CaptureQueriesContext(connection) as queries:
        assert check_forecasts([idle.pk], engine=at(NOON)) == []
    assert not _ledger_queries(queries)
    assert not [q for q in queries.captured_queries
                if ForecastAlert._meta.db_table in q["sql"]]
    assert scope_forecasts(idle, engine=at(NOON), active_only=True) == []


def test_the_beat_runs_the_check_for_every_tenant_with_a_threshold(settings: Any) -> None:
    """The beat entry, and the task on the live clock: a tenant at 90 % of its day is forecast
    at 90 % or more whatever the hour, so it is warned once."""
    from billing.tasks import check_quota_forecasts
    from config.celery import app
    from quotas.engine import ReserveRequest, ScopeLimit
    from quotas.windows import WindowKind

    entry = settings.CELERY_BEAT_SCHEDULE["check-quota-forecasts"]
    assert entry == {"task": "billing.tasks.check_quota_forecasts",
                     "schedule": settings.TOLLGATE_FORECAST_INTERVAL_SECONDS}
    assert entry["task"] in app.tasks
    live = create_tenant("live", plan_name="standard", actor="test", tokens_per_day=10_000)
    add_person(live, "olga")
    engine = get_engine()
    hold = engine.reserve(ReserveRequest(tenant_tag(live.pk), "live-1", 9_000,
                                         (ScopeLimit("tenant", WindowKind.DAY, 10_000),))).hold
    engine.settle(hold, 9_000)
    assert check_quota_forecasts() == 1
    assert check_quota_forecasts() == 0
    [message] = mail.outbox
    assert "live" in message.subject and "forecast" in message.subject


@pytest.mark.cluster
def test_forecast_warnings_on_a_redis_cluster(redis_cluster_url: str) -> None:
    """The counters read in one pipelined round trip from the tenant's slot of a 3-node
    Cluster: the same warning, once."""
    import redis

    cluster = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    try:
        acme, _ = busy_tenant("clustered", client=cluster)
        [warning] = check_forecasts([acme.pk], engine=at(NOON, cluster))
        assert (warning.scope.who, warning.scope.forecast.tokens) == ("tenant", 10_400)
        assert check_forecasts([acme.pk], engine=at(NOON, cluster)) == []
        assert ForecastAlert.objects.filter(tenant=acme).count() == 1
    finally:
        cluster.close()
