from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from quotas.cycles import cycle_standing
from quotas.engine import UNLIMITED
from quotas.management.commands._base import QuotaCommand
from quotas.status import quota_status
from tenants.selectors import effective_limits, tenant_by_slug


class Command(QuotaCommand):
    help = ("Show a tenant's live quota counters (today and its current cycle window) and its "
            "open holds, with its cycle and any pending change.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant", help="Tenant slug.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant"])
        # The same picture as the console and the API (quotas.status): one Redis round trip.
        # The scope is the counter's name in Redis, which operators grep for.
        status = quota_status(tenant)
        rows = [
            {
                "scope": s.redis_scope,
                "kind": s.kind, "id": s.ref, "label": s.label, "window": s.window,
                "limit": s.limit, "used": s.used, "pending": s.pending, "credit": s.credit,
                "remaining": s.remaining,
            }
            for s in status.scopes
        ]
        cycle = cycle_standing(tenant)
        data = {"tenant": tenant.slug, "cycle": cycle.as_dict(), "counters": rows,
                "open_holds": status.open_holds}
        header = (f"{'scope':<14} {'name':<22} {'window':<6} {'limit':>14} {'used':>14} "
                  f"{'pending':>10} {'remaining':>14}")
        plan_name = effective_limits(tenant).plan_name
        lines = [f"Tenant {tenant.slug} ({plan_name}); open holds: {status.open_holds}",
                 f"Cycle: {cycle.description}; day {cycle.day.label}; 'month' window "
                 f"{cycle.window.label}"]
        if cycle.pending is not None and cycle.changes_at is not None:
            lines.append(f"Pending: {cycle.pending_description} ({cycle.pending.zone}) from "
                         f"{cycle.changes_at:%Y-%m-%d %H:%M %Z}")
        lines.append(header)
        for r in rows:
            limit = "unlimited" if r["limit"] == UNLIMITED else r["limit"]
            remaining = "-" if r["remaining"] == UNLIMITED else r["remaining"]
            lines.append(f"{r['scope']:<14} {r['label']:<22} {r['window']:<6} {limit:>14} "
                         f"{r['used']:>14} {r['pending']:>10} {remaining:>14}")
        return data, "\n".join(lines)
