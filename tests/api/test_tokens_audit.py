"""Management API: a tenant's management tokens and audit events; the mgmt_token_issue command."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from tenants.models import AuditEvent, ManagementToken
from tenants.services import record_audit_event
from tests.support.api_clients import bearer
from tests.world import World


def tokens_url(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/tokens/"


def audit_url(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/audit-events/"


def test_issue_list_revoke_tokens(world: World) -> None:
    owner = world.client(world.owner)
    issued = owner.post(tokens_url(world), {"name": "terraform"}, format="json")
    assert issued.status_code == 201, issued.json()
    assert issued["Cache-Control"] == "no-store"
    body = issued.json()
    plaintext = body["token"]
    assert plaintext.startswith("tgm_") and body["status"] == "active"
    assert bearer(plaintext).get(f"/api/tenants/{world.acme.public_id}/").status_code == 200
    listing = owner.get(tokens_url(world))
    assert listing.status_code == 200 and listing.json()["count"] == 1
    assert plaintext not in listing.content.decode()
    assert not AuditEvent.objects.filter(data__icontains=plaintext).exists()

    revoked = owner.post(f"{tokens_url(world)}{body['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert bearer(plaintext).get(f"/api/tenants/{world.acme.public_id}/").status_code == 401


def test_tokens_owner_member_outsider(world: World) -> None:
    from tenants.services import issue_management_token

    own = issue_management_token(world.acme, name="ci", actor="test").token
    foreign = issue_management_token(world.globex, name="theirs", actor="test").token
    member, outsider = world.client(world.member), world.client(world.outsider)
    assert member.get(tokens_url(world)).status_code == 200
    assert outsider.get(tokens_url(world)).status_code == 404
    before = ManagementToken.objects.count()
    assert member.post(tokens_url(world), {"name": "x"}, format="json").status_code == 403
    assert outsider.post(tokens_url(world), {"name": "x"}, format="json").status_code == 404
    assert member.post(f"{tokens_url(world)}{own.public_id}/revoke").status_code == 403
    assert outsider.post(f"{tokens_url(world)}{own.public_id}/revoke").status_code == 404
    # Another tenant's token inside acme's URL.
    owner = world.client(world.owner)
    assert owner.post(f"{tokens_url(world)}{foreign.public_id}/revoke/").status_code == 404
    assert ManagementToken.objects.count() == before
    assert not ManagementToken.objects.filter(revoked_at__isnull=False).exists()
    assert owner.post(tokens_url(world), {"name": ""}, format="json").status_code == 400
    past = (timezone.now() - timedelta(days=1)).isoformat()
    expired = owner.post(tokens_url(world), {"name": "x", "expires_at": past}, format="json")
    assert expired.status_code == 400 and "expires_at" in expired.json()


def test_audit_events_filters_newest_first(world: World) -> None:
    client = world.client(world.owner)
    client.post(f"/api/tenants/{world.acme.public_id}/keys/",
                {"project": world.web.public_id, "name": "a"}, format="json")
    old = record_audit_event(tenant=world.acme, actor="user:old", action="key.revoked",
                             target="key_x")
    AuditEvent.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=10))
    record_audit_event(tenant=world.globex, actor="user:outsider", action="key.issued",
                       target="key_y")

    everything = client.get(audit_url(world)).json()
    times = [e["created_at"] for e in everything["results"]]
    assert times == sorted(times, reverse=True)
    assert all(e["target"] != "key_y" for e in everything["results"])
    assert everything["results"][0]["action"] == "key.issued"
    assert everything["results"][0]["actor"] == "user:owner"

    # The trail is paged by cursor (no count: counting a million events cost every page).
    issued = client.get(audit_url(world), {"action": "key.issued", "actor": "owner"}).json()
    assert len(issued["results"]) == 1 and issued["next"] is None
    family = client.get(audit_url(world), {"action": "key."}).json()
    assert {e["action"] for e in family["results"]} == {"key.issued", "key.revoked"}
    today = timezone.now().date().isoformat()
    recent = client.get(audit_url(world), {"from": today, "to": today}).json()
    assert all(e["actor"] != "user:old" for e in recent["results"])
    ten_days_ago = (timezone.now() - timedelta(days=10)).date().isoformat()
    only_old = client.get(audit_url(world), {"from": ten_days_ago, "to": ten_days_ago}).json()
    assert [e["actor"] for e in only_old["results"]] == ["user:old"]
    paged = client.get(audit_url(world), {"limit": 1}).json()
    assert len(paged["results"]) == 1 and paged["next"]


@pytest.mark.parametrize(("params", "field"), [
    ({"from": "2026-13-01"}, "from"),
    ({"to": "yesterday"}, "to"),
    ({"from": "2026-11-02", "to": "2026-11-01"}, "to"),
])
def test_bad_audit_dates_are_400(world: World, params: dict[str, str], field: str) -> None:
    response = world.client(world.owner).get(audit_url(world), params)
    assert response.status_code == 400 and field in response.json()


def test_audit_owner_member_outsider(world: World) -> None:
    assert world.client(world.member).get(audit_url(world)).status_code == 200
    assert world.client(world.outsider).get(audit_url(world)).status_code == 404


def test_mgmt_token_issue_command(world: World) -> None:
    out = io.StringIO()
    call_command("mgmt_token_issue", "--tenant", "acme", "--name", "deploy", stdout=out)
    plaintext = next(word for word in out.getvalue().split() if word.startswith("tgm_"))
    token = ManagementToken.objects.get(name="deploy")
    assert token.tenant == world.acme and token.created_by == "cli"
    assert bearer(plaintext).get("/api/tenants/").json()["count"] == 1

    out = io.StringIO()
    call_command("mgmt_token_issue", "--operator", "--name", "ops", stdout=out)
    operator = next(word for word in out.getvalue().split() if word.startswith("tgm_"))
    assert bearer(operator).get("/api/tenants/").json()["count"] == 2

    with pytest.raises(CommandError):
        call_command("mgmt_token_issue", "--tenant", "nope", "--name", "x", stdout=io.StringIO())
    with pytest.raises(CommandError):
        call_command("mgmt_token_issue", "--name", "x", stdout=io.StringIO())


def test_admin_shows_tokens_masked_and_revokes(world: World, admin_client: object) -> None:
    from django.urls import reverse

    from tenants.services import issue_management_token

    issued = issue_management_token(world.acme, name="ci", actor="test")
    token = issued.token
    for page_url in (reverse("admin:tenants_managementtoken_changelist"),
                     reverse("admin:tenants_managementtoken_change", args=[token.pk])):
        page = admin_client.get(page_url)
        assert page.status_code == 200
        html = page.content.decode()
        assert token.digest not in html and issued.plaintext not in html
        assert issued.plaintext.rsplit("_", 1)[1] not in html  # the secret part
        assert token.last4 in html
    assert admin_client.get(reverse("admin:tenants_managementtoken_add")).status_code == 403
    response = admin_client.post(reverse("admin:tenants_managementtoken_changelist"), {
        "action": "revoke_selected", "_selected_action": [token.pk]})
    assert response.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert AuditEvent.objects.filter(action="token.revoked", target=token.public_id,
                                     actor="user:admin").exists()
    assert bearer(issued.plaintext).get("/api/tenants/").status_code == 401
