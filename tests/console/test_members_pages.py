"""Console members page, invitations and the accept page; tenant switching."""

from __future__ import annotations

import re
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from django.utils import timezone

from tenants.api_key_format import digest_key
from tenants.membership import invite_member
from tenants.models import AuditEvent, Invitation, Membership
from tests.world import World

NEW_PASSWORD = "a long unusual passphrase 7"


def logged_in(user: object) -> Client:
    client = Client()
    client.force_login(user)
    return client


def members_url(world: World) -> str:
    return f"/console/t/{world.acme.public_id}/members/"


def invite(world: World, tenant: str = "acme", role: str = "admin") -> str:
    issued = invite_member(getattr(world, tenant), "x@example.test", role=role, actor="test",
                           accept_url=lambda secret: f"/console/invite/{secret}/")
    return issued.accept_url


def test_members_page_for_owner_member_and_outsider(world: World) -> None:
    owner_page = logged_in(world.owner).get(members_url(world))
    assert owner_page.status_code == 200
    html = owner_page.content.decode()
    assert "Send invitation" in html and 'aria-label="Role of member"' in html
    assert '<label for="invite-email">' in html
    # The only owner gets no role or remove controls (the service refuses them anyway).
    assert "The only owner" in html and 'aria-label="Role of owner"' not in html

    member_page = logged_in(world.member).get(members_url(world))
    assert member_page.status_code == 200
    html = member_page.content.decode()
    assert "owner" in html and "<form" in html  # the frame's switcher and logout only
    assert "Send invitation" not in html and "Change role" not in html and "Revoke" not in html

    assert logged_in(world.outsider).get(members_url(world)).status_code == 404
    assert Client().get(members_url(world)).status_code == 302


def test_invite_shows_the_link_once(world: World) -> None:
    client = logged_in(world.owner)
    response = client.post(members_url(world) + "invite/",
                           {"email": "friend@acme.test", "role": "admin"})
    assert response.status_code == 200
    html = response.content.decode()
    match = re.search(r'id="invite-link" readonly value="([^"]+)"', html)
    assert match and match.group(1).startswith("http://testserver/console/invite/")
    assert "You will not see it again" in html and 'data-copy="#invite-link"' in html
    secret = match.group(1).rstrip("/").rsplit("/", 1)[1]
    [message] = mail.outbox
    assert match.group(1) in message.body
    # The page afterwards lists the invitation but never the link.
    later = client.get(members_url(world)).content.decode()
    assert "friend@acme.test" in later and secret not in later
    assert Invitation.objects.get(email="friend@acme.test").digest == digest_key(secret)


def test_resending_the_invite_form_does_not_invite_again(world: World) -> None:
    # What a browser does when the page showing the link is reloaded.
    client = logged_in(world.owner)
    page = client.get(members_url(world)).content.decode()
    form_id = re.search(r'name="form_id" value="([^"]+)"', page).group(1)
    data = {"email": "friend@acme.test", "role": "admin", "form_id": form_id}
    assert 'id="invite-link"' in client.post(members_url(world) + "invite/", data).content.decode()
    again = client.post(members_url(world) + "invite/", data, follow=True)
    html = again.content.decode()
    assert "This form was sent already" in html and 'id="invite-link"' not in html
    assert Invitation.objects.count() == 1 and len(mail.outbox) == 1
    # A fresh form invites again.
    next_id = re.search(r'name="form_id" value="([^"]+)"', html).group(1)
    assert next_id != form_id
    client.post(members_url(world) + "invite/", {**data, "form_id": next_id})
    assert Invitation.objects.count() == 2


def test_invite_refused_for_member_outsider_and_bad_input(world: World) -> None:
    data = {"email": "friend@acme.test", "role": "admin"}
    assert logged_in(world.member).post(members_url(world) + "invite/", data).status_code == 403
    assert logged_in(world.outsider).post(members_url(world) + "invite/", data).status_code == 404
    bad = logged_in(world.owner).post(members_url(world) + "invite/",
                                      {"email": "nope", "role": "owner"})
    assert bad.status_code == 400
    assert "Enter a valid email address" in bad.content.decode()
    assert not Invitation.objects.exists() and mail.outbox == []
    assert not AuditEvent.objects.filter(action="invitation.create").exists()


