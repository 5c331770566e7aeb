from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from tenants.models import ApiKey, Membership, Tenant
from tests.support.api_keys import authenticated_key


def demo_setup() -> dict:
    out = StringIO()
    call_command("demo_setup", "--json", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_demo_setup_creates_a_working_key_once_and_is_idempotent() -> None:
    first = demo_setup()
    assert first["key"].startswith("tgk_")
    api_key = authenticated_key(first["key"])
    assert api_key is not None and api_key.project.tenant.slug == "demo"
    assert get_user_model().objects.get(username="admin").check_password(first["admin_password"])

    console_user = get_user_model().objects.get(username="demo")
    assert console_user.check_password(first["console_password"])
    assert console_user.password.startswith("argon2$")  # only the hash is stored
    assert not console_user.is_staff  # the console as a tenant owner sees it, not an operator
    assert Membership.objects.get(user=console_user).role == "owner"
    assert first["console_url"] == "http://127.0.0.1:8000/console/"

    second = demo_setup()
    assert second["key"] is None and second["admin_password"] is None
    assert second["console_password"] is None and second["console_user"] == "demo"
    assert get_user_model().objects.get(username="demo").check_password(first["console_password"])
    assert second["key_id"] == first["key_id"] and second["masked"] == first["masked"]
    assert Tenant.objects.filter(slug="demo").count() == 1
    assert ApiKey.objects.filter(project__tenant__slug="demo").count() == 1


@pytest.mark.django_db
def test_demo_setup_registers_the_mock_upstream_once() -> None:
    from gateway.models import ProviderKey
    from gateway.providers import load_pool

    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    first = json.loads(out.getvalue())
    assert first["provider_key"].startswith("pk_")
    assert first["anthropic_provider_key"].startswith("pk_")
    pool = load_pool()
    [upstream] = pool.candidates("gpt-4o", None, 0.0)
    assert upstream.base_url == "http://127.0.0.1:8099/v1"
    # /v1/messages works out of the box: an anthropic-kind key on the same mock.
    [messages] = pool.candidates("claude-sonnet-4-5", None, 0.0, kind="anthropic")
    assert (messages.base_url, messages.public_id) == ("http://127.0.0.1:8099/v1",
                                                       first["anthropic_provider_key"])
    # Its own secret: the mock's bill names keys by their secret.
    assert messages.secret != upstream.secret
    # Its default price meters the mock's fault-injection models ("gpt-4o@cut=3"), which have
    # no price of their own and would otherwise be refused (model_not_priced).
    key = ProviderKey.objects.get(kind="openai")
    assert (key.default_input_price_micros_per_mtok,
            key.default_output_price_micros_per_mtok) == (2_500_000, 10_000_000)
    claude = ProviderKey.objects.get(kind="anthropic")
    assert (claude.name, claude.default_input_price_micros_per_mtok,
            claude.default_output_price_micros_per_mtok) == ("mock-anthropic", 3_000_000,
                                                             15_000_000)
    # A mock key made before default prices existed gets one at the next setup.
    ProviderKey.objects.update(default_input_price_micros_per_mtok=None,
                               default_output_price_micros_per_mtok=None)
    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    again = json.loads(out.getvalue())
    assert again["provider_key"] is None and again["anthropic_provider_key"] is None
    assert ProviderKey.objects.count() == 2
    key.refresh_from_db()
    assert key.default_input_price_micros_per_mtok == 2_500_000


@pytest.mark.django_db
def test_demo_setup_adds_the_anthropic_mock_key_to_an_earlier_setup_only() -> None:
    from gateway.models import ProviderKey
    from gateway.providers import create_provider_key

    # A setup made before the Messages API existed: only the mock's OpenAI key.
    create_provider_key("mock", base_url="http://127.0.0.1:8099/v1",
                        secret="sk-mock-upstream-local")
    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    added = json.loads(out.getvalue())["anthropic_provider_key"]
    assert ProviderKey.objects.get(public_id=added).kind == "anthropic"

    # An operator's own keys (no mock key of the demo's): the demo adds no upstream to them.
    ProviderKey.objects.all().delete()
    create_provider_key("openai", base_url="https://api.openai.com/v1", secret="sk-own-key-000000")
    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    assert json.loads(out.getvalue())["anthropic_provider_key"] is None
    assert list(ProviderKey.objects.values_list("name", flat=True)) == ["openai"]


@pytest.mark.django_db
def test_demo_setup_prints_the_console_login_once() -> None:
    # `make up` shows this text: the console address, user and password at the first run, and
    # how to set a new password afterwards (the password itself is never shown again).
    out = StringIO()
    call_command("demo_setup", stdout=out)
    first = out.getvalue()
    assert "Console: http://127.0.0.1:8000/console/ user 'demo', password (shown once): " in first
    password = first.split("password (shown once): ")[1].split()[0]
    assert get_user_model().objects.get(username="demo").check_password(password)
    out = StringIO()
    call_command("demo_setup", stdout=out)
    again = out.getvalue()
    assert password not in again
    assert "printed at the first setup" in again and "manage.py changepassword demo" in again


def _mock_setup() -> dict:
    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_a_deleted_anthropic_mock_key_does_not_come_back() -> None:
    from gateway.models import ProviderKey
    from gateway.providers import delete_provider_key

    first = _mock_setup()
    assert first["anthropic_provider_key"] is not None
    delete_provider_key(ProviderKey.objects.get(public_id=first["anthropic_provider_key"]),
                        actor="user:ops")
    # `make up` again: the audit trail says this installation had an anthropic-kind key.
    assert _mock_setup()["anthropic_provider_key"] is None
    assert list(ProviderKey.objects.values_list("name", flat=True)) == ["mock"]
    # Even when every key is gone and the demo registers its OpenAI mock key again.
    ProviderKey.objects.all().delete()
    again = _mock_setup()
    assert again["provider_key"] is not None and again["anthropic_provider_key"] is None
    assert list(ProviderKey.objects.values_list("name", flat=True)) == ["mock"]


@pytest.mark.django_db
def test_an_operators_deleted_anthropic_key_means_no_mock_one_either() -> None:
    from gateway.models import ProviderKey
    from gateway.providers import create_provider_key, delete_provider_key

    create_provider_key("mock", base_url="http://127.0.0.1:8099/v1",
                        secret="sk-mock-upstream-local")
    own = create_provider_key("claude", base_url="https://api.anthropic.com/v1",
                              secret="sk-ant-own-key-0000", kind="anthropic")
    delete_provider_key(own, actor="user:ops")
    assert _mock_setup()["anthropic_provider_key"] is None
    assert not ProviderKey.objects.filter(kind="anthropic").exists()


@pytest.mark.django_db
def test_the_demo_anthropic_keys_default_price_prices_only_messages_calls() -> None:
    """The two mock keys' default prices: an unpriced name (the mock's fault-injection names)
    called through the OpenAI-compatible endpoints costs the OpenAI mock key's default, through
    /v1/messages the anthropic one's; neither raises the other's."""
    from gateway.catalog import load_catalog
    from gateway.management.commands.demo_setup import (
        MOCK_ANTHROPIC_DEFAULT_PRICE,
        MOCK_DEFAULT_PRICE,
    )

    _mock_setup()
    catalog = load_catalog()
    assert catalog.price("gpt-4o@cut=3") == MOCK_DEFAULT_PRICE
    assert catalog.price("gpt-4o@cut=3", kind="openai") == MOCK_DEFAULT_PRICE
    assert catalog.price("claude-x@cut=3", kind="anthropic") == MOCK_ANTHROPIC_DEFAULT_PRICE
