"""manage.py demo_setup: the quick start's data (`make up` runs it). A gateway command because it
sets up both sides of a call: the tenant's side through the tenants services, and the supply side
(the mock upstream's provider key and its default price) through the gateway's."""

from __future__ import annotations

import secrets
from argparse import ArgumentParser
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from gateway.models import ProviderKey, ProviderKind
from gateway.prices import Price
from gateway.providers import create_provider_key, normalize_base_url, update_provider_key
from tenants.management.commands._base import ACTOR, TenantsCommand
from tenants.models import ApiKey, AuditEvent, Membership, Project, Tenant
from tenants.selectors import masked_key
from tenants.services import create_project, create_tenant, issue_key

DEMO_TENANT = "demo"
DEMO_PROJECT = "default"
DEMO_ADMIN = "admin"
# The console's login for the quick start: a plain user (not staff) who owns the demo tenant,
# so the console shows what a tenant admin sees.
DEMO_CONSOLE_USER = "demo"
DEFAULT_CONSOLE_URL = "http://127.0.0.1:8000/console/"
# The mock serves any model name, including its fault-injection suffixes ("gpt-4o@cut=3"), which
# have no price of their own: its provider key names one (gpt-4o's list price) so that they are
# metered like a real model instead of refused (model_not_priced).
MOCK_DEFAULT_PRICE = Price(2_500_000, 10_000_000)
# The mock speaks the Messages API too (/v1/messages): a second key of the anthropic kind, so that
# Anthropic clients work out of the box. Its own secret: the mock's bill names keys by their
# secret, and reconciliation could not tell two keys with one secret apart. Its default price
# (claude-sonnet-4-5's list price) meters the mock's fault-injection names of Claude models.
MOCK_ANTHROPIC_NAME = "mock-anthropic"
MOCK_ANTHROPIC_SECRET = "sk-mock-anthropic-local"
MOCK_ANTHROPIC_DEFAULT_PRICE = Price(3_000_000, 15_000_000)


def _price_the_mock(base_url: str) -> None:
    """A mock provider key made by an earlier setup, before unpriced models were refused: give it
    the default price too, or the mock's fault-injection models would stop working after an
    upgrade. A price an operator set is kept."""
    for key in ProviderKey.objects.filter(name="mock", base_url=base_url,
                                          default_input_price_micros_per_mtok__isnull=True):
        key.default_input_price_micros_per_mtok = MOCK_DEFAULT_PRICE.input_micros_per_mtok
        key.default_output_price_micros_per_mtok = MOCK_DEFAULT_PRICE.output_micros_per_mtok
        update_provider_key(key, ["default_input_price_micros_per_mtok",
                                  "default_output_price_micros_per_mtok"], actor=ACTOR)


def _had_anthropic_key() -> bool:
    """Whether this installation ever had an anthropic-kind provider key: one exists, or the
    audit trail (which outlives deleted keys) records one created (the demo's mock-anthropic or an
    operator's). Such an installation does not predate the Messages API."""
    return (ProviderKey.objects.filter(kind=ProviderKind.ANTHROPIC).exists()
            or AuditEvent.objects.filter(action="provider_key.create",
                                         data__kind=ProviderKind.ANTHROPIC.value).exists())


def _anthropic_mock(base_url: str, *, first_setup: bool) -> ProviderKey | None:
    """The mock's anthropic-kind key, offered once: made at the first setup, or at a later one
    whose earlier setup made the mock's OpenAI key but predates the Messages API; never on an
    installation that has (or ever had) an anthropic-kind key, so a mock-anthropic an operator
    deleted stays deleted."""
    if _had_anthropic_key():
        return None
    if not first_setup and not ProviderKey.objects.filter(name="mock", base_url=base_url).exists():
        return None  # an operator's own keys: the demo adds no upstream to them
    return create_provider_key(MOCK_ANTHROPIC_NAME, base_url=base_url,
                               secret=MOCK_ANTHROPIC_SECRET, kind=ProviderKind.ANTHROPIC.value,
                               default_price=MOCK_ANTHROPIC_DEFAULT_PRICE, actor=ACTOR)


