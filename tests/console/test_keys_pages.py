"""Console projects and keys pages: isolation, CSRF, show-once secrets, bad input writes nothing."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tenants.models import ApiKey, AuditEvent, Project
from tenants.services import revoke_key, set_tenant_limits
from tests.world import World


def login(user: object, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def projects_url(world: World) -> str:
    return f"/console/t/{world.acme.public_id}/projects/"


def key_url(world: World, suffix: str = "", key: ApiKey | None = None) -> str:
    key = key or world.issued.api_key
    return f"/console/t/{world.acme.public_id}/keys/{key.public_id}/{suffix}"


def issue_url(world: World, project: Project | None = None) -> str:
    project = project or world.web
    return f"/console/t/{world.acme.public_id}/projects/{project.public_id}/keys/new/"


def shown_key(html: str) -> str:
    match = re.search(r'<input readonly id="new-key" value="(tgk_[0-9A-Za-z_]+)"', html)
    assert match, "the new key is shown in the read-only input"
    return match.group(1)


def keys_url(world: World) -> str:
    return f"/console/t/{world.acme.public_id}/keys/"


def test_projects_page_lists_projects_and_masked_keys(world: World) -> None:
    # The projects page counts each project's keys and links to them on the keys page (which
    # lists them masked): a tenant with thousands of keys no longer gets them all on one page.
    page = login(world.owner).get(projects_url(world))
    assert page.status_code == 200
    html = page.content.decode()
    assert "web" in html and world.issued.masked not in html
    assert f'{keys_url(world)}?project={world.web.public_id}">1 key</a>' in html
    keys = login(world.owner).get(keys_url(world), {"project": world.web.public_id})
    assert keys.status_code == 200 and world.issued.masked in keys.content.decode()
    assert world.issued.plaintext not in html + keys.content.decode()
    keys_html = keys.content.decode()
    assert "<th" in keys_html and 'class="table-wrap"' in keys_html  # the keys' table
    assert f'<label for="id_{world.web.public_id}-name">' in html
    assert '<label for="id_slug">' in html
    # Nothing of globex's.
    assert "app" not in re.findall(r"\((\w+)\)</span></h2>", html)
    assert world.other_issued.masked not in html


def test_member_reads_without_forms_and_outsider_gets_404(world: World) -> None:
    member = login(world.member)
    page = member.get(projects_url(world))
    assert page.status_code == 200
    html = page.content.decode()
    assert world.issued.masked in member.get(keys_url(world)).content.decode()
    assert "<form method=\"post\" action=\"/console/t/" not in html.replace(
        'action="/console/switch/"', "").replace('action="/console/logout/"', "")
    assert member.post(projects_url(world), {"slug": "x"}).status_code == 403
    assert member.post(issue_url(world), {f"{world.web.public_id}-name": "x"}).status_code == 403
    assert member.get(key_url(world)).status_code == 200
    assert member.post(key_url(world), {"name": "x"}).status_code == 403
    assert member.post(key_url(world, "rotate/"), {"grace_seconds": "0"}).status_code == 403
    assert member.get(key_url(world, "revoke/")).status_code == 403
    assert member.post(key_url(world, "revoke/"), {"confirm": "on"}).status_code == 403
    assert not Project.objects.filter(slug="x").exists()
    assert ApiKey.objects.count() == 2

    outsider = login(world.outsider)
    for url in (projects_url(world), key_url(world), key_url(world, "revoke/")):
        assert outsider.get(url).status_code == 404
    assert outsider.post(projects_url(world), {"slug": "x"}).status_code == 404
    assert outsider.post(issue_url(world), {}).status_code == 404
    assert outsider.post(key_url(world, "rotate/"), {"grace_seconds": "0"}).status_code == 404
    assert outsider.post(key_url(world, "revoke/"), {"confirm": "on"}).status_code == 404
    assert world.issued.api_key.__class__.objects.get(pk=world.issued.api_key.pk).revoked_at is None


def test_anonymous_is_sent_to_login(world: World) -> None:
    response = Client().get(projects_url(world))
    assert response.status_code == 302 and "/console/login/" in response["Location"]


def test_foreign_objects_inside_own_tenant_url_are_404(world: World) -> None:
    owner = login(world.owner)
    foreign_key = world.other_issued.api_key
    assert owner.get(key_url(world, key=foreign_key)).status_code == 404
    assert owner.post(key_url(world, "rotate/", key=foreign_key),
                      {"grace_seconds": "0"}).status_code == 404
    assert owner.post(key_url(world, "revoke/", key=foreign_key),
                      {"confirm": "on"}).status_code == 404
    assert owner.post(issue_url(world, world.app), {f"{world.app.public_id}-name": "x"}
                      ).status_code == 404
    assert ApiKey.objects.filter(project=world.app).count() == 1
    assert ApiKey.objects.get(pk=foreign_key.pk).revoked_at is None


def test_forms_need_csrf(world: World) -> None:
    client = login(world.owner, csrf=True)
    assert client.post(projects_url(world), {"slug": "new"}).status_code == 403
    assert client.post(issue_url(world), {f"{world.web.public_id}-name": "x"}).status_code == 403
    assert client.post(key_url(world, "revoke/"), {"confirm": "on"}).status_code == 403
    assert not Project.objects.filter(slug="new").exists()


def test_create_project(world: World) -> None:
    owner = login(world.owner)
    response = owner.post(projects_url(world), {
        "slug": "batch", "name": "Batch jobs", "tokens_per_day": "500", "tokens_per_month": "",
    })
    assert response.status_code == 302
    project = Project.objects.get(tenant=world.acme, slug="batch")
    assert (project.name, project.tokens_per_day, project.tokens_per_month) == (
        "Batch jobs", 500, None)
    assert AuditEvent.objects.filter(action="project.created", target=project.public_id,
                                     actor="user:owner").exists()
    assert "Batch jobs" in owner.get(projects_url(world)).content.decode()


@pytest.mark.parametrize(("data", "field_error"), [
    ({"slug": "web"}, "already exists"),  # taken in this tenant
    ({"slug": "Not a slug!"}, "valid"),
    ({"slug": "big", "tokens_per_day": "-5"}, "greater than or equal to 0"),
    ({"slug": "big", "tokens_per_day": "999999999999"}, "the tenant&#x27;s daily token limit"),
])
def test_bad_project_input_rerenders_and_writes_nothing(
    world: World, data: dict[str, str], field_error: str
) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    before = (Project.objects.count(), AuditEvent.objects.count())
    response = login(world.owner).post(projects_url(world), data)
    assert response.status_code == 400
    html = response.content.decode()
    assert field_error in html and 'class="errorlist' in html
    assert 'id="new-project"' in html
    assert (Project.objects.count(), AuditEvent.objects.count()) == before


def test_same_slug_in_another_tenant_is_fine(world: World) -> None:
    response = login(world.owner).post(projects_url(world), {"slug": "app"})
    assert response.status_code == 302
    assert Project.objects.filter(slug="app").count() == 2


def test_issued_key_is_shown_once_and_never_again(world: World) -> None:
    owner = login(world.owner)
    response = owner.post(issue_url(world), {f"{world.web.public_id}-name": "deploy"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    html = response.content.decode()
    plaintext = shown_key(html)
    assert "Copy this key now. You will not see it again." in html
    assert 'data-copy="#new-key"' in html and 'class="card secret-once"' in html
    api_key = ApiKey.objects.get(name="deploy")
    assert api_key.project == world.web and api_key.created_by == "user:owner"
    # Not kept anywhere a later page could read it.
    assert plaintext not in str(dict(owner.session.items()))
    for url in (projects_url(world), keys_url(world), key_url(world, key=api_key),
                key_url(world, "revoke/", api_key),
                f"/console/t/{world.acme.public_id}/limits/",
                f"/console/t/{world.acme.public_id}/audit/"):
        page = owner.get(url)
        assert page.status_code == 200, url
        assert plaintext not in page.content.decode(), url
    assert not AuditEvent.objects.filter(data__icontains=plaintext).exists()
    assert "deploy" in owner.get(keys_url(world)).content.decode()


def test_bad_key_name_rerenders_projects_page(world: World) -> None:
    before = ApiKey.objects.count()
    response = login(world.owner).post(issue_url(world), {f"{world.web.public_id}-name": "x" * 201})
    assert response.status_code == 400
    assert "at most 200 characters" in response.content.decode()
    assert ApiKey.objects.count() == before


def test_key_detail_shows_masked_secret_and_limits_form(world: World) -> None:
    page = login(world.owner).get(key_url(world))
    assert page.status_code == 200
    html = page.content.decode()
    assert world.issued.masked in html and world.issued.plaintext not in html
    assert '<label for="id_tokens_per_day">' in html and 'id="rotate-key"' in html
    assert '<label for="id_grace_seconds">' in html
    for grace in ("0", "3600", "86400", "604800"):
        assert f'value="{grace}"' in html


def test_key_limits_within_project_and_tenant(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    owner = login(world.owner)
    api_key = world.issued.api_key
    too_big = owner.post(key_url(world), {"name": "ci", "tokens_per_day": "5000"})
    assert too_big.status_code == 400
    assert "the tenant&#x27;s daily token limit" in too_big.content.decode()
    api_key.refresh_from_db()
    assert api_key.tokens_per_day is None
    assert not AuditEvent.objects.filter(action="key.updated").exists()

    ok = owner.post(key_url(world), {"name": "ci-2", "tokens_per_day": "800",
                                     "requests_per_minute": "60", "allowed_models": "gpt-4o-mini"})
    assert ok.status_code == 302
    api_key.refresh_from_db()
    assert (api_key.name, api_key.tokens_per_day, api_key.requests_per_minute,
            api_key.allowed_models) == ("ci-2", 800, 60, ["gpt-4o-mini"])
    assert AuditEvent.objects.filter(action="key.updated", target=api_key.public_id).exists()


def test_rotate_shows_new_key_once_with_grace(world: World) -> None:
    owner = login(world.owner)
    response = owner.post(key_url(world, "rotate/"), {"grace_seconds": "3600"})
    assert response.status_code == 200
    html = response.content.decode()
    plaintext = shown_key(html)
    assert plaintext != world.issued.plaintext
    assert "You will not see it again." in html and "after 1 hour" in html
    secrets = list(world.issued.api_key.secrets.order_by("created_at"))
    assert len(secrets) == 2 and secrets[0].expires_at is not None
    assert plaintext not in owner.get(key_url(world)).content.decode()


def test_rotate_with_bad_grace_writes_nothing(world: World) -> None:
    response = login(world.owner).post(key_url(world, "rotate/"), {"grace_seconds": "5"})
    assert response.status_code == 400
    assert "Select a valid choice" in response.content.decode()
    assert world.issued.api_key.secrets.count() == 1


def test_rotating_a_revoked_key_is_refused(world: World) -> None:
    revoke_key(world.issued.api_key, actor="test")
    response = login(world.owner).post(key_url(world, "rotate/"), {"grace_seconds": "0"},
                                       follow=True)
    assert "revoked" in response.content.decode()
    assert world.issued.api_key.secrets.count() == 1


def test_revoke_needs_confirmation(world: World) -> None:
    owner = login(world.owner)
    confirm_page = owner.get(key_url(world, "revoke/"))
    assert confirm_page.status_code == 200
    html = confirm_page.content.decode()
    assert 'data-confirm=' in html and 'type="checkbox"' in html and "required" in html
    unconfirmed = owner.post(key_url(world, "revoke/"), {})
    assert unconfirmed.status_code == 400
    assert ApiKey.objects.get(pk=world.issued.api_key.pk).revoked_at is None

    done = owner.post(key_url(world, "revoke/"), {"confirm": "on"})
    assert done.status_code == 302
    assert ApiKey.objects.get(pk=world.issued.api_key.pk).revoked_at is not None
    assert AuditEvent.objects.filter(action="key.revoked", actor="user:owner").exists()
    page = owner.get(key_url(world)).content.decode()
    assert "revoked" in page and 'id="rotate-key"' not in page


def test_operator_manages_every_tenant(world: World) -> None:
    response = login(world.operator).post(issue_url(world), {f"{world.web.public_id}-name": "ops"})
    assert response.status_code == 200
    assert ApiKey.objects.get(name="ops").created_by == "user:operator"
