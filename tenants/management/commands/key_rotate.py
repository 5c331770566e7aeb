from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.selectors import api_key_by_public_id
from tenants.services.api_keys import rotate_key


class Command(TenantsCommand):
    help = "Give an API key a new secret. The new key is printed once and never stored."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("key_id", help="The key's public id (key_...).")
        parser.add_argument(
            "--grace",
            type=int,
            default=0,
            metavar="SECONDS",
            help="Keep the previous secret working this long (default 0: it stops at once).",
        )

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        api_key = api_key_by_public_id(options["key_id"])
        issued = rotate_key(api_key, actor=ACTOR, grace_seconds=options["grace"])
        grace = options["grace"]
        data = {
            "key_id": issued.api_key.public_id,
            "key": issued.plaintext,
            "masked": issued.masked,
            "grace_seconds": grace,
        }
        previous = (
            "The previous secret has stopped working."
            if grace == 0
            else f"The previous secret keeps working for {grace} seconds."
        )
        text = (
            f"Rotated API key {issued.api_key.public_id}; new secret {issued.masked}. {previous}\n"
            "Store it now: it is shown only this once.\n"
            f"{issued.plaintext}"
        )
        return data, text
