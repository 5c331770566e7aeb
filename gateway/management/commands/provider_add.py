"""Add an upstream provider key. The secret is read from an environment variable, never from the
command line, where it would land in shell history and in every process listing."""

from __future__ import annotations

import json
import os
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from gateway.models import ProviderKey, ProviderKind
from gateway.prices import Price
from gateway.providers import create_provider_key
from tenants.models import Tenant

ACTOR = "cli"


def _model_list(raw: str) -> list[str]:
    return [name.strip() for name in raw.split(",") if name.strip()]


def _default_price(raw: str | None) -> Price | None:
    if raw is None:
        return None
    try:
        input_price, output_price = (int(part) for part in raw.split(","))
    except ValueError:
        raise CommandError("--default-price takes IN,OUT: two integers, micro-dollars per "
                           "million input and output tokens (e.g. 2500000,10000000).") from None
    return Price(input_price, output_price)


def _validation_message(exc: ValidationError) -> str:
    if hasattr(exc, "error_dict"):
        return "; ".join(f"{name}: {' '.join(errs)}" for name, errs in exc.message_dict.items())
    return " ".join(exc.messages)


def provider_key_as_dict(provider_key: ProviderKey) -> dict[str, Any]:
    return {
        "public_id": provider_key.public_id,
        "name": provider_key.name,
        "kind": provider_key.kind,
        "base_url": provider_key.base_url,
        "secret_last4": provider_key.secret_last4,
        "models": provider_key.models,
        "rpm_capacity": provider_key.rpm_capacity,
        "tpm_capacity": provider_key.tpm_capacity,
        "priority": provider_key.priority,
        "enabled": provider_key.enabled,
        "tenant": provider_key.tenant.slug if provider_key.tenant else None,
        "default_price": (None if provider_key.default_input_price_micros_per_mtok is None else
                          [provider_key.default_input_price_micros_per_mtok,
                           provider_key.default_output_price_micros_per_mtok]),
    }


class Command(BaseCommand):
    help = ("Add an upstream provider key (an OpenAI-compatible or Anthropic API and its "
            "secret).")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--base-url", required=True,
                            help="The API root with its version path, e.g. "
                            "https://api.openai.com/v1 or https://api.anthropic.com/v1")
        parser.add_argument(
            "--kind", choices=ProviderKind.values, default=ProviderKind.OPENAI.value,
            help="The API the key speaks: openai (OpenAI-compatible: chat, completions, "
            "embeddings, responses, moderations) or anthropic (the Messages API). "
            "Default: openai.")
        parser.add_argument(
            "--secret-env",
            required=True,
            metavar="VAR",
            help="Name of the environment variable that holds the secret.",
        )
        parser.add_argument(
            "--models", default="", help="Comma-separated model names (default: every model)."
        )
        parser.add_argument("--rpm", type=int, help="Upstream requests-per-minute capacity.")
        parser.add_argument("--tpm", type=int, help="Upstream tokens-per-minute capacity.")
        parser.add_argument(
            "--priority", type=int, default=0, help="Higher is tried first (default 0)."
        )
        parser.add_argument("--tenant", metavar="SLUG", help="Dedicate the key to this tenant.")
        parser.add_argument(
            "--default-price", metavar="IN,OUT",
            help="Micro-dollars per million input and output tokens for models with no price of "
            "their own (default: such models are refused, model_not_priced).",
        )
        parser.add_argument(
            "--json", action="store_true", help="Print the result as one JSON object."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        secret = os.environ.get(options["secret_env"], "")
        if not secret.strip():
            raise CommandError(f"Environment variable {options['secret_env']} is unset or empty.")
        default_price = _default_price(options["default_price"])
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(slug=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"No tenant with slug {options['tenant']!r}.")
        try:
            provider_key = create_provider_key(
                options["name"],
                base_url=options["base_url"],
                secret=secret,
                models=_model_list(options["models"]),
                rpm_capacity=options["rpm"],
                tpm_capacity=options["tpm"],
                priority=options["priority"],
                tenant=tenant,
                default_price=default_price,
                kind=options["kind"],
                actor=ACTOR,
            )
        except ValidationError as exc:
            raise CommandError(_validation_message(exc)) from exc
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        data = provider_key_as_dict(provider_key)
        if options["json"]:
            self.stdout.write(json.dumps(data, sort_keys=True))
            return
        models = ", ".join(provider_key.models) or "every model"
        owner = f", dedicated to {tenant.slug}" if tenant else ""
        self.stdout.write(
            f"Added {provider_key.kind} provider key {provider_key.public_id} "
            f"({provider_key.name}) for {provider_key.base_url}: {models}{owner}."
        )
