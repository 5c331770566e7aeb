from __future__ import annotations

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.reports import Month, platform_month, tenant_period, to_csv, to_xlsx, usd
from quotas.cycles import recent_cycle_windows
from tenants.exceptions import TenantNotFound
from tenants.selectors import tenant_by_slug


class Command(BaseCommand):
    help = ("Write a cost report from the ledger: one tenant's (by day, project, key and model) "
            "of one of its cycle windows or a calendar month in its time zone, or, with --all, "
            "every tenant's of a UTC month. CSV or XLSX. --cycles lists a tenant's recent cycle "
            "windows (their ids are what to ask for).")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("period", nargs="?",
                            help="YYYY-MM, or a tenant's cycle window id (m2026-12, c2026-12-15, "
                                 "c2026-12-15@1765843200).")
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--tenant", help="Tenant slug.")
        target.add_argument("--all", action="store_true", help="Every tenant, one row each.")
        parser.add_argument("--cycles", action="store_true",
                            help="List the tenant's last 12 cycle windows instead.")
        parser.add_argument("--format", choices=["csv", "xlsx"], default="csv")
        parser.add_argument("--out", help="File to write (default: standard output, CSV only).")

    def handle(self, *args: Any, **options: Any) -> None:
        period = options["period"]
        try:
            if options["cycles"]:
                if not options["tenant"]:
                    raise ValueError("--cycles lists one tenant's windows: give --tenant")
                for span in recent_cycle_windows(tenant_by_slug(options["tenant"])):
                    self.stdout.write(f"{span.id:<26} {span.label}")
                return
            if not period:
                raise ValueError("give a period: YYYY-MM or a cycle window id (see --cycles)")
            report = (platform_month(Month.parse(period)) if options["all"]
                      else tenant_period(tenant_by_slug(options["tenant"]), period))
        except (ValueError, TenantNotFound) as exc:
            raise CommandError(str(exc)) from exc
        data = to_xlsx(report) if options["format"] == "xlsx" else to_csv(report)
        if options["out"]:
            Path(options["out"]).write_bytes(data)
            self.stdout.write(f"Wrote {report.title}: {len(report.rows)} rows, total "
                              f"{usd(report.cost_micros)} USD to {options['out']}")
        elif options["format"] == "xlsx":
            raise CommandError("XLSX needs --out FILE")
        else:
            self.stdout.write(data.decode(), ending="")