def test_role_change_and_remove_from_the_page(world: World) -> None:
    client = logged_in(world.owner)
    url = members_url(world)
    assert logged_in(world.member).post(url + "member/role/", {"role": "admin"}).status_code == 403
    assert logged_in(world.outsider).post(url + "member/role/",
                                          {"role": "admin"}).status_code == 404
    assert client.post(url + "outsider/role/", {"role": "member"}).status_code == 404  # globex's

    response = client.post(url + "member/role/", {"role": "admin"}, follow=True)
    assert "member is now admin" in response.content.decode()
    assert Membership.objects.get(user=world.member).role == "admin"

    last = client.post(url + "owner/role/", {"role": "member"}, follow=True)
    assert "at least one owner" in last.content.decode()
    assert Membership.objects.get(user=world.owner, tenant=world.acme).role == "owner"

    assert logged_in(world.member).post(url + "owner/remove/").status_code == 403  # admin vs owner
    client.post(url + "member/remove/")
    assert not Membership.objects.filter(user=world.member, tenant=world.acme).exists()


def test_revoke_from_the_page(world: World) -> None:
    link = invite(world)
    invitation = Invitation.objects.get()
    foreign_link = invite(world, tenant="globex")
    foreign = Invitation.objects.exclude(pk=invitation.pk).get()
    base = f"/console/t/{world.acme.public_id}/invitations/"
    assert logged_in(world.member).post(f"{base}{invitation.public_id}/revoke/").status_code == 403
    assert logged_in(world.owner).post(f"{base}{foreign.public_id}/revoke/").status_code == 404
    response = logged_in(world.owner).post(f"{base}{invitation.public_id}/revoke/", follow=True)
    assert "was revoked" in response.content.decode()
    page = Client().get(link)
    assert page.status_code == 410 and "revoked" in page.content.decode()
    assert Client().get(foreign_link).status_code == 200


def test_visitor_creates_an_account_and_joins(world: World) -> None:
    link = invite(world, role="admin")
    client = Client()
    page = client.get(link)
    assert page.status_code == 200
    html = page.content.decode()
    assert "Join Acme Corp" in html and '<label for="id_password1">' in html

    weak = client.post(link, {"username": "friend", "password1": "123", "password2": "123"})
    assert weak.status_code == 400 and "too short" in weak.content.decode()
    taken = client.post(link, {"username": "owner", "password1": NEW_PASSWORD,
                               "password2": NEW_PASSWORD})
    assert taken.status_code == 400 and "already exists" in taken.content.decode()
    assert not get_user_model().objects.filter(username="friend").exists()

    joined = client.post(link, {"username": "friend", "password1": NEW_PASSWORD,
                                "password2": NEW_PASSWORD})
    assert joined.status_code == 302
    friend = get_user_model().objects.get(username="friend")
    assert Membership.objects.get(user=friend).role == "admin"
    assert client.session["_auth_user_id"] == str(friend.pk)
    # Used: a second visit says so and writes nothing.
    again = Client().post(link, {"username": "other", "password1": NEW_PASSWORD,
                                 "password2": NEW_PASSWORD})
    assert again.status_code == 410 and "used already" in again.content.decode()
    assert not get_user_model().objects.filter(username="other").exists()


def test_logged_in_user_accepts_with_one_click(world: World) -> None:
    link = invite(world, role="member")
    client = logged_in(world.outsider)
    assert "Join Acme Corp as outsider" in client.get(link).content.decode()
    assert client.post(link).status_code == 302
    assert Membership.objects.get(user=world.outsider, tenant=world.acme).role == "member"


def test_expired_and_unknown_links(world: World) -> None:
    link = invite(world)
    Invitation.objects.update(expires_at=timezone.now() - timedelta(minutes=1))
    expired = logged_in(world.outsider).post(link)
    assert expired.status_code == 410 and "expired" in expired.content.decode()
    assert not Membership.objects.filter(user=world.outsider, tenant=world.acme).exists()
    unknown = Client().get("/console/invite/not-a-real-secret/")
    assert unknown.status_code == 410 and "not valid" in unknown.content.decode()


def test_a_user_in_two_tenants_switches_between_them(world: World) -> None:
    Membership.objects.create(user=world.owner, tenant=world.globex, role="member")
    client = logged_in(world.owner)
    page = client.get(members_url(world)).content.decode()
    assert "Acme Corp" in page and "Globex" in page  # both in the switcher
    response = client.post("/console/switch/", {"tenant": world.globex.public_id})
    assert response.status_code == 302 and world.globex.public_id in response["Location"]
    assert client.session["console_tenant"] == world.globex.public_id
    globex_members = client.get(f"/console/t/{world.globex.public_id}/members/")
    assert globex_members.status_code == 200
    assert "Send invitation" not in globex_members.content.decode()  # a member there
    # A tenant the user is not in cannot be switched to.
    Membership.objects.filter(user=world.owner, tenant=world.globex).delete()
    assert client.post("/console/switch/", {"tenant": world.globex.public_id}).status_code == 404