class Command(TenantsCommand):
    help = (
        "Create (once) the demo tenant, project, API key, a console user who owns the tenant and "
        "a Django admin user for a first local run, and with --mock-upstream two provider keys "
        "for the mock upstream (OpenAI-compatible and Anthropic). Secrets and passwords are "
        "printed only when created (only their hashes are stored); later runs show the masked "
        "key."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--mock-upstream", metavar="URL",
                            help="Base URL of the mock upstream (e.g. http://127.0.0.1:8099/v1): "
                            "registered as the provider keys 'mock' (openai kind) and "
                            "'mock-anthropic' (anthropic kind) if no provider key exists "
                            "('mock-anthropic' only if no anthropic-kind key ever existed).")
        parser.add_argument("--console-url", default=DEFAULT_CONSOLE_URL,
                            help=f"The console's address to print (default {DEFAULT_CONSOLE_URL}).")

    def run(self, **options: Any) -> tuple[dict[str, Any], str]:
        provider = anthropic = None
        if options.get("mock_upstream") and not ProviderKey.objects.exists():
            # The mock accepts any bearer token; this one is not a secret of anybody's.
            provider = create_provider_key("mock", base_url=options["mock_upstream"],
                                           secret="sk-mock-upstream-local",
                                           default_price=MOCK_DEFAULT_PRICE, actor=ACTOR)
            anthropic = _anthropic_mock(provider.base_url, first_setup=True)
        elif options.get("mock_upstream"):
            base_url = normalize_base_url(options["mock_upstream"])
            _price_the_mock(base_url)
            anthropic = _anthropic_mock(base_url, first_setup=False)
        with transaction.atomic():
            tenant = Tenant.objects.filter(slug=DEMO_TENANT).first() or create_tenant(
                DEMO_TENANT, plan_name="standard", actor=ACTOR, name="Demo tenant"
            )
            project = Project.objects.filter(tenant=tenant, slug=DEMO_PROJECT).first() or (
                create_project(tenant, DEMO_PROJECT, actor=ACTOR, name="Default project")
            )
            api_key = ApiKey.objects.filter(project=project, revoked_at=None).first()
            plaintext = None
            if api_key is None:
                issued = issue_key(project, actor=ACTOR, name="demo key")
                api_key, plaintext = issued.api_key, issued.plaintext
            password = None
            user_model = get_user_model()
            admin = user_model.objects.filter(username=DEMO_ADMIN).first()
            if admin is None:
                password = secrets.token_urlsafe(12)
                admin = user_model.objects.create_superuser(DEMO_ADMIN, "", password)
            Membership.objects.get_or_create(
                user=admin, tenant=tenant, defaults={"role": Membership.Role.OWNER}
            )
            console_password = None
            console_user = user_model.objects.filter(username=DEMO_CONSOLE_USER).first()
            if console_user is None:
                console_password = secrets.token_urlsafe(12)
                console_user = user_model.objects.create_user(
                    DEMO_CONSOLE_USER, "", console_password
                )
            # Only when missing: an operator who changed the demo user's role keeps the change.
            Membership.objects.get_or_create(
                user=console_user, tenant=tenant, defaults={"role": Membership.Role.OWNER}
            )
        data = {
            "tenant": tenant.slug,
            "project": project.slug,
            "key_id": api_key.public_id,
            "key": plaintext,
            "masked": masked_key(api_key),
            "admin_user": DEMO_ADMIN,
            "admin_password": password,
            "console_url": options["console_url"],
            "console_user": DEMO_CONSOLE_USER,
            "console_password": console_password,
        }
        data["provider_key"] = provider.public_id if provider else None
        data["anthropic_provider_key"] = anthropic.public_id if anthropic else None
        lines = [f"Demo tenant '{tenant.slug}' ({tenant.plan.name} plan), project '{project.slug}'."]
        if provider:
            lines.append(f"Upstream: the mock at {provider.base_url} (provider key {provider.public_id}).")
        if anthropic:
            lines.append(f"Anthropic upstream (/v1/messages): the mock at {anthropic.base_url} "
                         f"(provider key {anthropic.public_id}).")
        if plaintext:
            lines.append(f"API key (shown once, store it now): {plaintext}")
        else:
            lines.append(f"API key {api_key.public_id} {masked_key(api_key)} exists already; "
                         f"`manage.py key_rotate {api_key.public_id}` prints a fresh one.")
        if console_password:
            lines.append(f"Console: {options['console_url']} user '{DEMO_CONSOLE_USER}', "
                         f"password (shown once): {console_password}")
        else:
            lines.append(f"Console: {options['console_url']} user '{DEMO_CONSOLE_USER}' exists "
                         "already (its password was printed at the first setup; "
                         f"`manage.py changepassword {DEMO_CONSOLE_USER}` sets a new one).")
        if password:
            lines.append(f"Django admin: user '{DEMO_ADMIN}', password (shown once): {password}")
        else:
            lines.append(f"Django admin: user '{DEMO_ADMIN}' exists already "
                         f"(`manage.py changepassword {DEMO_ADMIN}` to reset).")
        return data, "\n".join(lines)
