"""Management tokens and the management API's secure defaults (issue 11, items 8 and 13).

Tokens: each scope against a read, a key write and a full-admin write; the scope and expiry
chosen at issue in the API, the console and the CLI (default: full, 90 days); expired tokens are
401; a token dies with its issuer's admin rights (removal, demotion, deactivation) and cannot
mint a wider or longer-lived one. The API: the schema and docs need a signed-in user or a token;
pagination is bounded and strict; a tenant sees only its own plans; responses carrying a secret
are `Cache-Control: no-store`; unknown /api/ paths and unsupported bodies get JSON errors.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import ApiKey, AuditEvent, Invitation, ManagementToken, Membership
from tenants.services import issue_management_token
from tests.support.api_clients import bearer
from tests.world import World

DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _tenant_url(world: World, rest: str = "") -> str:
    return f"/api/tenants/{world.acme.public_id}/{rest}"


def _counts() -> tuple[int, int, int]:
    return ApiKey.objects.count(), Invitation.objects.count(), AuditEvent.objects.count()


# -- scopes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("scope", "key_write", "full_write"), [
    ("read", 403, 403), ("keys", 201, 403), ("full", 201, 201),
])
def test_each_scope_against_a_read_a_key_write_and_a_full_write(
        world: World, scope: str, key_write: int, full_write: int) -> None:
    client = bearer(issue_management_token(world.acme, name=scope, actor="test",
                                           scope=scope).plaintext)
    read = client.get(_tenant_url(world, "keys/"))
    assert read.status_code == 200 and read.json()["count"] == 1

    before = _counts()
    issued = client.post(_tenant_url(world, "keys/"),
                         {"project": world.web.public_id, "name": "new"}, format="json")
    assert issued.status_code == key_write, issued.content
    invited = client.post(_tenant_url(world, "invitations/"),
                          {"email": "new@acme.test", "role": "member"}, format="json")
    assert invited.status_code == full_write, invited.content

    refused = [r for r in (issued, invited) if r.status_code == 403]
    for response in refused:
        needed = "keys" if response is issued else "full"
        assert response.json() == {
            "detail": f"This management token's scope is '{scope}'; this request needs "
                      f"'{needed}'."}
    keys, invitations, _ = _counts()
    assert keys == before[0] + (key_write == 201)
    assert invitations == before[1] + (full_write == 201)


def test_a_console_session_is_not_narrowed_by_scopes(world: World) -> None:
    # Scopes narrow tokens only; an owner's session does everything an owner may.
    owner = world.client(world.owner)
    assert owner.post(_tenant_url(world, "invitations/"),
                      {"email": "x@acme.test", "role": "member"}, format="json").status_code == 201


# -- issuing: scope and expiry in the API, the console and the CLI -----------------------------


def test_api_issue_chooses_scope_and_expiry_with_defaults(world: World) -> None:
    owner = world.client(world.owner)
    url = _tenant_url(world, "tokens/")
    default = owner.post(url, {"name": "default"}, format="json").json()
    assert default["scope"] == "full" and default["issued_by"] == "owner"
    expires = timezone.datetime.fromisoformat(default["expires_at"])
    assert abs(expires - (timezone.now() + 90 * DAY)) < timedelta(minutes=1)

    never = owner.post(url, {"name": "never", "scope": "read", "expires_at": None}, format="json")
    assert never.status_code == 201
    assert (never.json()["scope"], never.json()["expires_at"]) == ("read", None)
    assert ManagementToken.objects.get(public_id=never.json()["id"]).scope == "read"

    bad = owner.post(url, {"name": "x", "scope": "admin"}, format="json")
    assert bad.status_code == 400 and "scope" in bad.json()


def test_console_issue_chooses_scope_and_lifetime(world: World) -> None:
    owner = world.client(world.owner)
    page = f"/console/t/{world.acme.public_id}/tokens/"
    assert 'name="scope"' in owner.get(page).content.decode()
    response = owner.post(page, {"name": "ci", "scope": "keys", "lifetime": "7"})
    assert response.status_code == 200, response.status_code
    token = ManagementToken.objects.get(name="ci")
    assert token.scope == "keys" and token.issued_by == world.owner
    assert abs(token.expires_at - (timezone.now() + 7 * DAY)) < timedelta(minutes=1)
    owner.post(page, {"name": "forever", "scope": "read", "lifetime": "never"})
    assert ManagementToken.objects.get(name="forever").expires_at is None
    refused = owner.post(page, {"name": "bad", "scope": "root", "lifetime": "7"})
    assert refused.status_code == 400 and not ManagementToken.objects.filter(name="bad").exists()


def test_cli_issue_chooses_scope_and_expiry(world: World) -> None:
    out = io.StringIO()
    call_command("mgmt_token_issue", "--tenant", "acme", "--name", "ro", "--scope", "read",
                 "--expires-in-days", "3", "--json", stdout=out)
    data = json.loads(out.getvalue())
    token = ManagementToken.objects.get(public_id=data["token_id"])
    assert (data["scope"], token.scope, token.issued_by) == ("read", "read", None)
    assert abs(token.expires_at - (timezone.now() + 3 * DAY)) < timedelta(minutes=1)
    assert bearer(data["token"]).post(_tenant_url(world, "projects/"), {"slug": "x"},
                                      format="json").status_code == 403

    out = io.StringIO()
    call_command("mgmt_token_issue", "--tenant", "acme", "--name", "forever", "--no-expiry",
                 "--json", stdout=out)
    forever = ManagementToken.objects.get(public_id=json.loads(out.getvalue())["token_id"])
    assert (forever.scope, forever.expires_at) == ("full", None)
    out = io.StringIO()
    call_command("mgmt_token_issue", "--operator", "--name", "default", "--json", stdout=out)
    default = ManagementToken.objects.get(public_id=json.loads(out.getvalue())["token_id"])
    assert abs(default.expires_at - (timezone.now() + 90 * DAY)) < timedelta(minutes=1)


def test_expired_token_gets_401_in_the_api_error_shape(world: World) -> None:
    issued = issue_management_token(world.acme, name="short", actor="test",
                                    expires_at=timezone.now() + DAY)
    client = bearer(issued.plaintext)
    assert client.get(_tenant_url(world)).status_code == 200
    ManagementToken.objects.filter(pk=issued.token.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    response = client.get(_tenant_url(world))
    assert response.status_code == 401
    assert set(response.json()) == {"detail"} and "expired" in response.json()["detail"]


def test_a_token_cannot_mint_a_wider_or_longer_lived_token(world: World) -> None:
    parent = issue_management_token(world.acme, name="parent", actor="test",
                                    expires_at=timezone.now() + 2 * DAY, issued_by=world.owner)
    client = bearer(parent.plaintext)
    url = _tenant_url(world, "tokens/")
    later = client.post(url, {"name": "later", "expires_at": None}, format="json")
    assert later.status_code == 400 and "expires_at" in later.json()
    child = client.post(url, {"name": "child", "scope": "keys"}, format="json")
    assert child.status_code == 201
    # The default 90 days is capped at the parent's expiry; the child carries the same user.
    assert child.json()["expires_at"] == parent.token.expires_at.isoformat().replace(
        "+00:00", "Z")
    assert child.json()["issued_by"] == "owner"
    keys_only = bearer(issue_management_token(world.acme, name="k", actor="test",
                                              scope="keys").plaintext)
    assert keys_only.post(url, {"name": "wider"}, format="json").status_code == 403
    assert not ManagementToken.objects.filter(name__in=["later", "wider"]).exists()


# -- a token dies with its issuer's rights ---------------------------------------------------


def _admin_with_tokens(world: World) -> tuple[str, str, str]:
    """member, made an admin, issues a token in the console session and a child with it; plus
    the owner's own token. Returns the three plaintexts."""
    Membership.objects.filter(user=world.member, tenant=world.acme).update(role="admin")
    mine = world.client(world.member).post(_tenant_url(world, "tokens/"), {"name": "admin's"},
                                           format="json").json()["token"]
    child = bearer(mine).post(_tenant_url(world, "tokens/"), {"name": "child"},
                              format="json").json()["token"]
    owners = world.client(world.owner).post(_tenant_url(world, "tokens/"), {"name": "owner's"},
                                            format="json").json()["token"]
    for token in (mine, child, owners):
        assert bearer(token).get(_tenant_url(world)).status_code == 200
    return mine, child, owners


