"""python manage.py quota_rebuild [--tenant SLUG ...] [--all] [--json]

Rebuild quota counters of the current windows from the ledger (billing/rebuild.py).

Without arguments: every tenant whose epoch marker is missing (Redis lost its data), which is
what the gateway and the beat job would do on their own. With --tenant: those tenants even if
their marker is present, e.g. after a failover to a replica that had not caught up (the marker
survived, some counters went back). --all does that for every tenant. A rebuild never lowers a
counter: used = max(what Redis has, what the ledger says).

Exit status 1 when a tenant could not be rebuilt because another process is rebuilding it.
"""
from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import CommandError

from billing.rebuild import RebuildResult, lost_tenants, rebuild_tenant
from quotas.keys import tenant_tag
from quotas.management.commands._base import QuotaCommand
from quotas.runtime import get_engine
from tenants.models import Tenant
from tenants.selectors import tenant_by_slug


class Command(QuotaCommand):
    help = ("Rebuild the current day's, month's and minute's quota counters from the ledger, for "
            "tenants whose Redis data was lost (default), the given tenants, or all of them.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--tenant", action="append", default=[], metavar="SLUG",
                            help="Rebuild this tenant even if its epoch marker is present "
                            "(repeatable).")
        parser.add_argument("--all", action="store_true",
                            help="Rebuild every tenant, whether or not its marker is present.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        if options["tenant"] and options["all"]:
            raise ValueError("--tenant and --all exclude each other")
        engine = get_engine()
        force = bool(options["tenant"] or options["all"])
        if options["tenant"]:
            tenants = [tenant_by_slug(slug) for slug in options["tenant"]]
        else:
            tenants = list(Tenant.objects.order_by("slug"))
            if not options["all"]:
                lost = set(lost_tenants(engine, [t.pk for t in tenants]))
                tenants = [t for t in tenants if t.pk in lost]
        results: dict[str, RebuildResult] = {
            t.slug: rebuild_tenant(tenant_tag(t.pk), force=force, engine=engine) for t in tenants}
        busy = sorted(slug for slug, r in results.items() if not r.rebuilt)
        data = {"tenants": {slug: {"rebuilt": r.rebuilt, "counters": r.counters,
                                   "raised": r.raised, "ledger_rows": r.ledger_rows,
                                   "pending_events": r.pending_events,
                                   "already_intact": r.already_intact}
                            for slug, r in results.items()},
                "busy": busy}
        if busy:
            raise CommandError("another process is rebuilding " + ", ".join(busy)
                               + "; run again in a moment")
        lines = [f"{slug}: {r.counters} counters from {r.ledger_rows} ledger rows and "
                 f"{r.pending_events} pending events ({r.raised} raised)"
                 for slug, r in results.items()]
        text = "\n".join(lines) if lines else "No tenant has lost its quota counters."
        return data, text
