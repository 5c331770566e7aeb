from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.retention import apply_retention


class Command(BaseCommand):
    help = ("Drop the raw ledger's month partitions older than TOLLGATE_LEDGER_RETENTION_MONTHS "
            "(or --keep-months), each only once its UTC rollups match its raw rows and it was "
            "exported (`ledger_export`; TOLLGATE_LEDGER_EXPORT_DIR exports it first). Exits 1 "
            "when a month was refused.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="Check and say what would be dropped; drop nothing.")
        parser.add_argument("--keep-months", type=int,
                            help="Override TOLLGATE_LEDGER_RETENTION_MONTHS (0: keep all).")
        parser.add_argument("--force", action="store_true",
                            help="Drop a verified month that was not exported (the rollup "
                                 "check is never skipped).")

    def handle(self, *args: Any, **options: Any) -> None:
        keep = options["keep_months"]
        if keep is not None and keep < 0:
            raise CommandError("--keep-months must be >= 0")
        outcomes = apply_retention(keep_months=keep, dry_run=options["dry_run"],
                                   force=options["force"])
        if not outcomes:
            self.stdout.write("nothing to drop")
        for outcome in outcomes:
            self.stdout.write(str(outcome))
        if any(o.action == "refused" for o in outcomes):
            raise CommandError("some months were refused (above); nothing of them was dropped")