def test_removing_a_member_revokes_their_tokens(world: World) -> None:
    mine, child, owners = _admin_with_tokens(world)
    removed = world.client(world.owner).delete(_tenant_url(world, "members/member/"))
    assert removed.status_code == 204
    assert bearer(mine).get(_tenant_url(world)).status_code == 401
    assert bearer(child).get(_tenant_url(world)).status_code == 401
    assert bearer(owners).get(_tenant_url(world)).status_code == 200
    revoked = AuditEvent.objects.filter(action="token.revoked", actor="user:owner")
    assert sorted(event.data["reason"] for event in revoked) == [
        "issuer removed from the tenant"] * 2


def test_demotion_to_member_revokes_tokens_owner_to_admin_keeps_them(world: World) -> None:
    mine, child, owners = _admin_with_tokens(world)
    owner = world.client(world.owner)
    Membership.objects.create(user=world.operator, tenant=world.acme, role="owner")
    # owner -> admin: an admin may do all a token may, so the owner's token lives on.
    assert owner.patch(_tenant_url(world, "members/owner/"), {"role": "admin"},
                       format="json").status_code == 200
    assert bearer(owners).get(_tenant_url(world)).status_code == 200
    # admin -> member: may no longer change the tenant, so neither may their tokens.
    assert world.client(world.operator).patch(_tenant_url(world, "members/member/"),
                                              {"role": "member"}, format="json").status_code == 200
    assert bearer(mine).get(_tenant_url(world)).status_code == 401
    assert bearer(child).get(_tenant_url(world)).status_code == 401


