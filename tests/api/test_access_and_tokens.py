"""The management API's foundation: who sees which tenant, bearer tokens, the schema."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import AuditEvent, ManagementToken
from tenants.services import issue_management_token, revoke_management_token
from tests.support.api_clients import bearer
from tests.world import World


def test_anonymous_is_401_or_403(world: World) -> None:
    response = APIClient().get("/api/tenants/")
    assert response.status_code in (401, 403)
    assert "detail" in response.json()


def test_each_user_lists_only_their_tenants(world: World) -> None:
    def slugs(user: object) -> list[str]:
        response = world.client(user).get("/api/tenants/")
        assert response.status_code == 200
        return [t["slug"] for t in response.json()["results"]]

    assert slugs(world.owner) == ["acme"]
    assert slugs(world.member) == ["acme"]
    assert slugs(world.outsider) == ["globex"]
    assert slugs(world.operator) == ["acme", "globex"]


def test_tenant_detail_owner_member_outsider(world: World) -> None:
    url = f"/api/tenants/{world.acme.public_id}/"
    owner = world.client(world.owner).get(url)
    assert owner.status_code == 200
    assert owner.json()["id"] == world.acme.public_id
    assert owner.json()["role"] == "owner"
    assert world.client(world.member).get(url).json()["role"] == "member"
    assert world.client(world.outsider).get(url).status_code == 404
    assert world.client(world.operator).get(url).status_code == 200
    # No database ids anywhere in the representation.
    assert "pk" not in owner.json() and not str(owner.json()["id"]).isdigit()


def test_unknown_tenant_and_foreign_tenant_look_the_same(world: World) -> None:
    client = world.client(world.outsider)
    foreign = client.get(f"/api/tenants/{world.acme.public_id}/")
    missing = client.get("/api/tenants/ten_doesnotexist0000/")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json() == missing.json()


def test_tenant_token_sees_only_its_tenant(world: World) -> None:
    issued = issue_management_token(world.acme, name="ci", actor="test")
    assert issued.plaintext.startswith("tgm_")
    client = bearer(issued.plaintext)
    listing = client.get("/api/tenants/").json()["results"]
    assert [t["slug"] for t in listing] == ["acme"]
    assert listing[0]["role"] == "admin"
    assert client.get(f"/api/tenants/{world.globex.public_id}/").status_code == 404
    token = ManagementToken.objects.get(pk=issued.token.pk)
    assert token.last_used_at is not None
    # Only a digest is stored.
    assert issued.plaintext not in {token.digest, token.prefix, token.last4}
    assert not AuditEvent.objects.filter(data__icontains=issued.plaintext).exists()


def test_operator_token_sees_every_tenant(world: World) -> None:
    issued = issue_management_token(None, name="ops", actor="test")
    listing = bearer(issued.plaintext).get("/api/tenants/").json()["results"]
    assert {t["slug"] for t in listing} == {"acme", "globex"}


@pytest.mark.parametrize("header", [
    "Bearer nonsense",
    "Bearer tgm_AAAAAAAAAAAA_" + "B" * 40,  # well formed, unknown
    "Bearer a b",
])
def test_bad_tokens_are_401(world: World, header: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/tenants/")
    assert response.status_code == 401
    assert "detail" in response.json()


def test_v1_api_keys_are_not_management_tokens(world: World) -> None:
    response = bearer(world.issued.plaintext).get("/api/tenants/")
    assert response.status_code == 401


def test_revoked_and_expired_tokens_are_refused(world: World) -> None:
    revoked = issue_management_token(world.acme, name="old", actor="test")
    assert revoke_management_token(revoked.token, actor="test") is True
    assert revoke_management_token(revoked.token, actor="test") is False
    assert bearer(revoked.plaintext).get("/api/tenants/").status_code == 401

    expiring = issue_management_token(world.acme, name="short", actor="test",
                                      expires_at=timezone.now() + timedelta(minutes=1))
    ManagementToken.objects.filter(pk=expiring.token.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    assert bearer(expiring.plaintext).get("/api/tenants/").status_code == 401


def test_token_needs_a_name(world: World) -> None:
    with pytest.raises(ValueError):
        issue_management_token(world.acme, name="  ", actor="test")
    assert not ManagementToken.objects.exists()


def test_token_issue_and_revoke_are_audited(world: World) -> None:
    issued = issue_management_token(world.acme, name="ci", actor="user:owner")
    revoke_management_token(issued.token, actor="user:owner")
    actions = list(AuditEvent.objects.filter(target=issued.token.public_id)
                   .values_list("action", flat=True))
    assert sorted(actions) == ["token.issued", "token.revoked"]


def test_openapi_schema_and_docs_page(world: World) -> None:
    client = world.client(world.owner)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    assert "/api/tenants/" in schema.json()["paths"]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "swagger-ui" in html and "cdn" not in html.lower()  # assets served locally
