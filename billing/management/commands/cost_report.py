from __future__ import annotations

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.reports import Month, platform_month, tenant_month, to_csv, to_xlsx, usd
from tenants.exceptions import TenantNotFound
from tenants.selectors import tenant_by_slug


class Command(BaseCommand):
    help = ("Write a month's cost report from the ledger: one tenant's (by day, project, key and "
            "model) or, with --all, every tenant's. CSV or XLSX.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("month", help="YYYY-MM")
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--tenant", help="Tenant slug.")
        target.add_argument("--all", action="store_true", help="Every tenant, one row each.")
        parser.add_argument("--format", choices=["csv", "xlsx"], default="csv")
        parser.add_argument("--out", help="File to write (default: standard output, CSV only).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            month = Month.parse(options["month"])
            report = (platform_month(month) if options["all"]
                      else tenant_month(tenant_by_slug(options["tenant"]), month))
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