def test_deactivated_user_tokens_stop(world: World) -> None:
    mine, _, _ = _admin_with_tokens(world)
    world.member.is_active = False
    world.member.save(update_fields=["is_active"])
    assert bearer(mine).get(_tenant_url(world)).status_code == 401


# -- the schema and docs need a caller ------------------------------------------------------


def test_schema_and_docs_require_authentication(world: World) -> None:
    token = issue_management_token(world.acme, name="docs", actor="test", scope="read")
    for url in ("/api/schema/", "/api/docs/"):
        assert APIClient().get(url).status_code == 401
        assert world.client(world.member).get(url).status_code == 200
        assert bearer(token.plaintext).get(url).status_code == 200


# -- pagination -------------------------------------------------------------------------------


@pytest.mark.parametrize("query", [
    "limit=" + "9" * 21, "limit=201", "limit=0", "limit=-1", "limit=abc", "limit=1.5",
    "offset=" + "9" * 21, "offset=-1", "limit=5&limit=6", "limit=",
])
def test_absurd_pagination_is_a_400(world: World, query: str) -> None:
    response = world.client(world.operator).get(f"/api/plans/?{query}")
    assert response.status_code == 400, response.content
    (field,) = response.json()
    assert field in ("limit", "offset")


def test_pagination_within_bounds(world: World) -> None:
    operator = world.client(world.operator)
    assert operator.get("/api/plans/?limit=200&offset=0").json()["count"] == 3
    page = operator.get("/api/plans/?limit=1&offset=1").json()
    assert [plan["name"] for plan in page["results"]] == ["free"]


# -- plans a tenant sees ------------------------------------------------------------------------


