"""Shared behaviour of the tenants management commands (the leading underscore keeps Django
from listing this module as a command): `--json` prints exactly one JSON object on stdout,
domain and validation errors become a CommandError with the operator-facing message."""

from __future__ import annotations

import dataclasses
import json
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from tenants.exceptions import TenantsError
from tenants.models import Tenant
from tenants.selectors import effective_limits

ACTOR = "cli"


def _validation_message(exc: ValidationError) -> str:
    if hasattr(exc, "error_dict"):
        return "; ".join(
            f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items()
        )
    return " ".join(exc.messages)


def tenant_as_dict(tenant: Tenant) -> dict[str, Any]:
    return {
        "public_id": tenant.public_id,
        "slug": tenant.slug,
        "name": tenant.name,
        "plan": tenant.plan.name,
        "status": tenant.status,
        "effective_limits": dataclasses.asdict(effective_limits(tenant)),
    }


class TenantsCommand(BaseCommand):
    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--json", action="store_true", help="Print the result as one JSON object."
        )

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        """Do the work; return the result as (JSON-able dict, readable text)."""
        raise NotImplementedError(f"{type(self).__module__} must implement run()")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            data, text = self.run(**options)
        except TenantsError as exc:
            raise CommandError(str(exc)) from exc
        except ValidationError as exc:
            raise CommandError(_validation_message(exc)) from exc
        except ValueError as exc:
            # The services raise ValueError only for bad arguments, with a message meant for
            # whoever passed them.
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(data, cls=DjangoJSONEncoder, sort_keys=True))
        else:
            self.stdout.write(text)
