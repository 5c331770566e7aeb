from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand, tenant_as_dict
from tenants.selectors import tenant_by_slug
from tenants.services.tenants import change_plan


class Command(TenantsCommand):
    help = "Move a tenant to another plan (its own overrides are kept)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant_slug")
        parser.add_argument("plan")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant_slug"])
        previous = tenant.plan.name
        change_plan(tenant, options["plan"], actor=ACTOR)
        data = {**tenant_as_dict(tenant), "previous_plan": previous}
        text = (
            f"Tenant {tenant.slug} moved from plan {previous} to {tenant.plan.name}."
            if previous != tenant.plan.name
            else f"Tenant {tenant.slug} is already on plan {previous}; nothing changed."
        )
        return data, text
