"""Webhook endpoints and deliveries against a real HTTP receiver on loopback (so these tests turn
TOLLGATE_WEBHOOK_ALLOW_PRIVATE on), and the SSRF guard with it off."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from billing import webhooks
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.webhooks import (
    WebhookUrlRefused,
    create_endpoint,
    deliver,
    redeliver,
    send_test_event,
    verify_signature,
)
from tenants.models import AuditEvent, Tenant
from tenants.services import create_tenant
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def allow_private(settings: Any) -> Any:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    return settings


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def new_delivery(endpoint: WebhookEndpoint, **payload: Any) -> WebhookDelivery:
    body = webhooks.event_payload("quota.threshold", endpoint.tenant, scope="tenant",
                                  window="d2026-11-30", limit=1000, used=900, pending=0,
                                  remaining=100, threshold=10, **payload)
    [delivery] = webhooks.create_deliveries(endpoint.tenant, "quota.threshold", body)
    return delivery


# -- endpoints ----------------------------------------------------------------------------------


def test_the_secret_is_shown_once_stored_encrypted_and_never_audited(
        allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="user:a")
    assert secret.startswith("whsec_") and len(secret) > 40
    stored = WebhookEndpoint.objects.get(pk=endpoint.pk)
    assert stored.public_id.startswith("whk_")
    assert secret not in stored.secret_encrypted and stored.secret == secret
    event = AuditEvent.objects.get(action="webhook.created", target=endpoint.public_id)
    assert event.tenant_id == acme.pk and event.actor == "user:a"
    # Members read the audit log: it names the URL masked (an address literal: no host).
    assert event.data == {"url": "http://…/…", "events": ["quota.threshold"]}
    assert secret not in json.dumps(event.data) and stored.secret_encrypted not in json.dumps(
        event.data)


def test_unknown_events_are_refused(allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    with pytest.raises(ValueError, match="unknown webhook event"):
        create_endpoint(acme, receiver.url, ["quota.threshold", "quota.nope"], actor="t")


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8080/hook",
    "http://10.0.0.1/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://localhost:9000/hook",
    "http://0.0.0.0/hook",
    "http://192.168.1.10/hook",
    "http://100.64.0.1/hook",
    "http://224.0.0.1/hook",
    "http://240.0.0.1/hook",
])
def test_private_loopback_link_local_and_reserved_addresses_are_refused(
        settings: Any, acme: Tenant, url: str) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(WebhookUrlRefused):
        create_endpoint(acme, url, ["quota.threshold"], actor="t")
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize("url", ["ftp://8.8.8.8/x", "https://user:pw@8.8.8.8/x", "https:///x",
                                 "http://8.8.8.8:99999/x", "not a url"])
def test_malformed_urls_are_refused(acme: Tenant, url: str) -> None:
    with pytest.raises(WebhookUrlRefused):
        create_endpoint(acme, url, ["quota.threshold"], actor="t")


def test_a_public_address_is_accepted_without_the_setting(settings: Any, acme: Tenant) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    endpoint, _ = create_endpoint(acme, "https://8.8.8.8/hook", ["quota.threshold"], actor="t")
    assert endpoint.url == "https://8.8.8.8/hook"


def test_the_address_is_checked_again_at_delivery_time(
        allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    allow_private.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    delivery = deliver(new_delivery(endpoint).pk)
    assert receiver.requests == []
    assert delivery.status == "pending" and delivery.attempts == 1
    assert delivery.last_status_code is None and delivery.last_error.startswith("refused:")


def test_dns_rebinding_between_check_and_delivery_is_refused(
        settings: Any, monkeypatch: pytest.MonkeyPatch, acme: Tenant) -> None:
    """Fault injected: a DNS answer that turns private after the endpoint was created."""
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    answer = ["93.184.216.34"]
    real = socket.getaddrinfo

    def fake(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hooks.example.test":
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer[0], port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    endpoint, _ = create_endpoint(acme, "https://hooks.example.test:8443/t?x=1",
                                  ["quota.threshold"], actor="t")
    # The connection goes to the address just checked; name kept for Host and TLS (SNI).
    url, headers, extensions = webhooks.pinned_request(endpoint.url)
    assert url == "https://93.184.216.34:8443/t?x=1"
    assert headers == {"Host": "hooks.example.test:8443"}
    assert extensions == {"sni_hostname": "hooks.example.test"}
    answer[0] = "127.0.0.1"
    with pytest.raises(WebhookUrlRefused):
        webhooks.pinned_request(endpoint.url)
    delivery = deliver(new_delivery(endpoint).pk)
    assert delivery.last_error.startswith("refused:")


# -- signatures ---------------------------------------------------------------------------------


def test_verify_signature_accepts_only_the_exact_body_secret_and_a_fresh_timestamp() -> None:
    body = b'{"id":"evt_1","type":"test"}'
    ts = int(time.time())
    header = webhooks.sign("whsec_abc", ts, body)
    assert header.startswith("v1=") and len(header) == 3 + 64
    assert verify_signature("whsec_abc", str(ts), body, header)
    assert verify_signature("whsec_abc", ts, body.decode(), header)
    assert verify_signature("whsec_abc", ts, body, f"v1=deadbeef, {header}")  # rotation
    assert not verify_signature("whsec_abd", ts, body, header)
    assert not verify_signature("whsec_abc", ts, body + b" ", header)
    assert not verify_signature("whsec_abc", ts + 1, body, header)
    assert not verify_signature("whsec_abc", "soon", body, header)
    assert not verify_signature("whsec_abc", ts, body, "")
    assert not verify_signature("whsec_abc", ts, body, header, now=ts + 301)
    assert verify_signature("whsec_abc", ts, body, header, now=ts + 299)
    assert not verify_signature("whsec_abc", ts, body, header, tolerance_s=10, now=ts - 11)


# -- deliveries ---------------------------------------------------------------------------------


def test_a_delivery_is_signed_and_logged(allow_private: Any, receiver: Receiver,
                                         acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    delivery = deliver(new_delivery(endpoint).pk)
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 1, 200)
    assert delivery.delivered_at is not None and delivery.next_attempt_at is None
    [request] = receiver.requests
    headers = request["headers"]
    assert request["path"] == "/hooks/tollgate"
    assert headers["Content-Type"] == "application/json"
    assert headers["Tollgate-Event"] == "quota.threshold"
    assert verify_signature(secret, headers["Tollgate-Timestamp"], request["body"],
                            headers["Tollgate-Signature"])
    payload = json.loads(request["body"])
    assert payload == delivery.payload
    assert set(payload) == {"id", "type", "created", "tenant", "scope", "window", "limit", "used",
                            "pending", "remaining", "threshold"}
    assert payload["id"].startswith("evt_") and payload["tenant"] == "acme"
    # Idempotent: a delivered delivery is never sent again by the task.
    assert deliver(delivery.pk).attempts == 1 and len(receiver.requests) == 1


def test_a_failed_attempt_is_retried_after_its_backoff(allow_private: Any, acme: Tenant) -> None:
    with Receiver([500, 200]) as receiver:
        endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        before = timezone.now()
        delivery = deliver(new_delivery(endpoint).pk)
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == (
            "pending", 1, 500)
        assert delivery.last_error == "HTTP 500"
        wait = delivery.next_attempt_at - before
        assert timedelta(seconds=10) <= wait < timedelta(seconds=12)
        # Not due yet: nothing is sent.
        assert deliver(delivery.pk).attempts == 1 and len(receiver.requests) == 1
        assert delivery.pk not in webhooks.due_delivery_ids()
        WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now())
        assert delivery.pk in webhooks.due_delivery_ids()
        delivery = deliver(delivery.pk)
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == (
            "delivered", 2, 200)
        assert delivery.last_error == ""
        first, second = receiver.requests
        assert first["body"] == second["body"]  # same event id on the retry


def test_the_backoff_grows_and_delivery_gives_up_after_the_last_attempt(
        allow_private: Any, acme: Tenant) -> None:
    assert [webhooks.backoff_s(n) for n in range(1, 7)] == [10, 30, 120, 600, 3600, 3600]
    allow_private.TOLLGATE_WEBHOOK_BACKOFF_SECONDS = [0]
    allow_private.TOLLGATE_WEBHOOK_MAX_ATTEMPTS = 3
    with Receiver([503]) as receiver:
        endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        delivery = new_delivery(endpoint)
        statuses = [deliver(delivery.pk).status for _ in range(4)]
        assert statuses == ["pending", "pending", "failed", "failed"]
        assert len(receiver.requests) == 3
        delivery.refresh_from_db()
        assert (delivery.attempts, delivery.last_status_code, delivery.next_attempt_at) == (
            3, 503, None)


def test_a_slow_receiver_times_out(allow_private: Any, acme: Tenant) -> None:
    allow_private.TOLLGATE_WEBHOOK_TIMEOUT_SECONDS = 0.3
    with Receiver([200], delay=2) as receiver:
        endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        started = time.monotonic()
        delivery = deliver(new_delivery(endpoint).pk)
        assert time.monotonic() - started < 1.5
    assert delivery.status == "pending" and delivery.last_status_code is None
    assert "Timeout" in delivery.last_error


def test_a_redirect_is_not_followed(allow_private: Any, acme: Tenant) -> None:
    with Receiver([302]) as receiver:
        endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        delivery = deliver(new_delivery(endpoint).pk)
    assert (delivery.status, delivery.last_status_code, len(receiver.requests)) == (
        "pending", 302, 1)


def test_unreachable_receiver_is_a_failed_attempt(allow_private: Any, acme: Tenant) -> None:
    with Receiver() as receiver:
        url = receiver.url
    endpoint, _ = create_endpoint(acme, url, ["quota.threshold"], actor="t")
    delivery = deliver(new_delivery(endpoint).pk)
    assert delivery.status == "pending" and "ConnectError" in delivery.last_error


def test_manual_redelivery_sends_the_same_event_again_now(
        allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    delivery = deliver(new_delivery(endpoint).pk)
    again = redeliver(delivery)
    assert (again.status, again.attempts) == ("delivered", 2)
    first, second = receiver.requests
    assert first["body"] == second["body"]
    assert verify_signature(secret, second["headers"]["Tollgate-Timestamp"], second["body"],
                            second["headers"]["Tollgate-Signature"])


def test_manual_redelivery_of_a_failed_delivery(allow_private: Any, acme: Tenant) -> None:
    allow_private.TOLLGATE_WEBHOOK_MAX_ATTEMPTS = 1
    with Receiver([500, 200]) as receiver:
        endpoint, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        delivery = deliver(new_delivery(endpoint).pk)
        assert delivery.status == "failed"
        again = redeliver(delivery)
    assert (again.status, again.attempts, again.last_status_code) == ("delivered", 2, 200)


def test_send_test_event(allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    delivery = send_test_event(endpoint)
    assert (delivery.event_type, delivery.status) == ("test", "delivered")
    [request] = receiver.requests
    assert json.loads(request["body"])["type"] == "test"
    assert request["headers"]["Tollgate-Event"] == "test"


def test_deliveries_go_to_enabled_endpoints_subscribed_to_the_event(
        allow_private: Any, receiver: Receiver, acme: Tenant) -> None:
    both, _ = create_endpoint(acme, receiver.url, ["quota.threshold", "quota.exhausted"],
                              actor="t")
    create_endpoint(acme, receiver.url, ["quota.exhausted"], actor="t")
    off, _ = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    WebhookEndpoint.objects.filter(pk=off.pk).update(enabled=False)
    other = create_tenant("other", plan_name="free", actor="t")
    create_endpoint(other, receiver.url, ["quota.threshold"], actor="t")
    made = webhooks.create_deliveries(acme, "quota.threshold", {"id": "evt_x"})
    assert [d.endpoint_id for d in made] == [both.pk]
    assert made[0].next_attempt_at is not None and made[0].pk in webhooks.due_delivery_ids()


@pytest.mark.e2e
def test_concurrent_workers_send_each_attempt_once(
        allow_private: Any, receiver: Receiver, django_db_blocker: Any) -> None:
    """Eight workers run the same delivery at once: exactly one POST, one attempt."""
    from django.db import connection

    from tests.gateway.conftest import committed

    receiver.delay = 0.2

    def setup() -> int:
        tenant = create_tenant(f"whk-race-{time.monotonic_ns()}", plan_name="free", actor="t")
        endpoint, _ = create_endpoint(tenant, receiver.url, ["quota.threshold"], actor="t")
        return new_delivery(endpoint).pk

    delivery_id = committed(django_db_blocker, setup)
    barrier = threading.Barrier(8)

    def worker() -> str:
        try:
            barrier.wait()
            return deliver(delivery_id).status
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: worker(), range(8)))
        final = committed(django_db_blocker, lambda: WebhookDelivery.objects.get(pk=delivery_id))
    assert len(receiver.requests) == 1
    assert (final.status, final.attempts) == ("delivered", 1)
    assert "delivered" in statuses
