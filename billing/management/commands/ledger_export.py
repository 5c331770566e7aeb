from __future__ import annotations

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.reports import Month
from billing.retention import export_month


class Command(BaseCommand):
    help = ("Export one UTC month of the raw ledger (every usage row that ended in it) to CSV, "
            "streamed from PostgreSQL; recorded, so that `ledger_retention` may drop the month's "
            "partition afterwards (billing/retention.py).")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("month", help="YYYY-MM (UTC).")
        parser.add_argument("--out", required=True, help="The CSV file to write.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            month = Month.parse(options["month"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        done = export_month(month, Path(options["out"]))
        self.stdout.write(f"{month}: {done.rows} rows -> {done.path} (sha256 {done.sha256})")
