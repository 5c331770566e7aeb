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
