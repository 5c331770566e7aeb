"""python manage.py reencrypt_secrets [--json]

The middle step of rotating TOLLGATE_ENCRYPTION_KEYS (gateway/crypto.py): with the new key first
and the old ones still listed, re-encrypt every stored secret (provider keys and webhook
signing secrets, billing.encryption) under the new key. Exit status 1, nothing changed, when a
ciphertext opens with none of the configured keys: the old keys must then stay.
"""
from __future__ import annotations

import dataclasses
import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.encryption import reencrypt_stored_secrets
from gateway.crypto import SecretDecryptionError


class Command(BaseCommand):
    help = ("Re-encrypt every stored secret (provider keys, webhook signing secrets) under the "
            "first key of TOLLGATE_ENCRYPTION_KEYS; run before dropping the old keys.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true",
                            help="Print the counts as one JSON object.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            done = reencrypt_stored_secrets()
        except SecretDecryptionError as exc:
            raise CommandError(f"{exc}. Nothing was re-encrypted: keep the old keys in "
                               "TOLLGATE_ENCRYPTION_KEYS.") from exc
        if options["json"]:
            self.stdout.write(json.dumps(dataclasses.asdict(done)))
            return
        self.stdout.write(
            f"Re-encrypted {done.provider_keys} provider key(s) and {done.webhook_endpoints} "
            "webhook endpoint(s) under the first key of TOLLGATE_ENCRYPTION_KEYS; the old keys "
            "may now be removed.")
