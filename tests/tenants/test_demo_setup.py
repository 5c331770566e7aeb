from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from tenants.models import ApiKey, Tenant
from tenants.services import authenticate_key


def demo_setup() -> dict:
    out = StringIO()
    call_command("demo_setup", "--json", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_demo_setup_creates_a_working_key_once_and_is_idempotent() -> None:
    first = demo_setup()
    assert first["key"].startswith("tgk_")
    api_key = authenticate_key(first["key"])
    assert api_key is not None and api_key.project.tenant.slug == "demo"
    assert get_user_model().objects.get(username="admin").check_password(first["admin_password"])

    second = demo_setup()
    assert second["key"] is None and second["admin_password"] is None
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
    pool = load_pool()
    [upstream] = pool.candidates("gpt-4o", None, 0.0)
    assert upstream.base_url == "http://127.0.0.1:8099/v1"
    out = StringIO()
    call_command("demo_setup", "--json", "--mock-upstream", "http://127.0.0.1:8099/v1", stdout=out)
    assert json.loads(out.getvalue())["provider_key"] is None
    assert ProviderKey.objects.count() == 1
