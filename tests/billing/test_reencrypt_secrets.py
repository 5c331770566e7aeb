"""The documented rotation of TOLLGATE_ENCRYPTION_KEYS (gateway/crypto.py) over every stored
secret: new key first, `manage.py reencrypt_secrets`, old key dropped. Provider keys still
decrypt and webhook deliveries still sign with the secrets their receivers hold (the current one
and, during a rotation's grace, the replaced one); a ciphertext no key opens stops the command
with nothing changed."""
from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.management import CommandError, call_command
from django.utils import timezone
from standardwebhooks import Webhook

from billing import webhooks
from billing.models import WebhookEndpoint
from gateway.crypto import decrypt_secret
from gateway.models import ProviderKey
from gateway.providers import create_provider_key, set_provider_secret
from tenants.models import Tenant
from tenants.services import create_tenant
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

PROVIDER_SECRET = "sk-proj-TESTsecretValue0123456789abcdefXYZ9"


@pytest.fixture
def keys(settings: Any) -> tuple[str, str]:
    """(A, B): the key in use, then the new one; A encrypts until the test moves on."""
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.TOLLGATE_ENCRYPTION_KEYS = key_a
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on 127.0.0.1
    return key_a, key_b


@pytest.fixture
def receiver(keys: tuple[str, str]) -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def reencrypt(*args: str) -> str:
    out = io.StringIO()
    call_command("reencrypt_secrets", *args, stdout=out)
    return out.getvalue()


def test_the_documented_rotation_keeps_webhooks_signing_and_provider_keys_readable(
        settings: Any, keys: tuple[str, str], receiver: Receiver, acme: Tenant) -> None:
    key_a, key_b = keys
    provider = create_provider_key("a", base_url="https://a.test/v1", secret=PROVIDER_SECRET)
    rotating, old = webhooks.create_endpoint(acme, receiver.url, ["test"], actor="t")
    rotating, new, _ = webhooks.rotate_secret(rotating, actor="t", grace_seconds=3600)
    plain, plain_secret = webhooks.create_endpoint(acme, receiver.url, ["test"], actor="t")
    # A grace period that has ended, its ciphertext not yet cleared by the beat.
    ended, _ = webhooks.create_endpoint(acme, receiver.url, ["test"], actor="t")
    ended, ended_new, _ = webhooks.rotate_secret(ended, actor="t", grace_seconds=3600)
    WebhookEndpoint.objects.filter(pk=ended.pk).update(
        previous_secret_expires_at=timezone.now() - timedelta(seconds=1))

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{key_b},{key_a}"  # the new key first, the old kept
    assert reencrypt() == ("Re-encrypted 1 provider key(s) and 3 webhook endpoint(s) under the "
                           "first key of TOLLGATE_ENCRYPTION_KEYS; the old keys may now be "
                           "removed.\n")
    settings.TOLLGATE_ENCRYPTION_KEYS = key_b  # the old key dropped

    provider.refresh_from_db()
    assert decrypt_secret(provider.secret_encrypted) == PROVIDER_SECRET
    for endpoint in (rotating, plain, ended):
        endpoint.refresh_from_db()
    ended_row = (ended.previous_secret_encrypted, ended.previous_secret_expires_at)
    assert ended_row == ("", None)  # cleared, not re-encrypted
    assert rotating.previous_secret_valid_until(timezone.now()) is not None

    for endpoint, signing in ((rotating, (old, new)), (plain, (plain_secret,)),
                              (ended, (ended_new,))):
        delivery = webhooks.send_test_event(endpoint)
        assert (delivery.status, delivery.last_error) == ("delivered", "")
        request = receiver.requests[-1]
        signatures = request["headers"]["webhook-signature"].split(" ")
        assert len(signatures) == len(signing)
        for secret in signing:
            assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"


def stored_ciphertexts() -> tuple[list[str], list[tuple[str, str]]]:
    """Every stored ciphertext: the provider keys' secrets, the endpoints' and their previous."""
    return (list(ProviderKey.objects.order_by("pk").values_list("secret_encrypted", flat=True)),
            list(WebhookEndpoint.objects.order_by("pk").values_list(
                "secret_encrypted", "previous_secret_encrypted")))


