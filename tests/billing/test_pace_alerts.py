"""The burn-rate breaker's announcements (billing/alerts.py check_pace_trips): one
`breaker.tripped` webhook per endpoint and one owners' email per trip, even with detectors racing;
and the resume service (quotas/pace.py resume_trip), audited."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail

from billing.alerts import TripAlert, check_thresholds
from billing.models import PaceTrip, WebhookDelivery
from billing.webhooks import create_endpoint
from quotas.keys import tenant_tag
from quotas.limits import SPEND_RATE_EXCEEDED, pace_counters
from quotas.pace import PaceBreaker, PaceLimit, resume_trip, tenant_trips
from quotas.runtime import get_engine
from tenants.models import AuditEvent, Membership, Tenant
from tenants.selectors import effective_limits
from tenants.services import create_project, create_tenant, issue_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def allow_private(settings: Any) -> Any:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    return settings


def paced_tenant(slug: str) -> tuple[Tenant, PaceLimit]:
    """A tenant whose project has a 1,000,000-token day and 25% per 10 minutes, with an owner."""
    tenant = create_tenant(slug, plan_name="free", actor="test", tokens_per_day=-1,
                           pace_share_percent=25, pace_period_seconds=600,
                           pace_cooldown_seconds=1800)
    tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
    project = create_project(tenant, "web", actor="test", tokens_per_day=1_000_000)
    api_key = issue_key(project, actor="test", name="ci").api_key
    user = get_user_model().objects.create_user(f"owner-{slug}", email=f"owner@{slug}.test")
    Membership.objects.create(user=user, tenant=tenant, role="owner")
    [counter] = pace_counters(tenant, effective_limits(tenant), project, api_key)
    assert isinstance(counter.scope_limit, PaceLimit)
    return tenant, counter.scope_limit


def trip(tenant: Tenant, limit: PaceLimit) -> int:
    breaker = PaceBreaker(get_engine().client)
    result = breaker.trip(tenant_tag(tenant.pk), [limit], breaker.now_ms())
    assert result.first
    return result.tripped_ms


def test_the_project_pace_counter_is_a_share_of_its_day(allow_private: Any) -> None:
    _, limit = paced_tenant("share")
    assert (limit.limit, limit.reason, limit.cooldown_s, limit.queueable) == (
        250_000, SPEND_RATE_EXCEEDED, 1800, False)
    assert limit.window.pace_seconds == 600 and limit.label == "web"
    assert limit.rule == "25% of 1,000,000 tokens a day = 250,000 tokens per 600 s"


def test_a_trip_is_announced_once_by_webhook_and_email(allow_private: Any) -> None:
    tenant, limit = paced_tenant("acme")
    endpoint, _ = create_endpoint(tenant, "http://127.0.0.1:9/hook", ["breaker.tripped"],
                                  actor="t")
    tripped_ms = trip(tenant, limit)
    [alert] = check_thresholds([tenant.pk])
    assert isinstance(alert, TripAlert) and alert.who == "project:web"
    assert check_thresholds([tenant.pk]) == []
    row = PaceTrip.objects.get(tenant=tenant)
    assert (row.scope, row.tripped_ms, row.label) == (limit.scope, tripped_ms, "web")
    [delivery] = WebhookDelivery.objects.filter(endpoint=endpoint)
    assert delivery.event_type == "breaker.tripped"
    assert delivery.payload["scope"] == "project:web"
    assert delivery.payload["rules"] == [limit.rule]
    assert [m.to for m in mail.outbox] == [["owner@acme.test"]]
    assert "project:web paused" in mail.outbox[0].subject


def test_resume_is_audited_and_lifts_the_trip_once(allow_private: Any) -> None:
    tenant, limit = paced_tenant("resume")
    trip(tenant, limit)
    trips, now_ms = tenant_trips(tenant)
    assert [t.scope for t in trips if t.active(now_ms)] == [limit.scope]
    lifted = resume_trip(tenant, limit.scope, actor="user:alice")
    assert lifted is not None
    assert resume_trip(tenant, limit.scope, actor="user:bob") is None
    [event] = AuditEvent.objects.filter(tenant=tenant, action="pace.resumed")
    assert (event.actor, event.target, event.data["scope"]) == (
        "user:alice", limit.owner, limit.scope)
    trips, now_ms = tenant_trips(tenant)
    assert not any(t.active(now_ms) for t in trips)
    assert trips[0].resumed_by == "user:alice"
    # A resumed trip is still announced once (it happened).
    assert len(check_thresholds([tenant.pk])) == 1


@pytest.mark.e2e
def test_detectors_racing_announce_a_trip_exactly_once(allow_private: Any,
                                                       django_db_blocker: Any) -> None:
    from django.db import connection

    from tests.gateway.conftest import committed

    slug = f"pace-race-{os.getpid()}-{time.monotonic_ns()}"

    def setup() -> tuple[int, list[int], PaceLimit]:
        tenant, limit = paced_tenant(slug)
        endpoints = [create_endpoint(tenant, "http://127.0.0.1:9/hook", ["breaker.tripped"],
                                     actor="t")[0].pk for _ in range(2)]
        return tenant.pk, endpoints, limit

    tenant_id, endpoint_ids, limit = committed(django_db_blocker, setup)
    trip(Tenant(pk=tenant_id, slug=slug), limit)
    start = threading.Barrier(12)

    def detect() -> int:
        try:
            start.wait()
            return sum(isinstance(a, TripAlert) for a in check_thresholds([tenant_id]))
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(12) as pool:
        fired = sum(pool.map(lambda _: detect(), range(12)))
    assert fired == 1

    def outcome() -> tuple[int, list[int]]:
        rows = PaceTrip.objects.filter(tenant_id=tenant_id).count()
        per = sorted(WebhookDelivery.objects.filter(endpoint_id__in=endpoint_ids)
                     .values_list("endpoint_id", flat=True))
        Tenant.objects.filter(pk=tenant_id).delete()  # committed: leave no tenant behind
        return rows, per

    rows, per_endpoint = committed(django_db_blocker, outcome)
    assert rows == 1 and per_endpoint == sorted(endpoint_ids)
    assert len([m for m in mail.outbox if m.to == [f"owner@{slug}.test"]]) == 1
