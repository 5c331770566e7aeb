"""Standard Webhooks signatures, checked the way a tenant checks them: real deliveries to a real
receiver on loopback, verified with the `standardwebhooks` package (`Webhook(secret).verify`),
for new secrets, secrets made before Standard Webhooks, retries and rotations; and the
deprecated Tollgate-Signature headers still verifying beside them."""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.utils import timezone
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from billing import tasks, webhooks
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.webhooks import (
    create_endpoint,
    deliver,
    redeliver,
    rotate_secret,
    send_test_event,
    standard_secret,
    verify_signature,
)
from gateway.crypto import encrypt_secret
from tenants.models import AuditEvent, Tenant
from tenants.services import create_tenant
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

NEW_SECRET = re.compile(r"^whsec_[A-Za-z0-9+/]{43}=$")  # standard base64 of 32 bytes


@pytest.fixture
def allow_private(settings: Any) -> Any:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on 127.0.0.1
    return settings


@pytest.fixture
def receiver(allow_private: Any) -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def new_delivery(endpoint: WebhookEndpoint) -> WebhookDelivery:
    payload = webhooks.event_payload("quota.threshold", endpoint.tenant, scope="tenant",
                                     window="d2026-11-30", limit=1000, used=900, pending=0,
                                     remaining=100, threshold=10)
    [delivery] = webhooks.create_deliveries(endpoint.tenant, "quota.threshold", payload)
    return delivery


def legacy_endpoint(tenant: Tenant, url: str, secret: str) -> WebhookEndpoint:
    """An endpoint as the release before Standard Webhooks left it: its secret `whsec_` +
    URL-safe base64 without padding, stored encrypted (no service makes one any more)."""
    return WebhookEndpoint.objects.create(tenant=tenant, url=url, events=["quota.threshold"],
                                          secret_encrypted=encrypt_secret(secret))


def by_hand(legacy: str) -> str:
    """The conversion the README tells holders of an old secret to make."""
    return "whsec_" + legacy.removeprefix("whsec_").replace("-", "+").replace("_", "/") + "="


def refused(secret: str, body: bytes, headers: dict[str, str]) -> str:
    """The verifier's refusal, as its message (the test fails if it accepts)."""
    with pytest.raises(WebhookVerificationError) as caught:
        Webhook(secret).verify(body, headers)
    return str(caught.value)