def test_a_tenant_sees_only_its_own_plans(world: World) -> None:
    token = bearer(issue_management_token(world.acme, name="t", actor="test").plaintext)
    for client in (token, world.client(world.owner), world.client(world.member)):
        listing = client.get("/api/plans/")
        assert [plan["name"] for plan in listing.json()["results"]] == ["standard"]
        assert client.get("/api/plans/standard/").status_code == 200
        assert client.get("/api/plans/enterprise/").status_code == 404
    everything = world.client(world.operator).get("/api/plans/").json()["results"]
    assert [plan["name"] for plan in everything] == ["enterprise", "free", "standard"]


# -- secrets are never cached ---------------------------------------------------------------------


def test_responses_carrying_a_secret_are_no_store(world: World) -> None:
    owner = world.client(world.owner)
    invitation = owner.post(_tenant_url(world, "invitations/"),
                            {"email": "new@acme.test", "role": "member"}, format="json")
    token = owner.post(_tenant_url(world, "tokens/"), {"name": "t"}, format="json")
    key = owner.post(_tenant_url(world, "keys/"),
                     {"project": world.web.public_id, "name": "k"}, format="json")
    rotated = owner.post(_tenant_url(world, f"keys/{key.json()['id']}/rotate"), {},
                         format="json")
    for response, secret in ((invitation, "accept_url"), (token, "token"), (key, "key"),
                             (rotated, "key")):
        assert response.status_code in (200, 201) and response.json()[secret]
        assert response["Cache-Control"] == "no-store"
    listing = owner.get(_tenant_url(world, "tokens/"))
    assert "no-store" not in listing.get("Cache-Control", "")


# -- JSON errors only ----------------------------------------------------------------------------


def test_unknown_api_path_and_non_json_body_get_json_errors(world: World) -> None:
    owner = world.client(world.owner)
    missing = owner.get("/api/no-such-thing/%C3%B5")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not found."}
    unsupported = owner.post(_tenant_url(world, "projects/"), "slug: x",
                             content_type="text/yaml")
    assert unsupported.status_code == 415 and set(unsupported.json()) == {"detail"}
    assert not world.acme.projects.filter(slug="x").exists()
    nul = owner.get(_tenant_url(world, "keys/?project=prj_%00"))
    assert nul.status_code == 400 and "project" in nul.json()


