"""Webhook endpoints through the management API: the secret once, SSRF refusals as field
errors that write nothing, updates, test sends, the delivery log and redelivery, and isolation
(owner changes, member reads, outsider and foreign ids 404)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from standardwebhooks import Webhook

from billing.models import WebhookDelivery, WebhookEndpoint
from billing.webhooks import create_endpoint, send_test_event, verify_signature
from tenants.models import AuditEvent
from tests.support.celery_queue import run_queued_deliveries
from tests.support.webhook_receiver import Receiver
from tests.world import World


@pytest.fixture
def receiver(settings: Any) -> Iterator[Receiver]:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on 127.0.0.1
    with Receiver() as r:
        yield r


def _base(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/webhooks/"


def test_create_shows_the_secret_once_and_never_again(world: World, receiver: Receiver) -> None:
    owner = world.client(world.owner)
    created = owner.post(_base(world), {"url": receiver.url, "events": ["quota.exhausted"]},
                         format="json")
    assert created.status_code == 201
    body = created.json()
    assert body["id"].startswith("whk_") and body["secret"].startswith("whsec_")
    assert body["events"] == ["quota.exhausted"] and body["enabled"] is True
    endpoint = WebhookEndpoint.objects.get(public_id=body["id"])
    assert endpoint.secret == body["secret"] and body["secret"] not in endpoint.secret_encrypted

    listed = owner.get(_base(world)).json()
    assert listed["count"] == 1 and "secret" not in listed["results"][0]
    detail = owner.get(f"{_base(world)}{body['id']}/")
    assert "secret" not in detail.json() and body["secret"] not in detail.content.decode()
    audit = AuditEvent.objects.get(action="webhook.created", target=body["id"])
    assert body["secret"] not in json.dumps(audit.data)


def test_the_secret_is_in_the_standard_format_and_verifies_a_delivery(
        world: World, receiver: Receiver) -> None:
    created = world.client(world.owner).post(_base(world), {"url": receiver.url},
                                             format="json").json()
    secret = created["secret"]
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{43}=", secret)
    assert created["previous_secret_valid_until"] is None
    send_test_event(WebhookEndpoint.objects.get(public_id=created["id"]))
    [request] = receiver.requests
    assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"


def test_rotate_secret_shows_the_new_one_once_and_keeps_the_old_one_for_the_grace(
        world: World, receiver: Receiver) -> None:
    owner = world.client(world.owner)
    old = owner.post(_base(world), {"url": receiver.url}, format="json").json()
    url = f"{_base(world)}{old['id']}/rotate-secret"
    response = owner.post(url, {"grace_seconds": 3600}, format="json")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    body = response.json()
    assert body["id"] == old["id"] and body["secret"] != old["secret"]
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{43}=", body["secret"])
    assert body["previous_secret_unusable"] is None
    until = datetime.fromisoformat(body["previous_secret_valid_until"])
    assert timedelta(minutes=59) < until - datetime.now(UTC) <= timedelta(hours=1)
    detail = owner.get(f"{_base(world)}{old['id']}/")
    assert detail.json()["previous_secret_valid_until"] == body["previous_secret_valid_until"]
    assert "secret" not in detail.json()
    assert body["secret"] not in detail.content.decode()
    assert old["secret"] not in detail.content.decode()
    audit = AuditEvent.objects.get(action="webhook.secret_rotated", target=old["id"])
    assert body["secret"] not in json.dumps(audit.data)
    assert old["secret"] not in json.dumps(audit.data)
    send_test_event(WebhookEndpoint.objects.get(public_id=old["id"]))
    [request] = receiver.requests
    for secret in (old["secret"], body["secret"]):
        assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"
    # The trailing-slash spelling works too; no grace: the old secret stops now.
    third = owner.post(f"{url}/", {}, format="json").json()
    assert third["previous_secret_valid_until"] is None


def test_rotating_a_secret_no_key_decrypts_says_its_grace_was_not_kept(
        world: World, receiver: Receiver, settings: Any) -> None:
    # Encrypted under a Fernet key since dropped from TOLLGATE_ENCRYPTION_KEYS.
    settings.TOLLGATE_ENCRYPTION_KEYS = Fernet.generate_key().decode()
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    settings.TOLLGATE_ENCRYPTION_KEYS = Fernet.generate_key().decode()
    response = world.client(world.owner).post(
        f"{_base(world)}{endpoint.public_id}/rotate-secret", {"grace_seconds": 3600},
        format="json")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    body = response.json()
    assert body["previous_secret_valid_until"] is None
    assert body["previous_secret_unusable"] == "it cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"
    send_test_event(WebhookEndpoint.objects.get(public_id=endpoint.public_id))
    [request] = receiver.requests
    assert Webhook(body["secret"]).verify(request["body"], request["headers"])["type"] == "test"


@pytest.mark.parametrize("payload", [{"grace_seconds": -1}, {"grace_seconds": 604801},
                                     {"grace_seconds": "3600"}, {"grace_seconds": None}])
def test_rotate_secret_refuses_a_bad_grace_and_changes_nothing(
        world: World, receiver: Receiver, payload: dict[str, Any]) -> None:
    endpoint, secret = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    response = world.client(world.owner).post(
        f"{_base(world)}{endpoint.public_id}/rotate-secret", payload, format="json")
    assert response.status_code == 400 and "grace_seconds" in response.json()
    endpoint.refresh_from_db()
    assert endpoint.secret == secret
    assert not AuditEvent.objects.filter(action="webhook.secret_rotated").exists()


def test_default_events_are_the_two_quota_alerts(world: World, receiver: Receiver) -> None:
    body = world.client(world.owner).post(_base(world), {"url": receiver.url},
                                          format="json").json()
    assert sorted(body["events"]) == ["quota.exhausted", "quota.threshold"]


@pytest.mark.parametrize("payload, field", [
    ({"url": "http://127.0.0.1:9/hook"}, "url"),  # loopback: SSRF guard (private off)
    ({"url": "http://169.254.169.254/latest/meta-data"}, "url"),
    ({"url": "ftp://example.com/x"}, "url"),
    ({"url": "not a url"}, "url"),
    ({"url": "https://example.com/x", "events": ["quota.nope"]}, "events"),
])
def test_refused_input_is_a_field_error_and_writes_nothing(world: World, settings: Any,
                                                           payload: dict, field: str) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    audits = AuditEvent.objects.count()
    response = world.client(world.owner).post(_base(world), payload, format="json")
    assert response.status_code == 400 and field in response.json()
    assert not WebhookEndpoint.objects.exists() and AuditEvent.objects.count() == audits


def test_update_enable_disable_and_delete(world: World, receiver: Receiver, settings: Any) -> None:
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["quota.threshold"], actor="test")
    url = f"{_base(world)}{endpoint.public_id}/"
    owner = world.client(world.owner)
    patched = owner.patch(url, {"enabled": False, "events": ["quota.threshold", "test"]},
                          format="json")
    assert patched.status_code == 200
    assert patched.json()["enabled"] is False and patched.json()["events"] == [
        "quota.threshold", "test"]
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    refused = owner.patch(url, {"url": "http://10.0.0.1/x"}, format="json")
    assert refused.status_code == 400 and "url" in refused.json()
    endpoint.refresh_from_db()
    assert endpoint.url == receiver.url
    assert owner.delete(url).status_code == 204
    assert not WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    assert AuditEvent.objects.filter(action="webhook.deleted", target=endpoint.public_id).exists()


def test_test_send_log_and_redeliver(world: World, receiver: Receiver,
                                     django_capture_on_commit_callbacks: Any) -> None:
    endpoint, secret = create_endpoint(world.acme, receiver.url, ["quota.threshold"],
                                       actor="test")
    owner = world.client(world.owner)
    base = f"{_base(world)}{endpoint.public_id}/"
    # The request queues the delivery (after its commit) and answers at once, pending.
    with django_capture_on_commit_callbacks(execute=True) as queued:
        sent = owner.post(f"{base}test")
    assert sent.status_code == 202 and len(queued) == 1
    delivery = sent.json()
    assert delivery["id"].startswith("dlv_") and delivery["status"] == "pending"
    assert delivery["attempts"] == 0 and delivery["last_status_code"] is None
    assert receiver.requests == []
    # A worker of the webhooks queue sends it; the delivery log shows the result.
    pk = WebhookDelivery.objects.get(public_id=delivery["id"]).pk
    assert run_queued_deliveries({pk}) == ["delivered"]
    request = receiver.requests[-1]
    assert request["headers"]["Tollgate-Delivery"] == delivery["id"]
    assert verify_signature(secret, request["headers"]["Tollgate-Timestamp"], request["body"],
                            request["headers"]["Tollgate-Signature"])

    log = owner.get(f"{base}deliveries/").json()
    assert log["count"] == 1 and log["results"][0]["id"] == delivery["id"]
    assert log["results"][0]["status"] == "delivered"
    assert log["results"][0]["attempts"] == 1 and log["results"][0]["last_status_code"] == 200
    assert "payload" not in log["results"][0]
    with django_capture_on_commit_callbacks(execute=True):
        again = owner.post(f"{base}deliveries/{delivery['id']}/redeliver")
    assert again.status_code == 202 and again.json()["status"] == "pending"
    assert again.json()["attempts"] == 1 and len(receiver.requests) == 1
    assert run_queued_deliveries({pk}) == ["delivered"]
    assert owner.get(f"{base}deliveries/").json()["results"][0]["attempts"] == 2
    assert len(receiver.requests) == 2
    first, second = (json.loads(r["body"]) for r in receiver.requests)
    assert first["id"] == second["id"]  # the same event, again
    assert AuditEvent.objects.filter(action="webhook.redelivered",
                                     target=delivery["id"]).exists()


def test_member_reads_but_cannot_change(world: World, receiver: Receiver) -> None:
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["quota.threshold"], actor="test")
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_type="test", payload={})
    member = world.client(world.member)
    base = f"{_base(world)}{endpoint.public_id}/"
    assert member.get(_base(world)).status_code == 200
    assert member.get(base).status_code == 200
    assert member.get(f"{base}deliveries/").status_code == 200
    assert member.post(_base(world), {"url": receiver.url}, format="json").status_code == 403
    assert member.patch(base, {"enabled": False}, format="json").status_code == 403
    assert member.delete(base).status_code == 403
    assert member.post(f"{base}test").status_code == 403
    assert member.post(f"{base}deliveries/{delivery.public_id}/redeliver").status_code == 403
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).enabled and receiver.requests == []


def test_outsider_and_foreign_ids_are_404(world: World, receiver: Receiver) -> None:
    mine, _ = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    theirs, _ = create_endpoint(world.globex, receiver.url, ["test"], actor="test")
    their_delivery = WebhookDelivery.objects.create(endpoint=theirs, event_type="test",
                                                    payload={})
    outsider = world.client(world.outsider)
    assert outsider.get(_base(world)).status_code == 404
    assert outsider.get(f"{_base(world)}{mine.public_id}/").status_code == 404
    assert outsider.delete(f"{_base(world)}{mine.public_id}/").status_code == 404
    owner = world.client(world.owner)
    assert owner.get(f"{_base(world)}{theirs.public_id}/").status_code == 404
    assert owner.post(f"{_base(world)}{theirs.public_id}/test").status_code == 404
    assert owner.post(f"{_base(world)}{mine.public_id}/deliveries/{their_delivery.public_id}"
                      "/redeliver").status_code == 404
    assert owner.get(f"{_base(world)}whk_nope/deliveries/").status_code == 404
    assert WebhookEndpoint.objects.filter(pk=mine.pk).exists() and receiver.requests == []
