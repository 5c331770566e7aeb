"""manage.py tenant_cycle <slug> [--cycle ...] [--anchor ...] [--every-days N] [--time-zone ...]

Shows a tenant's cycle (the current day and cycle windows, and a pending change), or changes it
through quotas.cycles.change_cycle: the current window finishes on the old cycle (at once for a
tenant that counted nothing in it). Options not given keep what the tenant last asked for; a new
--cycle starts without the old anchor and number of days."""
from __future__ import annotations

from argparse import ArgumentParser
from datetime import date
from typing import Any

from quotas.cycles import (
    change_cycle,
    cycle_standing,
    describe_change,
    merged_spec,
)
from quotas.management.commands._base import QuotaCommand
from tenants.selectors import tenant_by_slug

_CYCLES = {"plan": "", "monthly": "monthly", "weekly": "weekly", "days": "days"}


def _date(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"an anchor is a date, YYYY-MM-DD, not {text!r}") from None


class Command(QuotaCommand):
    help = ("Show or change a tenant's reset cycle and time zone (the current window finishes "
            "on the old cycle).")

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("tenant", help="Tenant slug.")
        parser.add_argument("--cycle", choices=sorted(_CYCLES),
                            help="plan: the plan's cycle; monthly from the anchor's day; weekly "
                                 "from the anchor's weekday; days: every N days from the anchor "
                                 "(plans that allow a cycle of the tenant's own).")
        parser.add_argument("--anchor", help="YYYY-MM-DD (monthly: 29-31 end on a shorter "
                                             "month's last day).")
        parser.add_argument("--every-days", type=int, help="N, for --cycle days (1-366).")
        parser.add_argument("--time-zone", help="IANA time zone, e.g. Europe/Paris.")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        tenant = tenant_by_slug(options["tenant"])
        given = frozenset(name for name, option in (
            ("cycle", "cycle"), ("anchor", "anchor"), ("every_days", "every_days"),
            ("time_zone", "time_zone")) if options.get(option) is not None)
        lines = []
        data: dict[str, Any] = {"tenant": tenant.slug}
        if given:
            spec = merged_spec(
                tenant, cycle=_CYCLES[options["cycle"]] if options.get("cycle") else None,
                anchor=_date(options["anchor"]) if options.get("anchor") else None,
                every_days=options.get("every_days"), time_zone=options.get("time_zone"),
                given=given)
            done = change_cycle(tenant, cycle=spec.cycle, anchor=spec.anchor,
                                every_days=spec.every_days, time_zone=spec.time_zone,
                                actor="cli")
            data["change"] = {**done.audit(), "changed": done.writes}
            lines.append(describe_change(done))
            tenant.refresh_from_db()
        standing = cycle_standing(tenant)
        data["cycle"] = standing.as_dict()
        lines.append(f"Tenant {tenant.slug}: {standing.description} ({standing.cycle.zone}); "
                     f"current window {standing.window.label} [{standing.window.id}]; today "
                     f"{standing.day.label}.")
        if standing.pending is not None and standing.changes_at is not None:
            lines.append(f"Pending: {standing.pending_description} ({standing.pending.zone}) "
                         f"from {standing.changes_at:%Y-%m-%d %H:%M %Z}.")
        return data, "\n".join(lines)
