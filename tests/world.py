"""Three people and two tenants, for every isolation test of the console and management API.

acme:   `owner` (owner) and `member` (member); project `web` with key `issued`.
globex: `outsider` (owner); project `app` with key `other_issued`.
`operator` is a staff user (Django admin) and member of nothing.

The pattern (after healthchecks.io's tests): for every view, the owner may, the member may read
but not change (403), and the outsider gets a 404 for anything of acme's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tenants.models import Membership, Project, Tenant
from tenants.services import IssuedKey, create_project, create_tenant, issue_key

PASSWORD = "correct horse battery staple 42"


@dataclass
class World:
    acme: Tenant
    globex: Tenant
    web: Project
    app: Project
    issued: IssuedKey
    other_issued: IssuedKey
    owner: Any
    member: Any
    outsider: Any
    operator: Any

    def client(self, user: Any | None) -> APIClient:
        """An API client logged in as `user` (a session, as the console has), or anonymous."""
        client = APIClient()
        if user is not None:
            client.force_login(user)
        return client


def build_world() -> World:
    users = get_user_model()
    owner = users.objects.create_user("owner", "owner@acme.test", PASSWORD)
    member = users.objects.create_user("member", "member@acme.test", PASSWORD)
    outsider = users.objects.create_user("outsider", "boss@globex.test", PASSWORD)
    operator = users.objects.create_user("operator", "ops@tollgate.test", PASSWORD, is_staff=True)
    acme = create_tenant("acme", plan_name="standard", actor="test", name="Acme Corp")
    globex = create_tenant("globex", plan_name="standard", actor="test", name="Globex")
    Membership.objects.create(user=owner, tenant=acme, role=Membership.Role.OWNER)
    Membership.objects.create(user=member, tenant=acme, role=Membership.Role.MEMBER)
    Membership.objects.create(user=outsider, tenant=globex, role=Membership.Role.OWNER)
    web = create_project(acme, "web", actor="test")
    app = create_project(globex, "app", actor="test")
    return World(
        acme=acme, globex=globex, web=web, app=app,
        issued=issue_key(web, actor="test", name="ci"),
        other_issued=issue_key(app, actor="test", name="prod"),
        owner=owner, member=member, outsider=outsider, operator=operator,
    )
