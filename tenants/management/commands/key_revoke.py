from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.selectors import api_key_by_public_id
from tenants.services.api_keys import revoke_key


class Command(TenantsCommand):
    help = "Revoke an API key and all of its secrets, at once and for good."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("key_id", help="The key's public id (key_...).")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        api_key = api_key_by_public_id(options["key_id"])
        revoked_now = revoke_key(api_key, actor=ACTOR)
        data = {
            "key_id": api_key.public_id,
            "revoked_at": api_key.revoked_at,
            "already_revoked": not revoked_now,
        }
        if revoked_now:
            text = f"Revoked API key {api_key.public_id}."
        else:
            text = f"API key {api_key.public_id} was already revoked at {api_key.revoked_at}."
        return data, text
