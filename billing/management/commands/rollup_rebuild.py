"""python manage.py rollup_rebuild [--tenant SLUG] [--day YYYY-MM-DD | --month YYYY-MM] [--force]

Recompute the daily rollup of the ledger (billing.UsageRollup) and its hourly table
(billing.UsageHourly, the hours of the range within the last TOLLGATE_FORECAST_HISTORY_DAYS + 2
days) from its raw rows (billing/rollups.py rebuild): for rows drained before the rollup
existed (migration 0012) or before the hourly table did (0014), or to repair a range that
`verify` reports. Without --day / --month: every day from the first raw row's
to the last one's (UTC, padded a day for the tenants' local days). Each tenant is rebuilt in one
transaction, beside a running drain (see rebuild's docstring).

A day whose raw rows were dropped (retention) but which has rollups is refused unless --force:
the rollup is then all that is left of it, and a rebuild would erase it. After rebuilding, the UTC
rollups of the range are checked against the raw rows (billing.rollups.verify); exit status 1
when they differ.
"""
from __future__ import annotations

from argparse import ArgumentParser
from datetime import date, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Max, Min

from billing.models import UsageRecord
from billing.rollups import RawRowsMissing, rebuild, verify
from tenants.selectors import TenantNotFound, tenant_by_slug


def _range(options: dict[str, Any]) -> tuple[date, date] | None:
    if options["day"] and options["month"]:
        raise CommandError("--day and --month exclude each other")
    try:
        if options["day"]:
            day = date.fromisoformat(options["day"])
            return day, day + timedelta(days=1)
        if options["month"]:
            first = datetime.strptime(options["month"], "%Y-%m").date()
            return first, date(first.year + first.month // 12, first.month % 12 + 1, 1)
    except ValueError as exc:
        raise CommandError(f"--day is YYYY-MM-DD, --month YYYY-MM: {exc}") from None
    bounds = UsageRecord.objects.aggregate(first=Min("ended_at"), last=Max("ended_at"))
    if bounds["first"] is None:
        return None
    return (bounds["first"].date() - timedelta(days=1),
            bounds["last"].date() + timedelta(days=2))


class Command(BaseCommand):
    help = ("Recompute the ledger's daily rollup and hourly table from its raw rows, then check "
            "the daily rollup against them.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--tenant", metavar="SLUG", help="Only this tenant.")
        parser.add_argument("--day", metavar="YYYY-MM-DD", help="Only this day.")
        parser.add_argument("--month", metavar="YYYY-MM", help="Only this month.")
        parser.add_argument("--force", action="store_true",
                            help="Rebuild even days whose raw rows are gone (erases them).")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = None
        if options["tenant"]:
            try:
                tenant = tenant_by_slug(options["tenant"])
            except TenantNotFound:
                raise CommandError(f"no tenant {options['tenant']!r}") from None
        span = _range(options)
        if span is None:
            self.stdout.write("the ledger is empty: nothing to rebuild")
            return
        start, end = span
        try:
            tenants = rebuild(start, end, tenant=tenant, force=options["force"])
        except RawRowsMissing as exc:
            raise CommandError(f"{exc}; --force rebuilds (erases) them anyway") from None
        mismatches = verify(start, end, tenant_id=tenant.pk if tenant else None)
        self.stdout.write(f"rebuilt days {start}..{end - timedelta(days=1)} of {tenants} "
                          f"tenant(s); {len(mismatches)} mismatch(es) with the raw rows")
        for m in mismatches[:50]:
            self.stdout.write(f"  tenant {m.tenant_id} {m.day} {m.served_model} {m.status}"
                              f"{' corrected' if m.corrected else ''} {m.field}: rollup "
                              f"{m.rollup}, raw {m.raw}")
        if mismatches:
            raise CommandError("the rollup differs from the raw rows")
