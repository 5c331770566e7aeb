from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand, tenant_as_dict
from tenants.services.tenants import create_tenant


class Command(TenantsCommand):
    help = "Create a tenant on a plan, optionally overriding the plan's limits."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("slug")
        parser.add_argument("--plan", required=True, help="Plan name: free, standard, ...")
        parser.add_argument("--name", default="", help="Display name (default: the slug).")
        parser.add_argument(
            "--tokens-per-day", type=int, help="Override the plan's daily tokens (-1: unlimited)."
        )
        parser.add_argument(
            "--rps", type=int, help="Override the plan's requests per second (-1: unlimited)."
        )

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        overrides = {
            field: options[option]
            for field, option in (
                ("tokens_per_day", "tokens_per_day"),
                ("requests_per_second", "rps"),
            )
            if options[option] is not None
        }
        tenant = create_tenant(
            options["slug"],
            plan_name=options["plan"],
            actor=ACTOR,
            name=options["name"],
            **overrides,
        )
        data = tenant_as_dict(tenant)
        limits = data["effective_limits"]
        text = (
            f"Created tenant {tenant.slug} ({tenant.public_id}) on plan {tenant.plan.name}: "
            f"{limits['tokens_per_day']} tokens/day, {limits['requests_per_second']} requests/s "
            "(-1 = unlimited)."
        )
        return data, text
