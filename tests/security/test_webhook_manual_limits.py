"""A tenant cannot clog the shared `webhooks` queue with test events and redeliveries.

One unfinished test event per endpoint (a second is a 409 / a console message), no redelivery
of a delivery still pending (the same), and at most TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX pending
manual deliveries per tenant (429 with Retry-After). A refusal writes nothing and queues
nothing. The checks hold under concurrency: two requests racing cannot both queue (a lock on the
tenant's row; the race tests hold the first request inside its transaction until the second is
seen waiting for that lock in pg_stat_activity, or has finished without waiting). The race
tests commit their data (each thread has its own connection), so they are `e2e` (run last) and
remove their tenant afterwards.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, connections
from django.urls import reverse

from billing import webhooks
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.webhooks import create_endpoint
from tenants.models import AuditEvent, Tenant
from tests.gateway.conftest import committed
from tests.support.celery_queue import run_queued_deliveries
from tests.world import World

URL = "http://127.0.0.1:9/hook"  # never contacted: nothing here runs a worker against it


@pytest.fixture(autouse=True)
def _private_targets(settings: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    settings.TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX = 3


def _api(world: World, endpoint: WebhookEndpoint) -> str:
    return f"/api/tenants/{world.acme.public_id}/webhooks/{endpoint.public_id}/"


def _failed(endpoint: WebhookEndpoint) -> WebhookDelivery:
    """An automatic delivery that has given up (redeliverable)."""
    delivery = webhooks.create_test_event(endpoint)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(status="failed", attempts=6,
                                                          next_attempt_at=None)
    delivery.refresh_from_db()
    return delivery


def _snapshot() -> tuple[list[tuple[Any, ...]], int]:
    rows = list(WebhookDelivery.objects.order_by("pk").values_list(
        "pk", "status", "attempts", "next_attempt_at", "manual"))
    return rows, AuditEvent.objects.count()


@pytest.fixture
def endpoint(world: World) -> WebhookEndpoint:
    return create_endpoint(world.acme, URL, ["test"], actor="test")[0]


# -- one test event per endpoint ------------------------------------------------------------------


def test_api_second_test_event_while_one_is_pending_is_a_409_and_writes_nothing(
        world: World, endpoint: WebhookEndpoint, django_capture_on_commit_callbacks: Any) -> None:
    owner = world.client(world.owner)
    with django_capture_on_commit_callbacks(execute=True) as queued:
        first = owner.post(f"{_api(world, endpoint)}test")
    assert first.status_code == 202 and len(queued) == 1
    before = _snapshot()
    with django_capture_on_commit_callbacks(execute=True) as queued:
        second = owner.post(f"{_api(world, endpoint)}test")
    assert second.status_code == 409 and queued == []
    assert second.json() == {"detail": "a test event to this endpoint is already pending: its "
                                       "result shows in the delivery log"}
    assert _snapshot() == before
    # Once the worker has made its one attempt (failed: nothing listens), a new one is allowed.
    pk = WebhookDelivery.objects.get(public_id=first.json()["id"]).pk
    assert run_queued_deliveries({pk}) == ["failed"]
    with django_capture_on_commit_callbacks(execute=True) as queued:
        third = owner.post(f"{_api(world, endpoint)}test")
    assert third.status_code == 202 and len(queued) == 1
    assert WebhookDelivery.objects.filter(endpoint=endpoint, event_type="test").count() == 2


def test_console_second_test_event_while_one_is_pending_is_refused_with_a_message(
        world: World, endpoint: WebhookEndpoint) -> None:
    client = world.client(world.owner)
    url = reverse("console-webhook-test", args=[world.acme.public_id, endpoint.public_id])
    assert client.post(url).status_code == 302
    before = _snapshot()
    response = client.post(url, follow=True)
    assert response.status_code == 200 and _snapshot() == before
    assert ("Nothing queued: a test event to this endpoint is already pending: its result shows "
            "in the delivery log.") in response.content.decode()


# -- no redelivery of a pending delivery ----------------------------------------------------------


def test_redelivery_of_a_pending_delivery_is_refused_in_the_api_and_the_console(
        world: World, endpoint: WebhookEndpoint) -> None:
    pending = webhooks.create_deliveries(world.acme, "test", webhooks.event_payload(
        "test", world.acme))[0]
    owner = world.client(world.owner)
    before = _snapshot()
    api = owner.post(f"{_api(world, endpoint)}deliveries/{pending.public_id}/redeliver")
    assert api.status_code == 409
    assert api.json() == {"detail": f"delivery {pending.public_id} is already pending: its next "
                                    "attempt is queued or scheduled"}
    console = owner.post(reverse("console-webhook-redeliver", args=[
        world.acme.public_id, endpoint.public_id, pending.public_id]), follow=True)
    assert f"Nothing queued: delivery {pending.public_id} is already pending" in (
        console.content.decode())
    assert _snapshot() == before


def test_a_redelivery_once_queued_cannot_be_queued_again(
        world: World, endpoint: WebhookEndpoint) -> None:
    failed = _failed(endpoint)
    url = f"{_api(world, endpoint)}deliveries/{failed.public_id}/redeliver"
    owner = world.client(world.owner)
    assert owner.post(url).status_code == 202
    assert owner.post(url).status_code == 409
    assert AuditEvent.objects.filter(action="webhook.redelivered").count() == 1


# -- the tenant's cap -----------------------------------------------------------------------------


def test_past_the_tenants_cap_a_manual_delivery_is_a_429_with_retry_after(
        world: World, django_capture_on_commit_callbacks: Any) -> None:
    owner = world.client(world.owner)
    endpoints = [create_endpoint(world.acme, URL, ["test"], actor="test")[0] for _ in range(4)]
    for endpoint in endpoints[:2]:
        assert owner.post(f"{_api(world, endpoint)}test").status_code == 202
    failed = _failed(endpoints[2])
    redeliver = f"{_api(world, endpoints[2])}deliveries/{failed.public_id}/redeliver"
    assert owner.post(redeliver).status_code == 202  # the third: at the cap (3)
    another_failed = _failed(endpoints[3])
    for url in (f"{_api(world, endpoints[3])}test",
                f"{_api(world, endpoints[3])}deliveries/{another_failed.public_id}/redeliver"):
        before = _snapshot()
        with django_capture_on_commit_callbacks(execute=True) as queued:
            refused = owner.post(url)
        assert refused.status_code == 429 and queued == []
        assert refused.json() == {"detail": (
            "this tenant already has 3 test events or redeliveries pending "
            "(TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX); try again when one has finished")}
        # Due now: one total deadline (10 s) and a second of rounding.
        assert refused["Retry-After"] == "11"
        assert _snapshot() == before
    console = owner.post(reverse("console-webhook-test", args=[
        world.acme.public_id, endpoints[3].public_id]), follow=True)
    assert "Nothing queued: this tenant already has 3 test events" in console.content.decode()
    # Another tenant's endpoints are not affected.
    theirs = create_endpoint(world.globex, URL, ["test"], actor="test")[0]
    assert world.client(world.outsider).post(
        f"/api/tenants/{world.globex.public_id}/webhooks/{theirs.public_id}/test"
    ).status_code == 202
    # A finished one frees its place.
    WebhookDelivery.objects.filter(endpoint=endpoints[0]).update(status="delivered")
    assert owner.post(f"{_api(world, endpoints[3])}test").status_code == 202


def test_automatic_deliveries_do_not_count_against_the_cap(world: World) -> None:
    endpoints = [create_endpoint(world.acme, URL, ["test"], actor="test")[0] for _ in range(4)]
    for _ in range(5):  # threshold-style deliveries the tenant did not ask for by hand
        webhooks.create_deliveries(world.acme, "test", webhooks.event_payload("test", world.acme))
    for endpoint in endpoints[:3]:
        webhooks.request_test_event(endpoint, actor="test")
    with pytest.raises(webhooks.TooManyManualDeliveries):
        webhooks.request_test_event(endpoints[3], actor="test")


# -- races: two requests at once cannot both queue --------------------------------------------------


def _waiting_for_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        # Activity is read once per transaction unless the snapshot is dropped.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


def _race(first: Callable[[], Any], second: Callable[[], Any],
          monkeypatch: pytest.MonkeyPatch, django_db_blocker: Any) -> list[str]:
    """Run `first` on one thread and hold it after its checks, inside its transaction (at the
    audit record), until `second` (on another thread) waits for a lock or has finished; then
    let it go. Each call's outcome: "queued" or the refusal's class name."""
    outcomes: dict[str, str] = {}
    second_pid: list[int] = []
    first_checked = threading.Event()
    real_audit = webhooks.record_audit_event

    def held_audit(**kwargs: Any) -> Any:
        if threading.current_thread().name == "first":
            first_checked.set()
            deadline = time.monotonic() + 10
            while (time.monotonic() < deadline and "second" not in outcomes
                   and not (second_pid and _waiting_for_a_lock(second_pid[0]))):
                time.sleep(0.02)
        return real_audit(**kwargs)

    monkeypatch.setattr(webhooks, "record_audit_event", held_audit)

    def run(name: str, call: Callable[[], Any]) -> None:
        try:
            if name == "second":
                first_checked.wait(10)
                second_pid.append(connections["default"].cursor().connection.info.backend_pid)
            call()
            outcomes[name] = "queued"
        except webhooks.ManualDeliveryRefused as exc:
            outcomes[name] = type(exc).__name__
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(n, c), name=n)
               for n, c in (("first", first), ("second", second))]
    with django_db_blocker.unblock():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    return [outcomes.get("first", "?"), outcomes.get("second", "?")]


@pytest.fixture
def racing_tenant(django_db_blocker: Any) -> Iterator[Tenant]:
    """A tenant committed for real (the racing threads have their own connections), removed
    again afterwards with everything it owns."""
    from tenants.services import create_tenant

    tenant = committed(django_db_blocker, lambda: create_tenant(
        f"racer-{time.monotonic_ns()}", plan_name="free", actor="test"))
    yield tenant

    def remove() -> None:
        AuditEvent.objects.filter(tenant=tenant).delete()
        tenant.delete()

    committed(django_db_blocker, remove)


def _committed_endpoints(django_db_blocker: Any, tenant: Tenant, n: int) -> list[Any]:
    return committed(django_db_blocker, lambda: [
        create_endpoint(tenant, URL, ["test"], actor="test")[0] for _ in range(n)])


@pytest.mark.e2e
@pytest.mark.django_db
def test_two_concurrent_test_events_to_one_endpoint_queue_one(
        racing_tenant: Tenant, monkeypatch: pytest.MonkeyPatch, django_db_blocker: Any) -> None:
    [endpoint] = _committed_endpoints(django_db_blocker, racing_tenant, 1)

    def send() -> None:
        webhooks.request_test_event(endpoint, actor="test")

    assert _race(send, send, monkeypatch, django_db_blocker) == ["queued",
                                                                 "ManualDeliveryPending"]
    assert committed(django_db_blocker,
                     WebhookDelivery.objects.filter(endpoint=endpoint).count) == 1


@pytest.mark.e2e
@pytest.mark.django_db
def test_two_concurrent_requests_at_the_cap_queue_one(
        racing_tenant: Tenant, monkeypatch: pytest.MonkeyPatch, settings: Any,
        django_db_blocker: Any) -> None:
    settings.TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX = 1
    one, two = _committed_endpoints(django_db_blocker, racing_tenant, 2)
    failed = committed(django_db_blocker, lambda: _failed(two))

    def test_event() -> None:
        webhooks.request_test_event(one, actor="test")

    def redelivery() -> None:
        webhooks.request_redelivery(failed, actor="test")

    assert _race(test_event, redelivery, monkeypatch, django_db_blocker) == [
        "queued", "TooManyManualDeliveries"]
    assert committed(django_db_blocker, WebhookDelivery.objects.filter(
        endpoint__tenant=racing_tenant, manual=True, status="pending").count) == 1
