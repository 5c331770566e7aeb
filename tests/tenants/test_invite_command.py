"""manage.py invite: an operator invites someone to a tenant and gets the link once."""
from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core import mail
from django.core.management import CommandError, call_command

from tenants.api_key_format import digest_key
from tenants.models import AuditEvent, Invitation
from tests.world import World


def test_invite_command_prints_and_mails_the_link(world: World) -> None:
    out = StringIO()
    call_command("invite", "acme", "new@acme.test", "--role", "member", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["role"] == "member" and data["email_sent"] is True
    assert data["accept_url"].startswith("http://127.0.0.1:8000/console/invite/")
    secret = data["accept_url"].rstrip("/").rsplit("/", 1)[1]
    invitation = Invitation.objects.get(public_id=data["invitation_id"])
    assert invitation.tenant == world.acme and invitation.digest == digest_key(secret)
    assert data["accept_url"] in mail.outbox[0].body
    assert AuditEvent.objects.get(action="invitation.create").actor == "cli"

    out = StringIO()
    call_command("invite", "acme", "other@acme.test", "--base-url", "https://tg.example/",
                 stdout=out)
    assert "https://tg.example/console/invite/" in out.getvalue()
    assert Invitation.objects.get(email="other@acme.test").role == "admin"


def test_invite_command_errors(world: World) -> None:
    with pytest.raises(CommandError, match="No tenant"):
        call_command("invite", "nope", "a@b.test", stdout=StringIO())
    with pytest.raises(CommandError, match="email"):
        call_command("invite", "acme", "not-an-email", stdout=StringIO())
    assert not Invitation.objects.exists()
