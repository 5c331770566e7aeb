"""python manage.py reconcile --day YYYY-MM-DD [--source mock|openai|csv --csv FILE]
[--provider-key pk_...] [--tolerance 0.05] [--json]

Compares the ledger with the upstream bill for one UTC day and stores the runs (see
billing/reconciliation.py). The source defaults to settings.TOLLGATE_RECONCILE_SOURCE. A CSV
import makes one run over every provider key (or the one given). Exit status 1 when a run
failed or another reconciliation of the day is running; drift is reported, exit status 0.
"""
from __future__ import annotations

import json
from argparse import ArgumentParser
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from billing.bills import CsvBill
from billing.models import ReconciliationRun
from billing.reconciliation import (
    DayLocked,
    configured_tolerance,
    day_lock,
    reconcile,
    reconcile_configured,
)
from gateway.models import ProviderKey


def run_summary(run: ReconciliationRun) -> dict[str, Any]:
    return {
        "id": run.public_id, "day": run.period_start.isoformat(),
        "period_end": run.period_end.isoformat(), "source": run.source,
        "source_detail": run.source_detail,
        "provider_key": run.provider_key.public_id if run.provider_key else None,
        "status": run.status, "tolerance": str(run.tolerance), "error": run.error,
        "ours": {"input_tokens": run.ours_input_tokens, "output_tokens": run.ours_output_tokens,
                 "cost_micros": run.ours_cost_micros},
        "theirs": {"input_tokens": run.theirs_input_tokens,
                   "output_tokens": run.theirs_output_tokens,
                   "cost_micros": run.theirs_cost_micros},
        "rows": [{
            "day": row.day.isoformat(),
            "provider_key": row.provider_key.public_id if row.provider_key else None,
            "api_key_id": row.api_key_id, "model": row.model,
            "tenant": row.tenant.public_id if row.tenant else None,
            "ours": [row.ours_input, row.ours_output, row.ours_cost_micros],
            "theirs": [row.theirs_input, row.theirs_output, row.theirs_cost_micros],
            "difference": row.difference, "difference_rate": str(row.difference_rate),
            "flagged": row.flagged, "note": row.note,
        } for row in run.rows.select_related("provider_key", "tenant")],
    }


class Command(BaseCommand):
    help = "Reconcile one UTC day of the ledger against the upstream bill and store the runs."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--day", required=True, help="UTC day, YYYY-MM-DD.")
        parser.add_argument("--source", choices=["mock", "openai", "csv"],
                            help="Default: settings.TOLLGATE_RECONCILE_SOURCE.")
        parser.add_argument("--csv", metavar="FILE", help="The bill, with --source csv.")
        parser.add_argument("--provider-key", metavar="PUBLIC_ID", help="Only this key.")
        parser.add_argument("--tolerance", help="Default: TOLLGATE_RECONCILE_TOLERANCE (0.05).")
        parser.add_argument("--json", action="store_true", help="Print the runs as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            day = date.fromisoformat(options["day"])
        except ValueError:
            raise CommandError(f"--day must be YYYY-MM-DD, got {options['day']!r}") from None
        try:
            tolerance = (Decimal(options["tolerance"]) if options["tolerance"] is not None
                         else configured_tolerance())
        except InvalidOperation:
            raise CommandError(f"--tolerance must be a number, got {options['tolerance']!r}") from None
        if not tolerance.is_finite() or not 0 <= tolerance <= 1:
            raise CommandError("--tolerance must be a number in [0, 1], e.g. 0.05")
        source = options["source"] or getattr(settings, "TOLLGATE_RECONCILE_SOURCE", "") or ""
        if not source:
            raise CommandError("no bill source: pass --source, or set TOLLGATE_RECONCILE_SOURCE")
        if (source == "csv") != bool(options["csv"]):
            raise CommandError("--csv FILE goes with --source csv (and only with it)")
        provider_key = None
        if options["provider_key"]:
            provider_key = ProviderKey.objects.filter(public_id=options["provider_key"]).first()
            if provider_key is None:
                raise CommandError(f"no provider key {options['provider_key']!r}")
        try:
            if source == "csv":
                with day_lock(day):
                    runs = [reconcile(day, CsvBill(options["csv"]), tolerance=tolerance,
                                      provider_key=provider_key)]
            else:
                runs = reconcile_configured(day, source, tolerance=tolerance,
                                            provider_key=provider_key)
        except DayLocked as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps([run_summary(run) for run in runs], indent=2))
        else:
            self._print(runs)
        failed = [run for run in runs if run.status == ReconciliationRun.Status.FAILED]
        if failed:
            raise CommandError(f"{len(failed)} run(s) failed: "
                               + "; ".join(f"{run.public_id}: {run.error}" for run in failed))

    def _print(self, runs: list[ReconciliationRun]) -> None:
        if not runs:
            self.stdout.write("No provider key to reconcile for this source.")
        for run in runs:
            key = run.provider_key.public_id if run.provider_key else "every provider key"
            self.stdout.write(f"{run.public_id} {run.period_start} {run.source} {key}: "
                              f"{run.status.upper()} ({run.flagged_count} of {run.rows_count} "
                              f"rows flagged, tolerance {run.tolerance})")
            if run.error:
                self.stdout.write(f"  error: {run.error}")
            for row in run.rows.select_related("provider_key"):
                who = row.provider_key.public_id if row.provider_key else row.api_key_id
                self.stdout.write(
                    f"  {'!' if row.flagged else ' '} {row.day} {who} {row.model}: ours "
                    f"{row.ours_input}+{row.ours_output} theirs {row.theirs_input}+"
                    f"{row.theirs_output} diff {row.difference:+d} ({row.difference_rate:.2%})"
                    + (f" [{row.note}]" if row.note else ""))
