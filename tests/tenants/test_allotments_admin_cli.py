"""Allotments in Django admin and the CLI go through the same services as the API: the same
audit events and invalidations, the same refusals on the field; a quota lowered below the
allotments in admin or by the CLI's plan change is allowed and warned about."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from tenants.models import ApiKey, Plan, Project
from tenants.services import create_project, set_tenant_limits, update_key, update_project
from tests.tenants.test_admin_through_services import (  # noqa: F401 - fixtures
    _change_url,
    _form_data,
    _tenant_form,
    admin_client,
    operator,
    published,
    recorded,
)
from tests.world import World

pytestmark = pytest.mark.django_db


@pytest.fixture
def quota(world: World) -> World:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000, monthly_token_budget=20_000)
    return world


def test_a_key_allotment_in_admin_is_the_api_change(
    quota: World, operator: Any, admin_client: Client, recorded: Any
) -> None:
    key = quota.issued.api_key
    url = f"/api/tenants/{quota.acme.public_id}/keys/{key.public_id}/"
    via_api = recorded(lambda: quota.client(operator).patch(
        url, {"allotment_tokens_per_day": 300}, format="json"))
    update_key(key, actor="test", allotment_tokens_per_day=None)
    key.refresh_from_db()
    via_admin = recorded(lambda: admin_client.post(_change_url(key), {
        **_form_data(key, operator, allotment_tokens_per_day=300),
        "secrets-TOTAL_FORMS": "0", "secrets-INITIAL_FORMS": "0"}))
    assert via_admin == via_api
    events, sent = via_admin
    assert [e[0] for e in events] == ["key.updated"]
    assert sent == [("tenant", quota.acme.pk)]  # the pool changed: every key of the tenant
    assert ApiKey.objects.get(pk=key.pk).allotment_tokens_per_day == 300


def test_admin_refuses_allotments_on_the_field_as_the_api_does(
    quota: World, operator: Any, admin_client: Client
) -> None:
    create_project(quota.acme, "batch", actor="test", allotment_tokens_per_day=800)
    page = admin_client.post(_change_url(quota.web),
                             _form_data(quota.web, operator, allotment_tokens_per_day=201))
    assert page.status_code == 200
    html = page.content.decode()
    assert ("Allotments would total 1,001 tokens per day; the tenant&#x27;s daily quota is "
            "1,000.") in html
    assert Project.objects.get(pk=quota.web.pk).allotment_tokens_per_day is None
    page = admin_client.post("/admin/tenants/project/add/", {
        "tenant": quota.acme.pk, "slug": "late", "name": "late",
        "allotment_tokens_per_month": 20_001})
    assert page.status_code == 200
    assert "Allotments would total 20,001 tokens per cycle" in page.content.decode()
    assert not Project.objects.filter(slug="late").exists()
    added = admin_client.post("/admin/tenants/project/add/", {
        "tenant": quota.acme.pk, "slug": "late", "name": "late",
        "allotment_tokens_per_day": 200})
    assert added.status_code == 302
    assert Project.objects.get(slug="late").allotment_tokens_per_day == 200


def test_admin_refuses_a_project_limit_below_a_keys_allotment_on_the_field(
    quota: World, operator: Any, admin_client: Client
) -> None:
    key = quota.issued.api_key
    update_key(key, actor="test", allotment_tokens_per_day=300)
    page = admin_client.post(_change_url(quota.web),
                             _form_data(quota.web, operator, tokens_per_day=299))
    assert page.status_code == 200
    assert (f"Must be at least 300, the allotment per day of key {key.name} ({key.public_id})"
            in page.content.decode())
    assert Project.objects.get(pk=quota.web.pk).tokens_per_day is None
    saved = admin_client.post(_change_url(quota.web),
                              _form_data(quota.web, operator, tokens_per_day=300))
    assert saved.status_code == 302
    assert Project.objects.get(pk=quota.web.pk).tokens_per_day == 300


def test_lowering_the_quota_in_admin_is_allowed_and_warned(
    quota: World, operator: Any, admin_client: Client
) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=900)
    tenant = quota.acme
    tenant.refresh_from_db()
    response = admin_client.post(_change_url(tenant), _tenant_form(
        quota, operator, tokens_per_day=600), follow=True)
    assert response.status_code == 200
    tenant.refresh_from_db()
    assert tenant.tokens_per_day == 600
    shown = [str(m) for m in response.context["messages"]]
    assert any(m.startswith("Allotments total 900 tokens per day, more than the tenant's daily "
                            "quota of 600") for m in shown), shown


def test_the_cli_creates_a_project_with_allotments(quota: World) -> None:
    out = StringIO()
    call_command("project_create", "acme", "reports", "--allotment-tokens-per-day", "400",
                 "--allotment-tokens-per-month", "5000", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert (data["allotment_tokens_per_day"], data["allotment_tokens_per_month"]) == (400, 5000)
    with pytest.raises(CommandError, match="allotment_tokens_per_day: Allotments would total "
                                           "1,001 tokens per day"):
        call_command("project_create", "acme", "more", "--allotment-tokens-per-day", "601",
                     stdout=StringIO())
    assert not Project.objects.filter(slug="more").exists()


def test_the_cli_plan_change_warns_of_allotments_above_the_new_quota(quota: World) -> None:
    set_tenant_limits(quota.acme, actor="test", tokens_per_day=None)  # the plan's 5,000,000
    update_project(quota.web, actor="test", allotment_tokens_per_day=4_000_000)
    assert Plan.objects.get(name="free").tokens_per_day < 4_000_000
    out = StringIO()
    call_command("tenant_set_plan", "acme", "free", stdout=out)
    text = out.getvalue()
    assert "moved from plan standard to free" in text
    assert "Warning: Allotments total 4,000,000 tokens per day, more than the tenant's daily " \
        "quota of" in text
