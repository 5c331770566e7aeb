from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from quotas import keys
from quotas.engine import UNLIMITED
from quotas.management.commands._base import QuotaCommand
from quotas.status import quota_status
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits, tenant_by_slug


def _scope_names(tenant: Tenant) -> dict[tuple[str, str], str]:
    """(kind, public ref) -> the counter's scope name in Redis, which operators grep for."""
    names = {("tenant", tenant.public_id): keys.tenant_scope()}
    for pk, public_id in Project.objects.filter(tenant=tenant).values_list("pk", "public_id"):
        names[("project", public_id)] = keys.project_scope(pk)
    for pk, public_id in ApiKey.objects.filter(project__tenant=tenant).values_list(
        "pk", "public_id"
    ):
        names[("key", public_id)] = keys.api_key_scope(pk)
    return names


class Command(QuotaCommand):
    help = "Show a tenant's live quota counters (today and this month) and its open holds."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant", help="Tenant slug.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant"])
        # The same picture as the console and the API (quotas.status): one Redis round trip.
        status = quota_status(tenant)
        names = _scope_names(tenant)
        rows = [
            {
                "scope": keys.model_scope(s.ref) if s.kind == "model" else names[(s.kind, s.ref)],
                "kind": s.kind, "id": s.ref, "label": s.label, "window": s.window,
                "limit": s.limit, "used": s.used, "pending": s.pending, "credit": s.credit,
                "remaining": s.remaining,
            }
            for s in status.scopes
        ]
        data = {"tenant": tenant.slug, "counters": rows, "open_holds": status.open_holds}
        header = (f"{'scope':<14} {'name':<22} {'window':<6} {'limit':>14} {'used':>14} "
                  f"{'pending':>10} {'remaining':>14}")
        plan_name = effective_limits(tenant).plan_name
        lines = [f"Tenant {tenant.slug} ({plan_name}); open holds: {status.open_holds}", header]
        for r in rows:
            limit = "unlimited" if r["limit"] == UNLIMITED else r["limit"]
            remaining = "-" if r["remaining"] == UNLIMITED else r["remaining"]
            lines.append(f"{r['scope']:<14} {r['label']:<22} {r['window']:<6} {limit:>14} "
                         f"{r['used']:>14} {r['pending']:>10} {remaining:>14}")
        return data, "\n".join(lines)