def refused_with_nothing_changed(reason: str) -> None:
    """The step stops with `reason` and the advice to keep the old keys; no ciphertext moved."""
    before = stored_ciphertexts()
    with pytest.raises(CommandError) as refused:
        reencrypt()
    assert str(refused.value) == (
        f"{reason} Nothing was re-encrypted: keep the old keys in TOLLGATE_ENCRYPTION_KEYS.")
    assert stored_ciphertexts() == before


def test_a_secret_no_key_opens_stops_the_rotation_with_nothing_changed(
        settings: Any, keys: tuple[str, str], acme: Tenant) -> None:
    key_a, key_b = keys
    create_provider_key("a", base_url="https://a.test/v1", secret=PROVIDER_SECRET)
    fine, _ = webhooks.create_endpoint(acme, "http://127.0.0.1:9/a", ["test"], actor="t")
    broken, _ = webhooks.create_endpoint(acme, "http://127.0.0.1:9/b", ["test"], actor="t")
    WebhookEndpoint.objects.filter(pk=broken.pk).update(secret_encrypted="not a Fernet token")

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{key_b},{key_a}"
    refused_with_nothing_changed(
        f"webhook endpoint {broken.public_id}: no configured key decrypts its signing secret "
        "(deliveries to it fail); rotate that secret, or put back the key that encrypted it.")

    # The remedy named: rotate the broken secret, then the step goes through.
    webhooks.rotate_secret(broken, actor="t")
    assert json.loads(reencrypt("--json")) == {"provider_keys": 1, "webhook_endpoints": 2}
    settings.TOLLGATE_ENCRYPTION_KEYS = key_b
    fine.refresh_from_db()
    assert fine.secret.startswith("whsec_")


def test_a_provider_key_no_key_opens_is_named_and_nothing_changes(
        settings: Any, keys: tuple[str, str], acme: Tenant) -> None:
    key_a, key_b = keys
    create_provider_key("fine", base_url="https://a.test/v1", secret=PROVIDER_SECRET)
    broken = create_provider_key("broken", base_url="https://b.test/v1", secret=PROVIDER_SECRET)
    ProviderKey.objects.filter(pk=broken.pk).update(secret_encrypted="not a Fernet token")
    webhooks.create_endpoint(acme, "http://127.0.0.1:9/a", ["test"], actor="t")

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{key_b},{key_a}"
    refused_with_nothing_changed(
        f"provider key broken ({broken.public_id}): no configured key decrypts its secret "
        "(calls through it fail); set its secret again, or put back the key that encrypted "
        "it.")

    # The remedy named: set its secret again, then the step goes through.
    set_provider_secret(broken, PROVIDER_SECRET, actor="t")
    assert json.loads(reencrypt("--json")) == {"provider_keys": 2, "webhook_endpoints": 1}
    settings.TOLLGATE_ENCRYPTION_KEYS = key_b
    assert [decrypt_secret(k.secret_encrypted) for k in ProviderKey.objects.order_by("pk")] == [
        PROVIDER_SECRET, PROVIDER_SECRET]


def test_a_previous_secret_no_key_opens_is_cleared_not_a_stop(
        settings: Any, keys: tuple[str, str], receiver: Receiver, acme: Tenant,
        caplog: pytest.LogCaptureFixture) -> None:
    # As a rotation made before rotate_secret checked the replaced secret could leave it: it
    # signs nothing already (secrets_in_force leaves it out), so clearing it changes no delivery.
    key_a, key_b = keys
    endpoint, secret = webhooks.create_endpoint(acme, receiver.url, ["test"], actor="t")
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        previous_secret_encrypted="not a Fernet token",
        previous_secret_expires_at=timezone.now() + timedelta(hours=1))

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{key_b},{key_a}"
    assert "0 provider key(s) and 1 webhook endpoint(s)" in reencrypt()
    settings.TOLLGATE_ENCRYPTION_KEYS = key_b
    endpoint.refresh_from_db()
    assert (endpoint.previous_secret_encrypted, endpoint.previous_secret_expires_at) == ("", None)
    assert f"webhook endpoint {endpoint.public_id}: its previous secret" in caplog.text
    delivery = webhooks.send_test_event(endpoint)
    assert (delivery.status, delivery.last_error) == ("delivered", "")
    [request] = receiver.requests
    assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"