def wait_for_next_second() -> None:
    """Timestamps are whole seconds: a retry within the same second would carry the same one."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)


# -- new secrets --------------------------------------------------------------------------------


def test_a_delivery_verifies_with_standardwebhooks_and_the_secret_shown(
        receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    assert NEW_SECRET.match(secret) and len(base64.b64decode(secret[6:], validate=True)) == 32
    assert standard_secret(secret) == secret
    delivery = deliver(new_delivery(endpoint).pk)
    assert delivery.status == "delivered"
    [request] = receiver.requests
    body, headers = request["body"], request["headers"]

    assert Webhook(secret).verify(body, headers) == delivery.payload
    assert headers["webhook-id"] == delivery.payload["id"]  # the event's id: receivers dedupe
    assert headers["webhook-timestamp"] == headers["Tollgate-Timestamp"]
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 30
    # The signature is the specification's, computed here without the package: base64 of
    # HMAC-SHA256 over "{id}.{timestamp}.{body}" keyed with the secret's base64-decoded bytes.
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"
    # The deprecated headers, still sent, still verify with the same secret.
    assert verify_signature(secret, headers["Tollgate-Timestamp"], body,
                            headers["Tollgate-Signature"])
    assert headers["Tollgate-Delivery"] == delivery.public_id
    assert headers["Tollgate-Event"] == "quota.threshold"


def test_every_new_secret_is_new_and_in_the_standard_format(acme: Tenant,
                                                             allow_private: Any) -> None:
    made = {create_endpoint(acme, "http://127.0.0.1:9/h", ["test"], actor="t")[1]
            for _ in range(20)}
    assert len(made) == 20 and all(NEW_SECRET.match(s) for s in made)


def test_a_test_event_verifies_too(receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    delivery = send_test_event(endpoint)
    [request] = receiver.requests
    assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"
    assert request["headers"]["webhook-id"] == delivery.payload["id"]


# -- secrets made before Standard Webhooks ------------------------------------------------------


@pytest.mark.parametrize("legacy", [
    # 32 bytes whose URL-safe base64 holds both "-" and "_" (the characters that differ).
    "whsec_" + base64.urlsafe_b64encode(bytes(range(0xE0, 0x100))).decode().rstrip("="),
    # One as the old new_secret made them.
    "whsec_" + secrets.token_urlsafe(32),
], ids=["both-url-safe-characters", "token_urlsafe"])
def test_an_existing_endpoints_secret_verifies_in_its_standard_form_and_with_the_old_headers(
        receiver: Receiver, acme: Tenant, legacy: str) -> None:
    endpoint = legacy_endpoint(acme, receiver.url, legacy)
    delivery = deliver(new_delivery(endpoint).pk)
    assert delivery.status == "delivered"
    [request] = receiver.requests
    body, headers = request["body"], request["headers"]
    # What the tenant was shown, unchanged, still checks the deprecated headers.
    assert verify_signature(legacy, headers["Tollgate-Timestamp"], body,
                            headers["Tollgate-Signature"])
    # Its standard form is the same text with the URL-safe characters swapped and "=" added;
    # the key is the 32 random bytes the secret always encoded.
    converted = standard_secret(legacy)
    assert converted == by_hand(legacy) and NEW_SECRET.match(converted)
    assert base64.b64decode(converted[6:]) == base64.urlsafe_b64decode(legacy[6:] + "=")
    assert Webhook(converted).verify(body, headers) == delivery.payload
    if set("-_") & set(legacy.removeprefix("whsec_")):
        # Given as it is, a standard base64 decoder reads other bytes (Python's drops the "-"
        # and "_"; stricter ones refuse): why the README asks for the conversion.
        with pytest.raises((WebhookVerificationError, binascii.Error)):
            Webhook(legacy).verify(body, headers)


def test_a_secret_that_is_not_base64_is_refused_by_signing_key() -> None:
    for bad in ("whsec_", "whsec_***", "whsec_a b", "whsec_ab=cd"):
        with pytest.raises(ValueError, match="whsec_ followed by base64"):
            webhooks.signing_key(bad)


# -- retries and redeliveries -------------------------------------------------------------------


def test_a_retry_keeps_its_webhook_id_with_a_new_timestamp_and_signature(
        allow_private: Any, acme: Tenant) -> None:
    allow_private.TOLLGATE_WEBHOOK_BACKOFF_SECONDS = (0,)
    with Receiver([500, 200, 200]) as receiver:
        endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
        delivery = deliver(new_delivery(endpoint).pk)
        assert (delivery.status, delivery.attempts) == ("pending", 1)
        wait_for_next_second()
        delivery = deliver(delivery.pk)
        assert (delivery.status, delivery.attempts) == ("delivered", 2)
        wait_for_next_second()
        again = redeliver(delivery)  # a person's redelivery: the same event once more
        assert (again.status, again.attempts) == ("delivered", 3)
    first, retry, redelivered = (r["headers"] for r in receiver.requests)
    assert first["webhook-id"] == retry["webhook-id"] == redelivered["webhook-id"] \
        == delivery.payload["id"]
    stamps = [int(h["webhook-timestamp"]) for h in (first, retry, redelivered)]
    assert stamps[0] < stamps[1] < stamps[2]
    assert len({h["webhook-signature"] for h in (first, retry, redelivered)}) == 3
    assert len({h["Tollgate-Signature"] for h in (first, retry, redelivered)}) == 3
    for request in receiver.requests:
        assert Webhook(secret).verify(request["body"], request["headers"]) == delivery.payload
        assert verify_signature(secret, request["headers"]["Tollgate-Timestamp"],
                                request["body"], request["headers"]["Tollgate-Signature"])


# -- what the verifier refuses ------------------------------------------------------------------


def test_a_tampered_body_a_wrong_secret_a_changed_id_and_an_old_timestamp_are_refused(
        receiver: Receiver, acme: Tenant) -> None:
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    _other, other_secret = create_endpoint(acme, receiver.url, ["test"], actor="t")
    deliver(new_delivery(endpoint).pk)
    [request] = receiver.requests
    body, headers = request["body"], request["headers"]
    assert Webhook(secret).verify(body, headers)  # the untouched delivery passes

    tampered = body.replace(b'"used":900', b'"used":1')
    assert tampered != body
    assert refused(secret, tampered, headers) == "No matching signature found"
    assert refused(other_secret, body, headers) == "No matching signature found"
    assert refused(secret, body, {**headers, "webhook-id": "evt_other"}) \
        == "No matching signature found"
    assert refused(secret, body, {k: v for k, v in headers.items()
                                  if k != "webhook-signature"}) == "Missing required headers"
    assert not verify_signature(secret, headers["Tollgate-Timestamp"], tampered,
                                headers["Tollgate-Signature"])
    assert not verify_signature(other_secret, headers["Tollgate-Timestamp"], body,
                                headers["Tollgate-Signature"])

    # A delivery signed correctly, by the signer the deliveries use, 10 minutes ago (a
    # replay): refused for its age alone, while the same body signed now passes.
    event_id = headers["webhook-id"]
    old = webhooks.signature_headers([secret], event_id, int(time.time()) - 600, body)
    fresh = webhooks.signature_headers([secret], event_id, int(time.time()), body)
    assert refused(secret, body, old) == "Message timestamp too old"
    assert Webhook(secret).verify(body, fresh) == json.loads(body)
    assert not verify_signature(secret, old[webhooks.TIMESTAMP_HEADER], body,
                                old[webhooks.SIGNATURE_HEADER])


# -- rotation -----------------------------------------------------------------------------------


def test_during_a_rotations_grace_both_secrets_sign_and_after_it_only_the_new_one(
        receiver: Receiver, acme: Tenant) -> None:
    endpoint, old = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    endpoint, new, unusable = rotate_secret(endpoint, actor="user:a", grace_seconds=3600)
    assert NEW_SECRET.match(new) and new != old and endpoint.secret == new and unusable == ""
    # An hour's grace, not seconds: it cannot end before the first delivery on a loaded machine.
    assert timedelta(minutes=59) < endpoint.previous_secret_expires_at - timezone.now() \
        <= timedelta(hours=1)
    deliver(new_delivery(endpoint).pk)
    body, headers = receiver.requests[-1]["body"], receiver.requests[-1]["headers"]
    assert len(headers["webhook-signature"].split(" ")) == 2
    assert len(headers["Tollgate-Signature"].split(",")) == 2
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers)
        assert verify_signature(secret, headers["Tollgate-Timestamp"], body,
                                headers["Tollgate-Signature"])
    event = AuditEvent.objects.get(action="webhook.secret_rotated", target=endpoint.public_id)
    assert event.actor == "user:a" and event.data["grace_seconds"] == 3600
    assert event.data["previous_valid_until"] == endpoint.previous_secret_expires_at.isoformat()
    assert event.data["previous_unusable"] is None
    assert old not in json.dumps(event.data) and new not in json.dumps(event.data)

    # The grace period ends: its end moved to a moment ago (rather than waited for), the
    # ciphertext left as the rotation stored it, so the expiry alone stops the old secret.
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        previous_secret_expires_at=timezone.now() - timedelta(milliseconds=1))
    endpoint.refresh_from_db()
    assert endpoint.previous_secret_encrypted != ""
    deliver(new_delivery(endpoint).pk)
    body, headers = receiver.requests[-1]["body"], receiver.requests[-1]["headers"]
    assert " " not in headers["webhook-signature"] and "," not in headers["Tollgate-Signature"]
    assert Webhook(new).verify(body, headers)
    assert refused(old, body, headers) == "No matching signature found"


def test_a_rotation_without_grace_ends_the_old_secret_at_once(receiver: Receiver,
                                                              acme: Tenant) -> None:
    endpoint, old = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    endpoint, new, unusable = rotate_secret(endpoint, actor="t")
    assert endpoint.previous_secret_encrypted == "" and endpoint.previous_secret_expires_at is None
    assert unusable == ""
    deliver(new_delivery(endpoint).pk)
    [request] = receiver.requests
    assert Webhook(new).verify(request["body"], request["headers"])
    assert refused(old, request["body"], request["headers"]) == "No matching signature found"
    assert not verify_signature(old, request["headers"]["Tollgate-Timestamp"], request["body"],
                                request["headers"]["Tollgate-Signature"])


def test_a_second_rotation_ends_the_oldest_secret(receiver: Receiver, acme: Tenant) -> None:
    endpoint, first = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    endpoint, second, _ = rotate_secret(endpoint, actor="t", grace_seconds=3600)
    endpoint, third, _ = rotate_secret(endpoint, actor="t", grace_seconds=3600)
    deliver(new_delivery(endpoint).pk)
    [request] = receiver.requests
    assert Webhook(second).verify(request["body"], request["headers"])
    assert Webhook(third).verify(request["body"], request["headers"])
    assert refused(first, request["body"], request["headers"]) == "No matching signature found"


def test_rotating_an_existing_endpoints_secret_moves_it_to_the_standard_format(
        receiver: Receiver, acme: Tenant) -> None:
    legacy = "whsec_" + secrets.token_urlsafe(32)
    endpoint, new, unusable = rotate_secret(legacy_endpoint(acme, receiver.url, legacy),
                                            actor="t", grace_seconds=3600)
    assert NEW_SECRET.match(new) and unusable == ""
    deliver(new_delivery(endpoint).pk)
    [request] = receiver.requests
    body, headers = request["body"], request["headers"]
    assert Webhook(new).verify(body, headers)  # the new secret, as shown
    assert Webhook(by_hand(legacy)).verify(body, headers)  # the old one, until the grace ends
    assert verify_signature(legacy, headers["Tollgate-Timestamp"], body,
                            headers["Tollgate-Signature"])


@pytest.mark.parametrize("grace", [-1, webhooks.MAX_GRACE_SECONDS + 1])
def test_a_grace_out_of_range_changes_nothing(acme: Tenant, allow_private: Any,
                                              grace: int) -> None:
    endpoint, secret = create_endpoint(acme, "http://127.0.0.1:9/h", ["test"], actor="t")
    with pytest.raises(ValueError, match="grace_seconds must be between 0 and 604800"):
        rotate_secret(endpoint, actor="t", grace_seconds=grace)
    endpoint.refresh_from_db()
    assert endpoint.secret == secret and endpoint.previous_secret_encrypted == ""
    assert not AuditEvent.objects.filter(action="webhook.secret_rotated").exists()


KEY_A, KEY_B = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def endpoint_no_key_opens(settings: Any, tenant: Tenant, url: str) -> WebhookEndpoint:
    """An endpoint whose secret was encrypted under a Fernet key since dropped from
    TOLLGATE_ENCRYPTION_KEYS (a key rotation that re-encrypted the provider keys only, as
    before `manage.py reencrypt_secrets` covered webhooks)."""
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_A
    endpoint, _ = create_endpoint(tenant, url, ["quota.threshold"], actor="t")
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_B
    return endpoint


def endpoint_not_base64(settings: Any, tenant: Tenant, url: str) -> WebhookEndpoint:
    """An endpoint whose stored secret decrypts but is not whsec_ + base64 (no service makes
    one: a row written by hand)."""
    return WebhookEndpoint.objects.create(tenant=tenant, url=url, events=["quota.threshold"],
                                          secret_encrypted=encrypt_secret("whsec_not*base64"))


@pytest.mark.parametrize("broken, reason", [
    (endpoint_no_key_opens, "it cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"),
    (endpoint_not_base64, "it cannot sign: a webhook secret is whsec_ followed by base64"),
], ids=["undecryptable", "not-base64"])
def test_rotating_a_secret_that_cannot_sign_keeps_no_previous_one_and_the_new_one_signs(
        receiver: Receiver, acme: Tenant, settings: Any, broken: Any, reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    endpoint = broken(settings, acme, receiver.url)
    failed = deliver(new_delivery(endpoint).pk)
    assert failed.status == "pending" and failed.last_error and receiver.requests == []

    # The remedy is a rotation, with the console's default grace (a day): the broken secret
    # signed nothing, so it is not kept, and the new one signs at once.
    endpoint, new, unusable = rotate_secret(endpoint, actor="user:a", grace_seconds=86400)
    assert unusable == reason
    assert endpoint.previous_secret_encrypted == "" and endpoint.previous_secret_expires_at is None
    assert endpoint.previous_secret_valid_until(timezone.now()) is None
    event = AuditEvent.objects.get(action="webhook.secret_rotated", target=endpoint.public_id)
    assert event.data == {"grace_seconds": 86400, "previous_valid_until": None,
                          "previous_unusable": reason}
    assert f"{endpoint.public_id}: its replaced secret is not kept" in caplog.text

    delivery = deliver(new_delivery(endpoint).pk)
    assert (delivery.status, delivery.last_error) == ("delivered", "")
    [request] = receiver.requests
    body, headers = request["body"], request["headers"]
    assert " " not in headers["webhook-signature"] and "," not in headers["Tollgate-Signature"]
    assert Webhook(new).verify(body, headers)
    assert verify_signature(new, headers["Tollgate-Timestamp"], body,
                            headers["Tollgate-Signature"])


@pytest.mark.parametrize("stored_previous, reason", [
    (lambda: "not a Fernet token", "it cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"),
    (lambda: encrypt_secret("whsec_not*base64"),
     "it cannot sign: a webhook secret is whsec_ followed by base64"),
], ids=["undecryptable", "not-base64"])
def test_a_previous_secret_that_cannot_sign_is_left_out_and_the_attempt_goes(
        receiver: Receiver, acme: Tenant, stored_previous: Any, reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # As a rotation made before rotate_secret checked the replaced secret left an endpoint
    # (or a key dropped from TOLLGATE_ENCRYPTION_KEYS during its grace).
    endpoint, secret = create_endpoint(acme, receiver.url, ["quota.threshold"], actor="t")
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        previous_secret_encrypted=stored_previous(),
        previous_secret_expires_at=timezone.now() + timedelta(hours=1))
    endpoint.refresh_from_db()
    assert webhooks.secrets_in_force(endpoint, timezone.now()) == [secret]
    assert (f"webhook endpoint {endpoint.public_id}: its previous secret (grace until "
            in caplog.text) and reason in caplog.text

    delivery = deliver(new_delivery(endpoint).pk)
    assert (delivery.status, delivery.last_error) == ("delivered", "")
    [request] = receiver.requests
    assert " " not in request["headers"]["webhook-signature"]
    assert Webhook(secret).verify(request["body"], request["headers"])


def test_the_beat_forgets_replaced_secrets_whose_grace_ended(allow_private: Any,
                                                             acme: Tenant) -> None:
    ended, _ = create_endpoint(acme, "http://127.0.0.1:9/a", ["test"], actor="t")
    lasting, _ = create_endpoint(acme, "http://127.0.0.1:9/b", ["test"], actor="t")
    for endpoint in (ended, lasting):
        rotate_secret(endpoint, actor="t", grace_seconds=3600)
    WebhookEndpoint.objects.filter(pk=ended.pk).update(
        previous_secret_expires_at=timezone.now() - timedelta(seconds=1))
    lasting.refresh_from_db()
    kept = (lasting.previous_secret_encrypted, lasting.previous_secret_expires_at)

    assert tasks.retry_due_webhooks() == 0  # no delivery is due; the clean-up runs all the same
    ended.refresh_from_db()
    lasting.refresh_from_db()
    assert (ended.previous_secret_encrypted, ended.previous_secret_expires_at) == ("", None)
    assert (lasting.previous_secret_encrypted, lasting.previous_secret_expires_at) == kept
    assert webhooks.clear_expired_previous_secrets() == 0  # nothing left to clear


@pytest.mark.parametrize("stored, error", [
    (encrypt_secret("whsec_not*base64"), "the endpoint's secret cannot sign: a webhook secret "
     "is whsec_ followed by base64"),
    ("not a Fernet token", "the endpoint's secret cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"),
], ids=["not-base64", "undecryptable"])
def test_a_secret_that_cannot_sign_fails_the_attempt_and_sends_nothing(
        receiver: Receiver, acme: Tenant, stored: str, error: str) -> None:
    endpoint = WebhookEndpoint.objects.create(tenant=acme, url=receiver.url,
                                              events=["quota.threshold"], secret_encrypted=stored)
    delivery = deliver(new_delivery(endpoint).pk)
    assert (delivery.status, delivery.attempts, delivery.last_error) == ("pending", 1, error)
    assert delivery.next_attempt_at is not None and receiver.requests == []
