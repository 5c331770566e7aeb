"""Issue a management API token (`Authorization: Bearer tgm_...` for /api/). Operators bootstrap
scripts with it: `--operator` gives a token that sees every tenant."""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import CommandError
from django.utils import timezone

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.management_tokens import masked_token
from tenants.models import SCOPE_ORDER, ManagementToken
from tenants.selectors import tenant_by_slug
from tenants.services.management_tokens import (
    DEFAULT_EXPIRY,
    DEFAULT_LIFETIME,
    issue_management_token,
)

MAX_DAYS = 3650


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        raise ArgumentTypeError(f"not a whole number of days: {text!r}") from None
    if not 1 <= days <= MAX_DAYS:
        raise ArgumentTypeError(f"give 1 to {MAX_DAYS} days (or --no-expiry)")
    return days


class Command(TenantsCommand):
    help = (
        "Issue a management API token for a tenant (acts as its admin, within --scope) or, with "
        "--operator, one that sees every tenant. It expires after 90 days unless --expires-in-days "
        "or --no-expiry says otherwise. The token is printed once and only its digest is stored."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument("--tenant", metavar="SLUG", help="The tenant the token manages.")
        scope.add_argument("--operator", action="store_true",
                           help="A token that sees and manages every tenant.")
        parser.add_argument("--name", required=True, help="What the token is for.")
        parser.add_argument(
            "--scope", choices=SCOPE_ORDER, default=ManagementToken.Scope.FULL,
            help="read: read only; keys: read, and manage projects and API keys (not their "
            "allotments); full (default): "
            "everything a tenant admin (or, with --operator, an operator) may do.")
        life = parser.add_mutually_exclusive_group()
        life.add_argument(
            "--expires-in-days", type=_days, metavar="N",
            help=f"Days until the token stops working (default {DEFAULT_LIFETIME.days}).")
        life.add_argument("--no-expiry", action="store_true",
                          help="A token that never expires (revoke it when done).")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        if not options["tenant"] and not options["operator"]:
            raise CommandError("Give --tenant SLUG or --operator.")
        tenant = tenant_by_slug(options["tenant"]) if options["tenant"] else None
        expires_at: datetime | None | object = DEFAULT_EXPIRY
        if options["no_expiry"]:
            expires_at = None
        elif options["expires_in_days"] is not None:
            expires_at = timezone.now() + timedelta(days=options["expires_in_days"])
        issued = issue_management_token(tenant, name=options["name"], actor=ACTOR,
                                        scope=options["scope"], expires_at=expires_at)
        token = issued.token
        masked = masked_token(token.prefix, token.last4)
        reach = f"tenant {tenant.slug}" if tenant else "every tenant (operator)"
        expiry = token.expires_at.isoformat() if token.expires_at else None
        data = {"token_id": token.public_id, "token": issued.plaintext, "masked": masked,
                "tenant": tenant.slug if tenant else None, "name": token.name,
                "scope": token.scope, "expires_at": expiry}
        text = (
            f"Issued management token {token.public_id} ({masked}) for {reach}, scope "
            f"{token.scope}, {f'expires {expiry}' if expiry else 'never expires'}.\n"
            "Store it now: it is shown only this once.\n"
            f"{issued.plaintext}"
        )
        return data, text
