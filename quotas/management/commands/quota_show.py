from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from quotas import keys
from quotas.engine import UNLIMITED, ScopeLimit
from quotas.limits import tenant_tag
from quotas.management.commands._base import QuotaCommand
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import ApiKey, Project
from tenants.selectors import effective_limits, tenant_by_slug


class Command(QuotaCommand):
    help = "Show a tenant's live quota counters (today and this month) and its open holds."

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant", help="Tenant slug.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant"])
        limits = effective_limits(tenant)
        day, month = WindowKind.DAY, WindowKind.MONTH
        scopes: list[tuple[str, ScopeLimit]] = [
            (tenant.slug, ScopeLimit(keys.tenant_scope(), day, limits.tokens_per_day)),
            (tenant.slug, ScopeLimit(keys.tenant_scope(), month, limits.monthly_token_budget)),
        ]
        for project in Project.objects.filter(tenant=tenant).order_by("slug"):
            limit = UNLIMITED if project.tokens_per_day is None else project.tokens_per_day
            scopes.append((project.slug, ScopeLimit(keys.project_scope(project.pk), day, limit)))
        for api_key in ApiKey.objects.filter(project__tenant=tenant).order_by("public_id"):
            limit = UNLIMITED if api_key.tokens_per_day is None else api_key.tokens_per_day
            scopes.append((api_key.public_id, ScopeLimit(keys.api_key_scope(api_key.pk), day, limit)))
        for model, limit in sorted(limits.model_tokens_per_day.items()):
            scopes.append((model, ScopeLimit(keys.model_scope(model), day, limit)))

        engine = get_engine()
        tag = tenant_tag(tenant.pk)
        rows = []
        for label, scope in scopes:
            snap = engine.counter(tag, scope.scope, scope.window)
            remaining = (UNLIMITED if scope.limit == UNLIMITED
                         else scope.limit + snap.credit - snap.used - snap.pending)
            rows.append({
                "scope": scope.scope, "label": label, "window": scope.window.value, "limit": scope.limit,
                "used": snap.used, "pending": snap.pending, "credit": snap.credit,
                "over": snap.over, "remaining": remaining,
            })
        holds = engine.open_hold_ids(tag)
        data = {"tenant": tenant.slug, "counters": rows, "open_holds": len(holds)}
        header = f"{'scope':<14} {'name':<22} {'window':<6} {'limit':>14} {'used':>14} {'pending':>10} {'remaining':>14}"
        lines = [f"Tenant {tenant.slug} ({limits.plan_name}); open holds: {len(holds)}", header]
        for r in rows:
            limit = "unlimited" if r["limit"] == UNLIMITED else r["limit"]
            remaining = "-" if r["remaining"] == UNLIMITED else r["remaining"]
            lines.append(f"{r['scope']:<14} {r['label']:<22} {r['window']:<6} {limit:>14} {r['used']:>14} "
                         f"{r['pending']:>10} {remaining:>14}")
        return data, "\n".join(lines)
