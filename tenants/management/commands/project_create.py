from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.selectors import tenant_by_slug
from tenants.services.projects import create_project


class Command(TenantsCommand):
    help = "Create a project inside a tenant."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant_slug")
        parser.add_argument("project_slug")
        parser.add_argument("--name", default="", help="Display name (default: the slug).")
        parser.add_argument(
            "--tokens-per-day", type=int, help="Daily token sub-limit inside the tenant's."
        )
        parser.add_argument(
            "--allotment-tokens-per-day", type=int,
            help="Tokens per day reserved for the project alone out of the tenant's daily quota.",
        )
        parser.add_argument(
            "--allotment-tokens-per-month", type=int,
            help="Tokens per cycle (the tenant's month) reserved for the project alone out of "
            "the tenant's cycle token budget.",
        )

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant_slug"])
        project = create_project(
            tenant,
            options["project_slug"],
            actor=ACTOR,
            name=options["name"],
            tokens_per_day=options["tokens_per_day"],
            allotment_tokens_per_day=options["allotment_tokens_per_day"],
            allotment_tokens_per_month=options["allotment_tokens_per_month"],
        )
        data = {
            "public_id": project.public_id,
            "tenant": tenant.slug,
            "slug": project.slug,
            "name": project.name,
            "tokens_per_day": project.tokens_per_day,
            "tokens_per_month": project.tokens_per_month,
            "allotment_tokens_per_day": project.allotment_tokens_per_day,
            "allotment_tokens_per_month": project.allotment_tokens_per_month,
        }
        sub_limit = (
            "no daily sub-limit"
            if project.tokens_per_day is None
            else f"{project.tokens_per_day} tokens/day"
        )
        allotments = [f"{value:,} tokens {per} allotted"
                      for value, per in ((project.allotment_tokens_per_day, "a day"),
                                         (project.allotment_tokens_per_month, "a cycle"))
                      if value is not None]
        text = (f"Created project {tenant.slug}/{project.slug} ({project.public_id}), "
                f"{', '.join([sub_limit, *allotments])}.")
        return data, text
