from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.invitation_links import invitation_link
from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.membership import INVITABLE_ROLES, invite_member
from tenants.models import Membership
from tenants.selectors import tenant_by_slug

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class Command(TenantsCommand):
    help = (
        "Invite someone to a tenant's console: emails them a link (through Django's mail "
        "settings) and prints it once, so it can be shared when mail is not configured."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant_slug")
        parser.add_argument("email")
        parser.add_argument("--role", choices=INVITABLE_ROLES, default=Membership.Role.ADMIN)
        parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                            help=f"Where the console is served (default {DEFAULT_BASE_URL}).")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant_slug"])
        base = options["base_url"].rstrip("/")
        issued = invite_member(
            tenant, options["email"], role=options["role"], actor=ACTOR,
            accept_url=lambda secret: invitation_link(base, secret),
        )
        invitation = issued.invitation
        data = {
            "invitation_id": invitation.public_id,
            "tenant": tenant.slug,
            "email": invitation.email,
            "role": invitation.role,
            "expires_at": invitation.expires_at,
            "accept_url": issued.accept_url,
            "email_sent": issued.email_sent,
        }
        mailed = "Emailed" if issued.email_sent else "Could not email"
        text = (
            f"Invited {invitation.email} to {tenant.slug} as {invitation.role} "
            f"({invitation.public_id}, expires {invitation.expires_at:%Y-%m-%d %H:%M} UTC).\n"
            f"{mailed} the link; it is shown only this once and works once:\n"
            f"{issued.accept_url}"
        )
        return data, text
