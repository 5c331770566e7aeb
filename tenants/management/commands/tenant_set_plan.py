from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.allotments import over_quota_warnings
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
        switch_before = tenant.cycle_changes_at
        change_plan(tenant, options["plan"], actor=ACTOR)
        # A lower quota is not refused for the allotments it leaves above it: say so.
        warnings = over_quota_warnings(tenant)
        # A plan with another reset cycle takes over when the current cycle window ends.
        switch = tenant.cycle_changes_at if tenant.cycle_changes_at != switch_before else None
        data = {**tenant_as_dict(tenant), "previous_plan": previous,
                "allotment_warnings": warnings, "cycle_changes_at": switch}
        text = (
            f"Tenant {tenant.slug} moved from plan {previous} to {tenant.plan.name}."
            if previous != tenant.plan.name
            else f"Tenant {tenant.slug} is already on plan {previous}; nothing changed."
        )
        lines = [text]
        if switch is not None:
            lines.append(f"Its windows follow the new plan's reset cycle from "
                         f"{switch:%Y-%m-%d %H:%M %Z} (its current window finishes first).")
        return data, "\n".join([*lines, *(f"Warning: {w}" for w in warnings)])