# -- the schema's constraints are the server's -------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("post", "keys/", {"name": "big", "tokens_per_day": 10**15 + 1}, "tokens_per_day"),
    ("post", "projects/", {"slug": "big", "tokens_per_month": 10**30}, "tokens_per_month"),
    ("post", "tokens/", {"name": "naive", "expires_at": "2099-01-01T00:00"}, "expires_at"),
    ("post", "tokens/", {"name": "short", "expires_at": "2099-1-1T00:00:00Z"}, "expires_at"),
    ("get", "audit-events/?from=2026-1-5", None, "from"),
    ("get", "audit-events/?to=", None, "to"),
    ("get", "usage?from=", None, "from"),
    ("get", "keys/?status=", None, "status"),
    ("get", "audit-events/?action=" + "a" * 65, None, "action"),
])
def test_input_the_schema_refuses_is_a_400(world: World, method: str, path: str,
                                           body: dict[str, Any] | None, field: str) -> None:
    owner = world.client(world.owner)
    if body is not None and path == "keys/":
        body = {**body, "project": world.web.public_id}
    before = _counts()
    response = getattr(owner, method)(_tenant_url(world, path), body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert _counts() == before


def test_rfc3339_expiry_with_offset_is_taken(world: World) -> None:
    response = world.client(world.owner).post(
        _tenant_url(world, "tokens/"), {"name": "ok", "expires_at": "2099-01-01T00:00:00+02:00"},
        format="json")
    assert response.status_code == 201 and response.json()["expires_at"] == "2098-12-31T22:00:00Z"


def test_schema_documents_every_error_and_what_responses_really_are(world: World) -> None:
    schema = world.client(world.owner).get(
        "/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            assert {"401", "403", "429"} <= codes, (method, path, codes)
            if "{" in path:
                assert "404" in codes, (method, path)
            if method != "get":
                assert "400" in codes, (method, path)
            for code in codes - {"204"}:
                assert operation["responses"][code].get("content"), (method, path, code)
    components = schema["components"]["schemas"]
    assert "format" not in components["Member"]["properties"]["email"]
    audit = schema["paths"]["/api/tenants/{tenant_id}/audit-events/"]["get"]
    assert audit["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/PaginatedAuditEventList"}
    limit = next(p for p in audit["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 200)
    fmt = next(p for p in schema["paths"]["/api/reports/{month}.{fmt}"]["get"]["parameters"]
               if p["name"] == "fmt")
    assert fmt["schema"]["pattern"] == "^(?:csv|xlsx)$"


def test_a_member_without_email_matches_the_schema(world: World) -> None:
    from django.contrib.auth import get_user_model

    nomail = get_user_model().objects.create_user("nomail", "", "x")
    Membership.objects.create(user=nomail, tenant=world.acme, role="member")
    members = world.client(world.owner).get(_tenant_url(world, "members/")).json()["results"]
    assert {"id": "nomail", "username": "nomail", "email": "", "role": "member"} in members


def test_nul_in_a_plan_name_or_model_name_is_a_400_not_a_500(world: World) -> None:
    """Found by the schema fuzz test (seed 4): a plan name with a NUL reached PostgreSQL."""
    operator = world.client(world.operator)
    before = _counts()
    for body, field in (({"plan": "stand\x00ard"}, "plan"),
                        ({"model_tokens_per_day": {"gpt\x00": 5}}, "model_tokens_per_day")):
        path = "limits" if field == "model_tokens_per_day" else ""
        response = operator.patch(_tenant_url(world, path), body, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json()
    created = operator.post("/api/tenants/", {"slug": "nul", "plan": "x\x00"}, format="json")
    assert created.status_code == 400 and "plan" in created.json()
    assert _counts() == before


def test_a_removed_member_cannot_issue_through_a_stale_request(world: World) -> None:
    """Issue and removal lock the same membership row: once the removal is in, a token issued on
    the member's behalf (a request that passed its permission check earlier) is refused."""
    Membership.objects.filter(user=world.member, tenant=world.acme).delete()
    with pytest.raises(ValidationError, match="may no longer change this tenant"):
        issue_management_token(world.acme, name="late", actor="user:member",
                               issued_by=world.member)
    assert not ManagementToken.objects.filter(name="late").exists()


def test_an_unknown_format_parameter_is_ignored_not_a_404(world: World) -> None:
    """Found by the schema fuzz test (seed 5): DRF's `?format=` override answered an unknown
    format with an undocumented 404."""
    response = world.client(world.owner).get("/api/plans/?format=xyz")
    assert response.status_code == 200 and response.json()["results"][0]["name"] == "standard"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("projects/", {"slug": "typed", "name": 8785914689034124330}, "name"),
    ("projects/", {"slug": "typed", "tokens_per_day": "5"}, "tokens_per_day"),
    ("projects/", {"slug": "typed", "tokens_per_day": True}, "tokens_per_day"),
    ("keys/", {"name": "k", "allowed_models": [1, 2]}, "allowed_models"),
    ("tokens/", {"name": ["x"]}, "name"),
    ("invitations/", {"email": "a@acme.test", "role": 1}, "role"),
    # 201 characters as sent, 200 once DRF trims the tab (seed 7).
    ("projects/", {"slug": "typed", "name": "\t" + "n" * 200}, "name"),
])
def test_json_values_of_another_type_are_a_400(world: World, path: str, body: dict[str, Any],
                                               field: str) -> None:
    """Found by the schema fuzz test (seed 6): DRF took 8785914689034124330 as the name "87...";
    the schema says string, so the server now says so too."""
    if path == "keys/":
        body = {**body, "project": world.web.public_id}
    before = _counts()
    response = world.client(world.owner).post(_tenant_url(world, path), body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert _counts() == before
    assert not world.acme.projects.filter(slug="typed").exists()
