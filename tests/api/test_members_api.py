"""Management API: members and invitations. Owner may, member reads only (403 on changes),
outsider gets 404; another tenant's object inside acme's URL is a 404 too."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.utils import timezone

from tenants.api_key_format import digest_key
from tenants.membership import accept_invitation, accept_invitation_as_new_user, invite_member
from tenants.models import AuditEvent, Invitation, Membership
from tests.world import World


def members_url(world: World, tenant: str = "acme") -> str:
    return f"/api/tenants/{getattr(world, tenant).public_id}/members/"


def invitations_url(world: World, tenant: str = "acme") -> str:
    return f"/api/tenants/{getattr(world, tenant).public_id}/invitations/"


def invite(world: World, tenant: str = "globex", email: str = "x@example.test",
           role: str = "admin") -> tuple[Invitation, str]:
    issued = invite_member(getattr(world, tenant), email, role=role, actor="test",
                           accept_url=lambda secret: f"http://testserver/console/invite/{secret}/")
    return issued.invitation, issued.accept_url.rstrip("/").rsplit("/", 1)[1]


def audit_count() -> int:
    return AuditEvent.objects.count()


def test_members_list_for_owner_and_member_404_for_outsider(world: World) -> None:
    for user in (world.owner, world.member, world.operator):
        response = world.client(user).get(members_url(world))
        assert response.status_code == 200, user
        rows = {row["id"]: row["role"] for row in response.json()["results"]}
        assert rows == {"owner": "owner", "member": "member"}
    assert world.client(world.outsider).get(members_url(world)).status_code == 404
    assert world.client(None).get(members_url(world)).status_code in (401, 403)


def test_member_detail_scoped_to_the_tenant(world: World) -> None:
    client = world.client(world.owner)
    assert client.get(members_url(world) + "member/").json()["role"] == "member"
    # outsider is a real user, but of globex: inside acme's URL it does not exist
    assert client.get(members_url(world) + "outsider/").status_code == 404
    assert client.patch(members_url(world) + "outsider/", {"role": "member"}).status_code == 404
    assert client.delete(members_url(world) + "outsider/").status_code == 404
    assert Membership.objects.get(user=world.outsider).role == "owner"


def test_owner_changes_a_role_and_it_is_audited(world: World) -> None:
    response = world.client(world.owner).patch(members_url(world) + "member/", {"role": "admin"})
    assert response.status_code == 200 and response.json()["role"] == "admin"
    assert Membership.objects.get(user=world.member, tenant=world.acme).role == "admin"
    event = AuditEvent.objects.get(action="member.role")
    assert event.actor == "user:owner" and event.target == "member"
    assert event.data == {"role": {"from": "member", "to": "admin"}}


def test_member_cannot_change_roles_or_remove(world: World) -> None:
    client = world.client(world.member)
    before = audit_count()
    assert client.patch(members_url(world) + "member/", {"role": "owner"}).status_code == 403
    assert client.delete(members_url(world) + "owner/").status_code == 403
    assert Membership.objects.get(user=world.member).role == "member"
    assert Membership.objects.filter(tenant=world.acme).count() == 2
    assert audit_count() == before


def test_bad_role_is_400_and_nothing_changes(world: World) -> None:
    before = audit_count()
    response = world.client(world.owner).patch(members_url(world) + "member/", {"role": "god"})
    assert response.status_code == 400 and "role" in response.json()
    assert Membership.objects.get(user=world.member).role == "member"
    assert audit_count() == before


def test_the_last_owner_cannot_be_demoted_or_removed(world: World) -> None:
    client = world.client(world.owner)
    before = audit_count()
    response = client.patch(members_url(world) + "owner/", {"role": "admin"})
    assert response.status_code == 400 and "owner" in response.json()["role"][0]
    assert client.delete(members_url(world) + "owner/").status_code == 400
    assert Membership.objects.get(user=world.owner, tenant=world.acme).role == "owner"
    assert audit_count() == before
    # With a second owner the first may step down.
    assert client.patch(members_url(world) + "member/", {"role": "owner"}).status_code == 200
    assert client.patch(members_url(world) + "owner/", {"role": "admin"}).status_code == 200


def test_an_admin_cannot_touch_owners_or_make_owners(world: World) -> None:
    Membership.objects.filter(user=world.member).update(role="admin")
    client = world.client(world.member)
    assert client.patch(members_url(world) + "member/", {"role": "owner"}).status_code == 403
    assert client.patch(members_url(world) + "owner/", {"role": "member"}).status_code == 403
    assert client.delete(members_url(world) + "owner/").status_code == 403
    assert Membership.objects.get(user=world.owner, tenant=world.acme).role == "owner"
    # An admin may manage admins and members, themselves included.
    assert client.patch(members_url(world) + "member/", {"role": "member"}).status_code == 200


def test_owner_removes_a_member(world: World) -> None:
    response = world.client(world.owner).delete(members_url(world) + "member/")
    assert response.status_code == 204
    assert not Membership.objects.filter(user=world.member, tenant=world.acme).exists()
    assert get_user_model().objects.filter(username="member").exists()  # the account stays
    event = AuditEvent.objects.get(action="member.remove")
    assert event.target == "member" and event.tenant == world.acme
    assert world.client(world.member).get(members_url(world)).status_code == 404


def test_invite_returns_the_link_once_and_mails_it(world: World) -> None:
    response = world.client(world.owner).post(
        invitations_url(world), {"email": "new@acme.test", "role": "member"})
    assert response.status_code == 201
    body = response.json()
    assert body["status"] == "pending" and body["role"] == "member" and body["email_sent"]
    link = body["accept_url"]
    assert link.startswith("http://testserver/console/invite/")
    secret = link.rstrip("/").rsplit("/", 1)[1]
    invitation = Invitation.objects.get(public_id=body["id"])
    assert invitation.digest == digest_key(secret) and secret not in invitation.digest
    [message] = mail.outbox
    assert message.to == ["new@acme.test"] and link in message.body
    event = AuditEvent.objects.get(action="invitation.create")
    assert event.actor == "user:owner" and event.target == invitation.public_id
    assert secret not in str(event.data)
    # Never again: the list shows no link.
    listed = world.client(world.owner).get(invitations_url(world)).json()["results"]
    assert [row["id"] for row in listed] == [body["id"]]
    assert "accept_url" not in listed[0] and secret not in str(listed)


def test_invite_validation_and_permissions(world: World) -> None:
    owner = world.client(world.owner)
    before = (audit_count(), Invitation.objects.count())
    bad = owner.post(invitations_url(world), {"email": "not-an-email", "role": "owner"})
    assert bad.status_code == 400 and set(bad.json()) == {"email", "role"}
    assert world.client(world.member).post(
        invitations_url(world), {"email": "a@b.test"}).status_code == 403
    assert world.client(world.outsider).post(
        invitations_url(world), {"email": "a@b.test"}).status_code == 404
    assert world.client(world.outsider).get(invitations_url(world)).status_code == 404
    assert world.client(world.member).get(invitations_url(world)).status_code == 200
    assert (audit_count(), Invitation.objects.count()) == before
    assert mail.outbox == []


def test_revoke_an_invitation(world: World) -> None:
    invitation, secret = invite(world, tenant="acme")
    foreign, _ = invite(world, tenant="globex")
    url = invitations_url(world) + f"{invitation.public_id}/revoke"
    assert world.client(world.member).post(url).status_code == 403
    assert world.client(world.outsider).post(url).status_code == 404
    # globex's invitation inside acme's URL
    foreign_url = invitations_url(world) + f"{foreign.public_id}/revoke"
    assert world.client(world.owner).post(foreign_url).status_code == 404
    foreign.refresh_from_db()
    assert foreign.revoked_at is None

    response = world.client(world.owner).post(url)
    assert response.status_code == 200 and response.json()["status"] == "revoked"
    assert world.client(world.owner).post(url).status_code == 400  # once
    assert AuditEvent.objects.filter(action="invitation.revoke").count() == 1
    with pytest.raises(Exception, match="revoked"):
        accept_invitation(secret, world.outsider)


def test_accepting_an_invitation_as_a_new_user_and_as_an_existing_user(world: World) -> None:
    invitation, secret = invite(world, tenant="acme", email="newbie@acme.test", role="admin")
    membership = accept_invitation_as_new_user(secret, username="newbie",
                                               password="a long unusual passphrase 7")
    assert membership.role == "admin" and membership.tenant == world.acme
    assert membership.user.email == "newbie@acme.test"
    assert membership.user.check_password("a long unusual passphrase 7")
    invitation.refresh_from_db()
    assert invitation.accepted_by == membership.user and invitation.accepted_at is not None

    # The outsider (globex owner) joins acme as a member with a second invitation.
    _, secret2 = invite(world, tenant="acme", email="boss@globex.test", role="member")
    joined = accept_invitation(secret2, world.outsider)
    assert joined.tenant == world.acme and joined.role == "member"
    actions = list(AuditEvent.objects.filter(tenant=world.acme).values_list("action", flat=True))
    assert actions.count("invitation.accept") == 2 and actions.count("member.add") == 2


def test_unusable_links_write_nothing(world: World) -> None:
    _, expired = invite(world, tenant="acme")
    Invitation.objects.filter(digest=digest_key(expired)).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    _, used = invite(world, tenant="acme")
    accept_invitation(used, world.outsider)
    users_before = get_user_model().objects.count()
    members_before = Membership.objects.count()
    events_before = audit_count()
    for secret, reason in ((expired, "expired"), (used, "used"), ("nope" * 10, "not valid")):
        with pytest.raises(Exception, match=reason):
            accept_invitation_as_new_user(secret, username="ghost",
                                          password="a long unusual passphrase 7")
    assert get_user_model().objects.count() == users_before
    assert Membership.objects.count() == members_before
    assert audit_count() == events_before


def test_new_user_validation_uses_django_password_validators(world: World) -> None:
    _, secret = invite(world, tenant="acme")
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as caught:
        accept_invitation_as_new_user(secret, username="owner", password="password")
    assert set(caught.value.message_dict) == {"username", "password"}
    assert not Invitation.objects.get(digest=digest_key(secret)).accepted_at
    assert get_user_model().objects.filter(username="owner").count() == 1


def test_a_tenant_token_invites_and_a_foreign_token_sees_nothing(world: World) -> None:
    from rest_framework.test import APIClient

    from tenants.services import issue_management_token

    token = issue_management_token(world.acme, name="script", actor="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token.plaintext}")
    response = client.post(invitations_url(world), {"email": "bot@acme.test"}, format="json")
    assert response.status_code == 201 and response.json()["role"] == "admin"
    event = AuditEvent.objects.get(action="invitation.create")
    assert event.actor == f"token:{token.token.public_id}"
    # A token is an admin, not an owner: it cannot touch the owner.
    assert client.patch(members_url(world) + "owner/", {"role": "member"},
                        format="json").status_code == 403

    foreign = issue_management_token(world.globex, name="other", actor="test")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {foreign.plaintext}")
    assert client.get(members_url(world)).status_code == 404
    assert client.post(invitations_url(world), {"email": "x@y.test"}).status_code == 404
