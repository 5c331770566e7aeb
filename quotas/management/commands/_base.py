"""Quota commands share the tenants commands' `--json` and error handling, plus the engine's."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from quotas.engine import QuotaError
from tenants.management.commands._base import TenantsCommand


class QuotaCommand(TenantsCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        try:
            super().handle(*args, **options)
        except QuotaError as exc:
            raise CommandError(str(exc)) from exc
