from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from quotas.cycles import schedule_for
from quotas.engine import UNLIMITED
from quotas.keys import tenant_tag
from quotas.limits import project_counter, tenant_counter
from quotas.management.commands._base import QuotaCommand
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.allotments import tenant_allotments
from tenants.selectors import effective_limits, project_by_slug, tenant_by_slug
from tenants.services import record_audit_event


class Command(QuotaCommand):
    help = (
        "Top up a tenant's (or one project's) quota for the current day or cycle ('month': the "
        "tenant's cycle window, e.g. a calendar month, a day on the free plan, a month from its "
        "billing day). The credit belongs to that window only and goes away with it."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant", help="Tenant slug.")
        parser.add_argument("tokens", type=int, help="Tokens to add (>= 1).")
        parser.add_argument("--window", choices=["day", "month"], default="day")
        parser.add_argument("--project", help="Project slug: top up this project instead.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant"])
        window = WindowKind(options["window"])
        limits = effective_limits(tenant)
        pool = False
        if options["project"]:
            counter = project_counter(project_by_slug(tenant, options["project"]), window)
        else:
            counter = tenant_counter(tenant, limits, window)
            # With allotments, the top-up goes to the shared pool too: every scope may use it.
            pool = tenant_allotments(tenant, limits=limits)[window.value].allotted > 0
        scope = counter.scope
        # In the tenant's windows (its day and cycle in its time zone), as the gateway counts.
        result = get_engine().recharge(tenant_tag(tenant.pk), counter.scope_limit,
                                       options["tokens"], pool=pool,
                                       schedule=schedule_for(tenant))
        record_audit_event(
            tenant=tenant, actor="cli", action="quota.recharged", target=tenant.public_id,
            data={"scope": scope, "window": result.window.id, "tokens": options["tokens"]},
        )
        data = {"tenant": tenant.slug, "scope": scope, "window": result.window.id,
                "credit": result.credit, "remaining": result.remaining}
        remaining = "unlimited" if result.remaining == UNLIMITED else result.remaining
        text = (f"Added {options['tokens']} tokens to {scope} for {result.window.id}: "
                f"credit {result.credit}, remaining {remaining}.")
        return data, text
