"""Management API: projects and API keys. Isolation (owner / member / outsider / foreign ids),
sub-limits within the tenant's, show-once plaintext, rotate and revoke."""

from __future__ import annotations

import pytest

from tenants.models import ApiKey, AuditEvent, Project
from tenants.services import revoke_key, set_tenant_limits
from tests.support.api_keys import authenticated_key
from tests.support.api_clients import bearer
from tests.world import World


def base(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}"


def counts() -> tuple[int, int, int]:
    return Project.objects.count(), ApiKey.objects.count(), AuditEvent.objects.count()


# -- projects ----------------------------------------------------------------------------------


def test_list_projects_owner_member_outsider(world: World) -> None:
    url = f"{base(world)}/projects/"
    owner = world.client(world.owner).get(url)
    assert owner.status_code == 200
    body = owner.json()
    assert body["count"] == 1 and "next" in body
    (project,) = body["results"]
    assert project["id"] == world.web.public_id and project["slug"] == "web"
    assert project["usage"] == {"today": 0, "month": 0}
    assert world.client(world.member).get(url).status_code == 200
    assert world.client(world.outsider).get(url).status_code == 404
    assert world.client(world.operator).get(url).status_code == 200
    assert world.client(None).get(url).status_code in (401, 403)


def test_create_project_and_audit(world: World) -> None:
    response = world.client(world.owner).post(
        f"{base(world)}/projects/",
        {"slug": "batch", "name": "Batch", "tokens_per_day": 100, "tokens_per_month": 1000},
        format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["id"].startswith("prj_") and body["tokens_per_day"] == 100
    project = Project.objects.get(public_id=body["id"])
    assert project.tenant == world.acme
    assert AuditEvent.objects.filter(action="project.created", target=project.public_id,
                                     actor="user:owner").exists()


def test_member_and_outsider_cannot_create_or_change_projects(world: World) -> None:
    before = counts()
    url = f"{base(world)}/projects/"
    assert world.client(world.member).post(url, {"slug": "x"}, format="json").status_code == 403
    assert world.client(world.outsider).post(url, {"slug": "x"}, format="json").status_code == 404
    detail = f"{url}{world.web.public_id}/"
    assert world.client(world.member).patch(detail, {"name": "x"}, format="json").status_code == 403
    assert world.client(world.outsider).patch(detail, {"name": "x"},
                                              format="json").status_code == 404
    assert world.client(world.outsider).get(detail).status_code == 404
    assert counts() == before
    world.web.refresh_from_db()
    assert world.web.name == "web"


def test_foreign_project_in_own_tenant_url_is_404(world: World) -> None:
    client = world.client(world.owner)
    url = f"{base(world)}/projects/{world.app.public_id}/"
    assert client.get(url).status_code == 404
    assert client.patch(url, {"name": "mine"}, format="json").status_code == 404
    world.app.refresh_from_db()
    assert world.app.name == "app"


@pytest.mark.parametrize(("body", "field"), [
    ({"slug": "web"}, "slug"),  # taken in this tenant
    ({"slug": "No Slug"}, "slug"),
    ({"slug": "big", "tokens_per_day": -1}, "tokens_per_day"),
    ({"slug": "big", "tokens_per_day": 5000}, "tokens_per_day"),  # above the tenant's 1000
    ({"slug": "big", "tokens_per_month": 10**9}, "tokens_per_month"),  # above the budget
    ({}, "slug"),
])
def test_bad_project_input_is_400_and_writes_nothing(
    world: World, body: dict[str, object], field: str
) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000, monthly_token_budget=50_000)
    before = counts()
    response = world.client(world.owner).post(f"{base(world)}/projects/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert counts() == before


def test_unlimited_tenant_accepts_any_project_limit(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=-1)
    response = world.client(world.owner).post(
        f"{base(world)}/projects/", {"slug": "huge", "tokens_per_day": 10**15}, format="json")
    assert response.status_code == 201


def test_patch_project_sub_limits(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    url = f"{base(world)}/projects/{world.web.public_id}/"
    client = world.client(world.owner)
    too_big = client.patch(url, {"tokens_per_day": 1001}, format="json")
    assert too_big.status_code == 400 and "tokens_per_day" in too_big.json()
    assert "1,000" in too_big.json()["tokens_per_day"][0]
    ok = client.patch(url, {"tokens_per_day": 500, "name": "Website"}, format="json")
    assert ok.status_code == 200
    assert (ok.json()["tokens_per_day"], ok.json()["name"]) == (500, "Website")
    cleared = client.patch(url, {"tokens_per_day": None}, format="json")
    assert cleared.json()["tokens_per_day"] is None
    assert AuditEvent.objects.filter(action="project.updated").count() == 2


# -- keys ---------------------------------------------------------------------------------------


def test_issue_key_returns_plaintext_once(world: World) -> None:
    client = world.client(world.owner)
    response = client.post(f"{base(world)}/keys/",
                           {"project": world.web.public_id, "name": "deploy"}, format="json")
    assert response.status_code == 201, response.json()
    assert response["Cache-Control"] == "no-store"
    body = response.json()
    plaintext = body["key"]
    assert plaintext.startswith("tgk_") and body["masked"].endswith(plaintext[-4:])
    assert body["status"] == "active" and body["project"] == world.web.public_id
    assert authenticated_key(plaintext) is not None
    listing = client.get(f"{base(world)}/keys/").content.decode()
    detail = client.get(f"{base(world)}/keys/{body['id']}/").content.decode()
    for text in (listing, detail):
        assert plaintext not in text and body["masked"] in text
        assert '"key":' not in text
    assert not AuditEvent.objects.filter(data__icontains=plaintext).exists()


def test_issue_key_into_foreign_project_is_404(world: World) -> None:
    before = counts()
    response = world.client(world.owner).post(
        f"{base(world)}/keys/", {"project": world.app.public_id, "name": "steal"}, format="json")
    assert response.status_code == 404
    assert counts() == before


def test_key_endpoints_owner_member_outsider(world: World) -> None:
    key = world.issued.api_key
    urls = {
        "list": f"{base(world)}/keys/",
        "detail": f"{base(world)}/keys/{key.public_id}/",
        "rotate": f"{base(world)}/keys/{key.public_id}/rotate",
        "revoke": f"{base(world)}/keys/{key.public_id}/revoke",
    }
    member, outsider = world.client(world.member), world.client(world.outsider)
    assert member.get(urls["list"]).status_code == 200
    assert member.get(urls["detail"]).status_code == 200
    assert outsider.get(urls["list"]).status_code == 404
    assert outsider.get(urls["detail"]).status_code == 404
    before = counts()
    assert member.post(urls["list"], {"project": world.web.public_id},
                       format="json").status_code == 403
    assert member.patch(urls["detail"], {"name": "x"}, format="json").status_code == 403
    assert member.post(urls["rotate"], {}, format="json").status_code == 403
    assert member.post(urls["revoke"]).status_code == 403
    assert outsider.post(urls["list"], {"project": world.web.public_id},
                         format="json").status_code == 404
    assert outsider.patch(urls["detail"], {"name": "x"}, format="json").status_code == 404
    assert outsider.post(urls["rotate"], {}, format="json").status_code == 404
    assert outsider.post(urls["revoke"]).status_code == 404
    assert counts() == before
    key.refresh_from_db()
    assert key.revoked_at is None and key.secrets.count() == 1


def test_foreign_key_in_own_tenant_url_is_404(world: World) -> None:
    client = world.client(world.owner)
    foreign = world.other_issued.api_key
    prefix = f"{base(world)}/keys/{foreign.public_id}"
    assert client.get(f"{prefix}/").status_code == 404
    assert client.patch(f"{prefix}/", {"name": "x"}, format="json").status_code == 404
    assert client.post(f"{prefix}/rotate", {}, format="json").status_code == 404
    assert client.post(f"{prefix}/revoke").status_code == 404
    foreign.refresh_from_db()
    assert foreign.revoked_at is None and foreign.name == "prod"


def test_list_keys_filters_and_usage(world: World) -> None:
    client = world.client(world.owner)
    extra = client.post(f"{base(world)}/keys/", {"project": world.web.public_id, "name": "b"},
                        format="json").json()
    revoke_key(world.issued.api_key, actor="test")
    active = client.get(f"{base(world)}/keys/?status=active").json()["results"]
    assert [k["id"] for k in active] == [extra["id"]]
    revoked = client.get(f"{base(world)}/keys/?status=revoked").json()["results"]
    assert [k["id"] for k in revoked] == [world.issued.api_key.public_id]
    by_project = client.get(f"{base(world)}/keys/?project={world.web.public_id}").json()
    assert by_project["count"] == 2
    assert all(k["usage"] == {"today": 0, "month": 0} for k in by_project["results"])
    bad = client.get(f"{base(world)}/keys/?status=lost")
    assert bad.status_code == 400 and "status" in bad.json()
    foreign = client.get(f"{base(world)}/keys/?project={world.app.public_id}")
    assert foreign.status_code == 400 and "project" in foreign.json()


def test_key_sub_limits_within_project_and_tenant(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000, requests_per_second=2)
    client = world.client(world.owner)
    world_project = f"{base(world)}/projects/{world.web.public_id}/"
    client.patch(world_project, {"tokens_per_day": 400}, format="json")
    url = f"{base(world)}/keys/{world.issued.api_key.public_id}/"
    before = AuditEvent.objects.count()
    over_project = client.patch(url, {"tokens_per_day": 500}, format="json")
    assert over_project.status_code == 400
    assert "project" in over_project.json()["tokens_per_day"][0]
    over_rate = client.patch(url, {"requests_per_minute": 121}, format="json")
    assert over_rate.status_code == 400 and "requests_per_minute" in over_rate.json()
    negative = client.patch(url, {"max_concurrency": -1}, format="json")
    assert negative.status_code == 400 and "max_concurrency" in negative.json()
    assert AuditEvent.objects.count() == before
    ok = client.patch(url, {"tokens_per_day": 400, "requests_per_minute": 120,
                            "max_concurrency": 4, "allowed_models": ["gpt-4o-mini"]},
                      format="json")
    assert ok.status_code == 200, ok.json()
    assert (ok.json()["tokens_per_day"], ok.json()["max_concurrency"]) == (400, 4)
    assert AuditEvent.objects.filter(action="key.updated").count() == 1


def test_key_models_must_be_in_the_plan(world: World) -> None:
    plan = world.acme.plan
    plan.allowed_models = ["gpt-4o-mini"]
    plan.save()
    response = world.client(world.owner).post(
        f"{base(world)}/keys/",
        {"project": world.web.public_id, "allowed_models": ["gpt-4o"]}, format="json")
    assert response.status_code == 400 and "allowed_models" in response.json()


def test_rotate_with_grace_and_revoke(world: World) -> None:
    client = world.client(world.owner)
    key = world.issued.api_key
    rotated = client.post(f"{base(world)}/keys/{key.public_id}/rotate",
                          {"grace_seconds": 3600}, format="json")
    assert rotated.status_code == 200, rotated.json()
    new_plaintext = rotated.json()["key"]
    assert new_plaintext != world.issued.plaintext
    # Both work during the grace period.
    assert authenticated_key(new_plaintext) is not None
    assert authenticated_key(world.issued.plaintext) is not None
    assert new_plaintext not in client.get(f"{base(world)}/keys/{key.public_id}/").content.decode()

    too_long = client.post(f"{base(world)}/keys/{key.public_id}/rotate/",
                           {"grace_seconds": 604801}, format="json")
    assert too_long.status_code == 400 and "grace_seconds" in too_long.json()

    revoked = client.post(f"{base(world)}/keys/{key.public_id}/revoke")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert authenticated_key(new_plaintext) is None
    again = client.post(f"{base(world)}/keys/{key.public_id}/rotate", {}, format="json")
    assert again.status_code == 400
    assert AuditEvent.objects.filter(target=key.public_id, action="key.revoked").count() == 1
    assert client.post(f"{base(world)}/keys/{key.public_id}/revoke/").status_code == 200
    assert AuditEvent.objects.filter(target=key.public_id, action="key.revoked").count() == 1


def test_tenant_token_manages_only_its_tenant(world: World) -> None:
    from tenants.services import issue_management_token

    token = issue_management_token(world.acme, name="ci", actor="test").plaintext
    client = bearer(token)
    issued = client.post(f"{base(world)}/keys/", {"project": world.web.public_id},
                         format="json")
    assert issued.status_code == 201
    assert ApiKey.objects.get(public_id=issued.json()["id"]).created_by.startswith("token:tok_")
    globex = f"/api/tenants/{world.globex.public_id}/keys/"
    assert client.get(globex).status_code == 404


def test_key_and_project_usage_today_and_this_month(world: World) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from billing.models import UsageRecord
    from tests.billing.rollup_events import create_usage

    now = timezone.now()
    earlier_this_month = now.replace(day=1, hour=0, minute=0, second=1)
    for request_id, when, tokens in (("u-today", now, 100), ("u-month", earlier_this_month, 40),
                                     ("u-old", now - timedelta(days=40), 1000)):
        create_usage(
            request_id=request_id, tenant=world.acme, project=world.web,
            api_key=world.issued.api_key, model="gpt-4o", served_model="gpt-4o",
            input_tokens=tokens, output_tokens=0, cost_micros=0,
            status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)
    client = world.client(world.owner)
    key = client.get(f"{base(world)}/keys/{world.issued.api_key.public_id}/").json()
    # On the 1st of a month both rows are today's.
    assert key["usage"]["today"] == (140 if earlier_this_month.date() == now.date() else 100)
    assert key["usage"]["month"] == 140
    project = client.get(f"{base(world)}/projects/{world.web.public_id}/").json()
    assert project["usage"] == key["usage"]


def test_project_slug_cannot_change(world: World) -> None:
    response = world.client(world.owner).patch(
        f"{base(world)}/projects/{world.web.public_id}/", {"slug": "renamed"}, format="json")
    assert response.status_code == 400 and "slug" in response.json()
    world.web.refresh_from_db()
    assert world.web.slug == "web"


def test_revoked_key_cannot_be_changed(world: World) -> None:
    revoke_key(world.issued.api_key, actor="test")
    before = AuditEvent.objects.count()
    response = world.client(world.owner).patch(
        f"{base(world)}/keys/{world.issued.api_key.public_id}/", {"name": "again"}, format="json")
    assert response.status_code == 400 and "non_field_errors" in response.json()
    assert AuditEvent.objects.count() == before
    world.issued.api_key.refresh_from_db()
    assert world.issued.api_key.name == "ci"
