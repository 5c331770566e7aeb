from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.selectors import project_by_slug, tenant_by_slug
from tenants.services.api_keys import issue_key


class Command(TenantsCommand):
    help = "Issue an API key for a project. The key is printed once and never stored."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant_slug")
        parser.add_argument("project_slug")
        parser.add_argument("--name", default="", help="A label for the key.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant_slug"])
        project = project_by_slug(tenant, options["project_slug"])
        issued = issue_key(project, actor=ACTOR, name=options["name"])
        data = {
            "key_id": issued.api_key.public_id,
            "key": issued.plaintext,
            "masked": issued.masked,
            "tenant": tenant.slug,
            "project": project.slug,
            "name": issued.api_key.name,
        }
        text = (
            f"Issued API key {issued.api_key.public_id} ({issued.masked}) "
            f"for {tenant.slug}/{project.slug}.\n"
            "Store it now: it is shown only this once.\n"
            f"{issued.plaintext}"
        )
        return data, text
