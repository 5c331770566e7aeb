"""Django admin writes go through the services: a change made in admin records the same audit
event and publishes the same invalidation as the same change made through the management API
(which the console shares), and is refused by the same limit checks."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib import admin
from django.db import models
from django.test import Client, RequestFactory

from tenants.models import ApiKey, AuditEvent, Membership, Plan, Project, Tenant
from tenants.services import issue_key, set_tenant_limits, update_key, update_plan, update_project
from tests.world import World

pytestmark = pytest.mark.django_db

Published = list[tuple[str, Any]]


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Published:
    """The invalidations that were published (after commit), as (kind, id)."""
    sent: Published = []
    monkeypatch.setattr("tenants.invalidation._publish_now",
                        lambda kind, ident: sent.append((kind, ident)))
    return sent


@pytest.fixture
def operator(world: World) -> Any:
    # Staff in the API (an operator there); a superuser for admin's model permissions.
    world.operator.is_superuser = True
    world.operator.save()
    return world.operator


@pytest.fixture
def admin_client(operator: Any) -> Client:
    client = Client()
    client.force_login(operator)
    return client


Change = tuple[list[tuple[str, str, int | None, dict[str, Any]]], Published]


@pytest.fixture
def recorded(published: Published,
             django_capture_on_commit_callbacks: Any) -> Callable[[Callable[[], Any]], Change]:
    """Run a change; return the audit events it wrote (action, actor, target, data) and the
    invalidations it published."""

    def run(change: Callable[[], Any]) -> Change:
        last = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
        published.clear()
        with django_capture_on_commit_callbacks(execute=True):
            response = change()
        assert response.status_code in (200, 204, 302), response.content[:2000]
        events = [(e.action, e.actor, e.tenant_id, e.data) for e in
                  AuditEvent.objects.filter(id__gt=last).order_by("id")]
        return events, list(published)

    return run


def _form_data(obj: models.Model, user: Any, **changes: Any) -> dict[str, Any]:
    """What the admin change form posts for `obj` as it is, with `changes` made."""
    request = RequestFactory().get("/")
    request.user = user
    form = admin.site._registry[type(obj)].get_form(request, obj)
    data: dict[str, Any] = {}
    for name in form.base_fields:
        value = changes[name] if name in changes else getattr(obj, name)
        if isinstance(value, models.Model):
            value = value.pk
        elif isinstance(value, list | dict):
            value = json.dumps(value)
        elif value is None:
            value = ""
        elif value is False:
            continue  # an unchecked box is not posted
        data[name] = value
    return data


def _tenant_form(world: World, user: Any, **changes: Any) -> dict[str, Any]:
    return {**_form_data(world.acme, user, **changes),
            "projects-TOTAL_FORMS": "0", "projects-INITIAL_FORMS": "0",
            "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"}


def _change_url(obj: models.Model) -> str:
    meta = obj._meta
    return f"/admin/{meta.app_label}/{meta.model_name}/{obj.pk}/change/"


def _api(world: World, user: Any) -> Any:
    return world.client(user)


def test_a_key_change_in_admin_is_the_api_change(world: World, operator: Any,
                                                 admin_client: Client, recorded: Any) -> None:
    key = world.issued.api_key
    url = f"/api/tenants/{world.acme.public_id}/keys/{key.public_id}/"
    via_api = recorded(lambda: _api(world, operator).patch(
        url, {"tokens_per_day": 500, "requests_per_minute": 60}, format="json"))
    update_key(key, actor="test", tokens_per_day=None, requests_per_minute=None)
    key.refresh_from_db()
    via_admin = recorded(lambda: admin_client.post(_change_url(key), {
        **_form_data(key, operator, tokens_per_day=500, requests_per_minute=60),
        "secrets-TOTAL_FORMS": "0", "secrets-INITIAL_FORMS": "0"}))
    assert via_admin == via_api
    events, sent = via_admin
    assert [e[0] for e in events] == ["key.updated"] and sent == [("api_key", key.pk)]
    assert events[0][1] == "user:operator"


def test_a_project_change_in_admin_is_the_api_change(world: World, operator: Any,
                                                     admin_client: Client, recorded: Any) -> None:
    url = f"/api/tenants/{world.acme.public_id}/projects/{world.web.public_id}/"
    via_api = recorded(lambda: _api(world, operator).patch(
        url, {"tokens_per_day": 1000, "name": "Web"}, format="json"))
    update_project(world.web, actor="test", tokens_per_day=None, name="web")
    via_admin = recorded(lambda: admin_client.post(
        _change_url(world.web), _form_data(world.web, operator, tokens_per_day=1000, name="Web")))
    assert via_admin == via_api
    assert via_admin[1] == [("tenant", world.acme.pk)]


def test_tenant_limits_plan_status_and_name_in_admin_are_the_api_changes(
    world: World, operator: Any, admin_client: Client, recorded: Any
) -> None:
    api = _api(world, operator)
    tenant_url = f"/api/tenants/{world.acme.public_id}/"
    before = {"name": world.acme.name, "plan": world.acme.plan, "status": world.acme.status}

    def api_changes() -> Any:
        api.patch(f"{tenant_url}limits", {"tokens_per_day": 77}, format="json")
        return api.patch(tenant_url, {"name": "Acme Inc", "plan": "enterprise",
                                      "status": "suspended"}, format="json")

    via_api = recorded(api_changes)
    tenant = Tenant.objects.get(pk=world.acme.pk)
    for name, value in before.items():
        setattr(tenant, name, value)
    Tenant.objects.filter(pk=tenant.pk).update(**before)
    set_tenant_limits(tenant, actor="test", tokens_per_day=None)
    world.acme = tenant
    enterprise = Plan.objects.get(name="enterprise")
    via_admin = recorded(lambda: admin_client.post(_change_url(tenant), _tenant_form(
        world, operator, name="Acme Inc", plan=enterprise, status="suspended",
        tokens_per_day=77)))
    assert sorted(via_admin[0]) == sorted(via_api[0])
    assert {e[0] for e in via_admin[0]} == {
        "tenant.limits_changed", "tenant.renamed", "tenant.plan_changed",
        "tenant.status_changed"}
    assert sorted(via_admin[1]) == sorted(via_api[1]) == [("tenant", tenant.pk)] * 3


def test_a_plan_change_in_admin_is_the_api_change(world: World, operator: Any,
                                                  admin_client: Client, recorded: Any) -> None:
    plan = Plan.objects.get(name="standard")
    original, factor = plan.tokens_per_day, plan.safety_factor
    via_api = recorded(lambda: _api(world, operator).patch(
        "/api/plans/standard/", {"tokens_per_day": 1234, "safety_factor": "1.50"},
        format="json"))
    update_plan(plan, actor="test", tokens_per_day=original, safety_factor=factor)
    plan.refresh_from_db()
    via_admin = recorded(lambda: admin_client.post(
        _change_url(plan), _form_data(plan, operator, tokens_per_day=1234, safety_factor="1.50")))
    assert via_admin == via_api
    assert via_admin[1] == [("plan", plan.pk)]
    assert via_admin[0][0][3] == {"changes": {
        "tokens_per_day": {"from": original, "to": 1234},
        "safety_factor": {"from": str(factor), "to": "1.50"}}}


def test_revoking_in_admin_is_revoking_through_the_api(world: World, operator: Any,
                                                       admin_client: Client,
                                                       recorded: Any) -> None:
    first, second = world.issued.api_key, issue_key(world.web, actor="test").api_key
    via_api = recorded(lambda: _api(world, operator).post(
        f"/api/tenants/{world.acme.public_id}/keys/{first.public_id}/revoke"))
    via_admin = recorded(lambda: admin_client.post("/admin/tenants/apikey/", {
        "action": "revoke_selected", "_selected_action": [second.pk]}))
    assert [e[0::2] + (e[3],) for e in via_admin[0]] == [e[0::2] + (e[3],) for e in via_api[0]]
    assert (via_api[1], via_admin[1]) == ([("api_key", first.pk)], [("api_key", second.pk)])
    # A revoked key's page is read-only, since update_key refuses to change it.
    page = admin_client.get(_change_url(second)).content.decode()
    assert 'name="tokens_per_day"' not in page


def test_member_role_and_removal_in_admin_are_the_api_changes(
    world: World, operator: Any, admin_client: Client, recorded: Any
) -> None:
    member = Membership.objects.get(tenant=world.acme, user=world.member)
    owner = Membership.objects.get(tenant=world.acme, user=world.owner)
    api = _api(world, operator)
    url = f"/api/tenants/{world.acme.public_id}/members/member/"

    def api_changes() -> Any:
        api.patch(url, {"role": "admin"}, format="json")
        return api.delete(url)

    via_api = recorded(api_changes)
    member = Membership.objects.create(tenant=world.acme, user=world.member, role="member")

    def rows(**member_row: Any) -> dict[str, Any]:
        form = _tenant_form(world, operator)
        form.update({"memberships-TOTAL_FORMS": "2", "memberships-INITIAL_FORMS": "2"})
        for i, (row, role) in enumerate(((owner, "owner"), (member, "member"))):
            form.update({f"memberships-{i}-id": row.pk, f"memberships-{i}-tenant": world.acme.pk,
                         f"memberships-{i}-user": row.user_id, f"memberships-{i}-role": role})
        form.update({f"memberships-1-{k}": v for k, v in member_row.items()})
        return form

    url_admin = _change_url(world.acme)
    role = recorded(lambda: admin_client.post(url_admin, rows(role="admin")))
    removal = recorded(lambda: admin_client.post(url_admin, rows(role="admin", DELETE="on")))
    assert role[0] + removal[0] == via_api[0]
    assert [e[0] for e in via_api[0]] == ["member.role", "member.remove"]
    assert not Membership.objects.filter(tenant=world.acme, user=world.member).exists()


def test_admin_adds_a_first_owner_and_keeps_the_last_one(
    world: World, operator: Any, admin_client: Client, recorded: Any
) -> None:
    owner = Membership.objects.get(tenant=world.acme, user=world.owner)
    form = _tenant_form(world, operator)
    form.update({"memberships-TOTAL_FORMS": "1", "memberships-INITIAL_FORMS": "1",
                 "memberships-0-id": owner.pk, "memberships-0-tenant": world.acme.pk,
                 "memberships-0-user": owner.user_id, "memberships-0-role": "admin"})
    # Demoting the last owner is refused on the page, as the API refuses it (LastOwner).
    Membership.objects.filter(tenant=world.acme, user=world.member).delete()
    page = admin_client.post(_change_url(world.acme), form)
    assert page.status_code == 200 and "at least one owner" in page.content.decode()
    assert Membership.objects.get(pk=owner.pk).role == "owner"

    form.update({"memberships-TOTAL_FORMS": "2", "memberships-1-tenant": world.acme.pk,
                 "memberships-1-user": world.outsider.pk, "memberships-1-role": "owner"})
    events, _ = recorded(lambda: admin_client.post(_change_url(world.acme), form))
    assert [(e[0], e[3]) for e in events] == [("member.add", {"role": "owner"}),
                                              ("member.role", {"role": {"from": "owner",
                                                                        "to": "admin"}})]


def test_admin_refuses_sub_limits_above_the_tenants_as_the_api_does(
    world: World, operator: Any, admin_client: Client, recorded: Any
) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    api = _api(world, operator)
    key = world.issued.api_key
    refused = api.patch(f"/api/tenants/{world.acme.public_id}/keys/{key.public_id}/",
                        {"tokens_per_day": 5000}, format="json")
    assert refused.status_code == 400 and "tokens_per_day" in refused.json()
    page = admin_client.post(_change_url(key), {
        **_form_data(key, operator, tokens_per_day=5000),
        "secrets-TOTAL_FORMS": "0", "secrets-INITIAL_FORMS": "0"})
    assert page.status_code == 200
    assert "Must be at most 1,000, the tenant&#x27;s daily token limit." in page.content.decode()
    page = admin_client.post(_change_url(world.web),
                             _form_data(world.web, operator, tokens_per_day=5000))
    assert page.status_code == 200 and "Must be at most 1,000" in page.content.decode()
    page = admin_client.post("/admin/tenants/project/add/", {
        "tenant": world.acme.pk, "slug": "big", "name": "big", "tokens_per_day": 5000})
    assert page.status_code == 200 and not Project.objects.filter(slug="big").exists()
    assert ApiKey.objects.get(pk=key.pk).tokens_per_day is None


def test_admin_offers_no_delete_that_no_service_does(world: World, admin_client: Client,
                                                     recorded: Any) -> None:
    for obj in (world.acme, world.web, world.issued.api_key):
        meta = obj._meta
        url = f"/admin/{meta.app_label}/{meta.model_name}/{obj.pk}/delete/"
        assert admin_client.get(url).status_code == 403, url
    spare = Plan.objects.create(name="spare", display_name="Spare", tokens_per_day=1,
                                requests_per_second=1)
    events, sent = recorded(lambda: admin_client.post(
        f"/admin/tenants/plan/{spare.pk}/delete/", {"post": "yes"}))
    assert [(e[0], e[1]) for e in events] == [("plan.deleted", "user:operator")]
    assert sent == [] and not Plan.objects.filter(name="spare").exists()
    # A plan tenants are on is protected: admin does not offer to delete it.
    standard = Plan.objects.get(name="standard")
    admin_client.post(f"/admin/tenants/plan/{standard.pk}/delete/", {"post": "yes"})
    assert Plan.objects.filter(name="standard").exists()
