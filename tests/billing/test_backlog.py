"""Nothing trimmed before it is drained: usage events wait in Redis for as long as PostgreSQL is
down, the backlog shows on /metrics and alerts operators once, and every event then lands in the
ledger exactly once."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core import mail
from django.db import OperationalError
from django.db.models import Count

from billing import ledger, metrics
from billing.alerts import check_ledger_backlog
from billing.ledger import drain_all, usage_backlog
from billing.models import UsageRecord
from billing.tasks import drain_usage
from quotas import active, keys
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from tenants.models import Tenant
from tenants.services import create_project, create_tenant
from tests.support.prometheus import samples

pytestmark = pytest.mark.django_db

EVENTS = 100_000
AGE_S = 3600  # how old the first buffered event is (the outage began an hour ago)


@pytest.fixture
def client() -> redis.Redis:
    return get_engine().client


@pytest.fixture
def admins(settings: Any) -> Any:
    settings.ADMINS = [("Ops", "ops@tollgate.test")]
    settings.TOLLGATE_LEDGER_BACKLOG_ALERT_SECONDS = 300
    return settings


def buffer_events(client: redis.Redis, tenant: Tenant, count: int, *, age_s: int) -> str:
    """`count` settle events as lua/settle.lua writes them, XADDed in pipelines, the first
    `age_s` seconds old (explicit ids: the id's milliseconds are the event's Redis time)."""
    project = create_project(tenant, "web", actor="test")
    stream = keys.usage_stream_key(tenant_tag(tenant.pk))
    seconds, micros = client.time()
    start_ms = int(seconds) * 1000 + int(micros) // 1000 - age_s * 1000
    meta = json.dumps({"p": project.pk, "m": "gpt-4o", "served": "gpt-4o",
                       "ep": "chat/completions"})
    event = json.dumps({"in": 100, "out": 50, "st": 200, "lat": 12, "outcome": "complete",
                        "pk": None, "stream": False, "soft": False})
    per_ms = 1000  # events per millisecond of ids, so they all stay in the past
    for first in range(0, count, 10_000):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + 10_000, count)):
            ms = start_ms + i // per_ms
            pipe.xadd(stream, {
                "request_id": f"buffered-{i}", "outcome": "settled", "held": 1000,
                "actual": 150, "money": 750, "created": ms - 900, "ended": ms, "meta": meta,
                "event": event}, id=f"{ms}-{i % per_ms}")
        pipe.execute()
    # The engine that runs the scripts marks the tenant for the jobs (quotas/active.py); these
    # events are written as the scripts write them, so the tenant is marked too.
    active.mark(client, [tenant_tag(tenant.pk)])
    return stream


class _XdelFailsOnce:
    """The drain's Redis client, but the first XDEL fails: a worker that died after its commit
    and before deleting the batch, which is therefore delivered again."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def xdel(self, *args: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise redis.ConnectionError("connection lost after the commit")
        return self._client.xdel(*args)


@pytest.fixture
def cleanup(client: redis.Redis) -> Iterator[list[str]]:
    """Keys to delete after the test, whatever its outcome: an hour-old stream left behind
    would be the oldest backlog of every later test that looks."""
    created: list[str] = [keys.ledger_backlog_alert_key()]
    yield created
    client.delete(*created)


def test_a_hundred_thousand_events_wait_out_an_outage_then_land_exactly_once(
        client: redis.Redis, admins: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, cleanup: list[str]) -> None:
    acme = create_tenant("acme", plan_name="free", actor="test")
    stream = buffer_events(client, acme, EVENTS, age_s=AGE_S)
    cleanup.append(stream)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection to server failed: Connection refused")

    with monkeypatch.context() as outage:
        # The drain's insert (billing.rollups.insert_records: the rows and their rollup).
        outage.setattr(ledger, "insert_records", refuse)
        for _ in range(3):  # the beat keeps trying; every run fails, nothing is deleted
            with pytest.raises(OperationalError):
                drain_usage()
        assert client.xlen(stream) == EVENTS

        got = samples(metrics.render(client))
        assert got["tollgate_usage_backlog_events"] == EVENTS
        assert got["tollgate_usage_backlog_oldest_seconds"] >= AGE_S
        with caplog.at_level(logging.ERROR, logger="billing.alerts"):
            alert = check_ledger_backlog()
        assert alert is not None and alert.events == EVENTS and alert.oldest_stream == stream
        assert any("ledger backlog" in r.getMessage() for r in caplog.records)
        [message] = mail.outbox
        assert message.to == ["ops@tollgate.test"] and "Ledger drain behind" in message.subject
        assert check_ledger_backlog() is None  # once per episode, not every minute
        assert len(mail.outbox) == 1

    # PostgreSQL is back; the first batch's XDEL is lost, so that batch comes again.
    flaky = _XdelFailsOnce(client)
    with pytest.raises(redis.ConnectionError):
        drain_all(flaky)
    assert flaky.failed
    moved = 0
    while True:
        step = drain_all(client).events
        if not step:
            break
        moved += step
    assert moved == EVENTS  # the redelivered batch is read again, and inserts nothing twice
    counts = UsageRecord.objects.filter(tenant=acme).aggregate(
        rows=Count("pk"), ids=Count("request_id", distinct=True))
    assert counts == {"rows": EVENTS, "ids": EVENTS}
    assert client.xlen(stream) == 0

    got = samples(metrics.render(client))
    assert got["tollgate_usage_backlog_events"] == 0
    assert got["tollgate_usage_backlog_oldest_seconds"] == 0
    # The episode is over; the next one alerts again.
    assert check_ledger_backlog() is None and client.get(keys.ledger_backlog_alert_key()) is None


def test_backlog_is_measured_while_postgresql_is_unreadable(
        client: redis.Redis, admins: Any, monkeypatch: pytest.MonkeyPatch,
        cleanup: list[str]) -> None:
    """The tenants come from PostgreSQL; when that fails the streams are found in Redis, so the
    gauge and the alert work during the very outage they are about."""
    acme = create_tenant("acme", plan_name="free", actor="test")
    stream = buffer_events(client, acme, 50, age_s=10 * 86400)  # older than any other stream
    cleanup.append(stream)

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection to server failed: Connection refused")

    monkeypatch.setattr(Tenant.objects, "order_by", unreachable)
    backlog = usage_backlog(client)
    assert backlog.oldest_stream == stream and backlog.oldest_age_s >= 10 * 86400
    assert backlog.events >= 50  # every tenant stream in this Redis, this one included
    assert usage_backlog(client, [stream]).events == 50

    # Every query of PostgreSQL's families fails (the first, the ledger's sums, is made to;
    # which tenant query the open holds make depends on the index's state).
    monkeypatch.setattr(metrics, "_ledger_sums", unreachable)
    text = metrics.render(client)
    assert "tollgate_usage_records_total" not in text  # PostgreSQL's families are left out
    assert samples(text)["tollgate_usage_backlog_events"] == backlog.events
    alert = check_ledger_backlog()
    assert alert is not None and alert.oldest_stream == stream
    assert len(mail.outbox) == 1
