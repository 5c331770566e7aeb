from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from quotas.keys import tenant_tag
from quotas.management.commands._base import QuotaCommand
from quotas.runtime import get_engine
from tenants.models import Tenant
from tenants.selectors import tenant_by_slug


class Command(QuotaCommand):
    help = (
        "Release holds older than the stale threshold (QUOTA_STALE_HOLD_SECONDS), for the given "
        "tenants or all of them. The Celery beat job runs the same sweep every minute."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenants", nargs="*", help="Tenant slugs (default: every tenant).")
        parser.add_argument("--stale-seconds", type=int, default=None,
                            help="Override the stale threshold for this run.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        if options["stale_seconds"] is not None and options["stale_seconds"] < 0:
            raise ValueError("--stale-seconds must be >= 0")
        tenants = ([tenant_by_slug(s) for s in options["tenants"]] if options["tenants"]
                   else list(Tenant.objects.order_by("slug")))
        engine = get_engine()
        per_tenant = {}
        for tenant in tenants:
            result = engine.sweep(tenant_tag(tenant.pk), stale_s=options["stale_seconds"],
                                  max_batches=1000)
            per_tenant[tenant.slug] = {
                "swept": len(result.swept), "tokens_released": sum(h.amount for h in result.swept),
                # What the holds knew of their calls (see lua/sweep.lua): charged, not released.
                "tokens_charged": sum(h.charged for h in result.swept),
            }
        total = sum(v["swept"] for v in per_tenant.values())
        data = {"swept": total, "tenants": per_tenant}
        return data, f"Swept {total} stale holds across {len(tenants)} tenants."
