"""Issue a management API token (`Authorization: Bearer tgm_...` for /api/). Operators bootstrap
scripts with it: `--operator` gives a token that sees every tenant."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import CommandError

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.management_tokens import masked_token
from tenants.selectors import tenant_by_slug
from tenants.services.management_tokens import issue_management_token


class Command(TenantsCommand):
    help = (
        "Issue a management API token for a tenant (acts as its admin) or, with --operator, one "
        "that sees every tenant. The token is printed once and only its digest is stored."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument("--tenant", metavar="SLUG", help="The tenant the token manages.")
        scope.add_argument("--operator", action="store_true",
                           help="A token that sees and manages every tenant.")
        parser.add_argument("--name", required=True, help="What the token is for.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        if not options["tenant"] and not options["operator"]:
            raise CommandError("Give --tenant SLUG or --operator.")
        tenant = tenant_by_slug(options["tenant"]) if options["tenant"] else None
        issued = issue_management_token(tenant, name=options["name"], actor=ACTOR)
        token = issued.token
        masked = masked_token(token.prefix, token.last4)
        scope = f"tenant {tenant.slug}" if tenant else "every tenant (operator)"
        data = {"token_id": token.public_id, "token": issued.plaintext, "masked": masked,
                "tenant": tenant.slug if tenant else None, "name": token.name}
        text = (
            f"Issued management token {token.public_id} ({masked}) for {scope}.\n"
            "Store it now: it is shown only this once.\n"
            f"{issued.plaintext}"
        )
        return data, text
