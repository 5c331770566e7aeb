"""The re-encryption step of a TOLLGATE_ENCRYPTION_KEYS rotation, over every stored secret.

The rotation (gateway/crypto.py): put a new Fernet key first in TOLLGATE_ENCRYPTION_KEYS and keep
the old ones, restart, run `python manage.py reencrypt_secrets` (this module), then drop the old
keys and restart again. Secrets are encrypted by two layers: provider keys (gateway) and webhook
signing secrets (billing). Gateway cannot import billing, so the step that covers both lives
here, the layer that sees both; re-encrypting only one of them would leave the other
undecryptable once the old key is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from billing.webhooks import reencrypt_webhook_secrets
from gateway.providers import reencrypt_provider_secrets


@dataclass(frozen=True)
class Reencrypted:
    """How many rows were re-encrypted under the first configured key."""

    provider_keys: int
    webhook_endpoints: int


def reencrypt_stored_secrets() -> Reencrypted:
    """Re-encrypt every provider key and every webhook endpoint's secrets under the first key of
    TOLLGATE_ENCRYPTION_KEYS, in one transaction: SecretDecryptionError (naming the provider key
    or the webhook endpoint) if a provider key's secret or an endpoint's signing secret opens
    with none of the configured keys, and then nothing has changed, so the old keys must stay
    until it succeeds. (A replaced webhook secret no key opens signs nothing and is cleared:
    billing.webhooks.reencrypt_webhook_secrets.)"""
    with transaction.atomic():
        return Reencrypted(provider_keys=reencrypt_provider_secrets(),
                           webhook_endpoints=reencrypt_webhook_secrets())
