from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tenants.models import ApiKey, AuditEvent, Tenant
from tenants.services import IssuedKey
from tests.support.api_keys import authenticated_key

pytestmark = pytest.mark.django_db


def run_json(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command(*args, "--json", stdout=out)
    text = out.getvalue()
    assert text.count("\n") == 1, "--json prints exactly one line"
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def run_text(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_tenant_create() -> None:
    data = run_json("tenant_create", "initech", "--plan", "free", "--name", "Initech", "--rps", "2")
    tenant = Tenant.objects.get(slug="initech")
    assert data["public_id"] == tenant.public_id
    assert data["plan"] == "free"
    assert data["name"] == "Initech"
    assert data["effective_limits"]["requests_per_second"] == 2
    assert data["effective_limits"]["tokens_per_day"] == 500_000
    assert data["effective_limits"]["safety_factor"] == "1.25"
    assert AuditEvent.objects.get(target=tenant.public_id).actor == "cli"


def test_tenant_create_text_output() -> None:
    text = run_text("tenant_create", "hooli", "--plan", "enterprise", "--tokens-per-day", "-1")
    assert "hooli" in text and "enterprise" in text
    assert Tenant.objects.get(slug="hooli").tokens_per_day == -1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("tenant_create", "x", "--plan", "platinum"), "Unknown plan 'platinum'"),
        (("tenant_create", "acme", "--plan", "free"), "already exists"),
        (("tenant_create", "bad slug", "--plan", "free"), "slug"),
        (("tenant_create", "y", "--plan", "free", "--rps", "-3"), "requests_per_second"),
        (("project_create", "nope", "web"), "No tenant with slug 'nope'"),
        (("project_create", "acme", "web"), "already exists"),
        (("key_issue", "nope", "web"), "No tenant"),
        (("key_issue", "acme", "nope"), "No project 'nope'"),
        (("key_rotate", "key_doesnotexist"), "No API key"),
        (("key_revoke", "key_doesnotexist"), "No API key"),
        (("tenant_set_plan", "nope", "free"), "No tenant"),
        (("tenant_set_plan", "acme", "platinum"), "Unknown plan"),
    ],
)
def test_errors_raise_command_error(project: object, args: tuple[str, ...], message: str) -> None:
    events = AuditEvent.objects.count()
    with pytest.raises(CommandError, match=message):
        call_command(*args, "--json", stdout=StringIO())
    assert AuditEvent.objects.count() == events


def test_tenant_create_requires_a_plan() -> None:
    with pytest.raises(CommandError, match="--plan"):
        call_command("tenant_create", "noplan", stdout=StringIO())


def test_project_create(tenant: Tenant) -> None:
    data = run_json(
        "project_create", "acme", "mobile", "--name", "Mobile", "--tokens-per-day", "1000"
    )
    project = tenant.projects.get(slug="mobile")
    assert data == {
        "public_id": project.public_id,
        "tenant": "acme",
        "slug": "mobile",
        "name": "Mobile",
        "tokens_per_day": 1000,
        "tokens_per_month": None,
        "allotment_tokens_per_day": None,
        "allotment_tokens_per_month": None,
    }
    assert "acme/desktop" in run_text("project_create", "acme", "desktop")


def test_key_issue_prints_a_working_key_once(project: object) -> None:
    data = run_json("key_issue", "acme", "web", "--name", "laptop")
    api_key = authenticated_key(data["key"])
    assert api_key is not None
    assert api_key.public_id == data["key_id"]
    assert data["key_id"].startswith("key_")
    assert data["masked"] == f"tgk_{data['key'][4:16]}_…{data['key'][-4:]}"
    assert api_key.name == "laptop"
    assert api_key.created_by == "cli"


def test_key_issue_text_output_contains_the_key(project: object) -> None:
    text = run_text("key_issue", "acme", "web")
    key = text.strip().splitlines()[-1]
    assert authenticated_key(key) is not None
    assert ApiKey.objects.get().public_id in text


def test_key_rotate(issued: IssuedKey) -> None:
    data = run_json("key_rotate", issued.api_key.public_id)
    assert data["key_id"] == issued.api_key.public_id
    assert data["grace_seconds"] == 0
    assert authenticated_key(data["key"]) == issued.api_key
    assert authenticated_key(issued.plaintext) is None


def test_key_rotate_with_grace(issued: IssuedKey) -> None:
    data = run_json("key_rotate", issued.api_key.public_id, "--grace", "600")
    assert data["grace_seconds"] == 600
    assert authenticated_key(data["key"]) == issued.api_key
    assert authenticated_key(issued.plaintext) == issued.api_key


def test_key_rotate_refuses_revoked_and_negative_grace(issued: IssuedKey) -> None:
    with pytest.raises(CommandError, match="grace"):
        call_command("key_rotate", issued.api_key.public_id, "--grace", "-5", stdout=StringIO())
    run_json("key_revoke", issued.api_key.public_id)
    with pytest.raises(CommandError, match="revoked"):
        call_command("key_rotate", issued.api_key.public_id, "--json", stdout=StringIO())


def test_key_revoke_is_idempotent(issued: IssuedKey) -> None:
    first = run_json("key_revoke", issued.api_key.public_id)
    assert first["already_revoked"] is False
    assert first["revoked_at"]
    assert authenticated_key(issued.plaintext) is None
    second = run_json("key_revoke", issued.api_key.public_id)
    assert second["already_revoked"] is True
    assert second["revoked_at"] == first["revoked_at"]
    assert "already revoked" in run_text("key_revoke", issued.api_key.public_id)
    assert AuditEvent.objects.filter(action="key.revoked").count() == 1


def test_tenant_set_plan(tenant: Tenant) -> None:
    data = run_json("tenant_set_plan", "acme", "enterprise")
    assert data["plan"] == "enterprise"
    assert data["previous_plan"] == "standard"
    assert data["effective_limits"]["tokens_per_day"] == 50_000_000
    assert Tenant.objects.get(pk=tenant.pk).plan.name == "enterprise"
    assert "nothing changed" in run_text("tenant_set_plan", "acme", "enterprise")
