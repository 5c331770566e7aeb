"""The console driven over real HTTP (httpx against a running server, CSRF enforced), as a
browser would: a committed owner, the login form, the projects page's one-use key-issue form."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from tests.gateway.conftest import TenantKey, committed

PASSWORD = "console over http 15"


@dataclass(frozen=True)
class Owner:
    username: str
    tenant_public_id: str
    project_public_id: str


def owner_of(django_db_blocker: Any, t: TenantKey) -> Owner:
    """A console user owning the tenant (committed: the server must see it)."""
    from django.contrib.auth import get_user_model

    from tenants.models import Membership, Project, Tenant

    username = f"owner-{uuid.uuid4().hex[:8]}"

    def create() -> Owner:
        tenant = Tenant.objects.get(pk=t.tenant_id)
        user = get_user_model().objects.create_user(username, f"{username}@example.test", PASSWORD)
        Membership.objects.create(user=user, tenant=tenant, role=Membership.Role.OWNER)
        return Owner(username, tenant.public_id, Project.objects.get(pk=t.project_id).public_id)

    return committed(django_db_blocker, create)


def csrf_token(html: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, "the page carries a CSRF token"
    return match.group(1)


def log_in(browser: httpx.Client, username: str, password: str = PASSWORD) -> httpx.Response:
    page = browser.get("/console/login/")
    assert page.status_code == 200
    return browser.post("/console/login/", data={
        "username": username, "password": password, "csrfmiddlewaretoken": csrf_token(page.text)})


def issue_form(html: str, action: str) -> dict[str, str]:
    """The hidden fields (CSRF token, one-use form id) of the form posting to `action`."""
    start = html.index(f'action="{action}"')
    form = html[start:html.index("</form>", start)]
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]+)"', form))


@dataclass(frozen=True)
class IssuedThroughConsole:
    plaintext: str
    form: dict[str, str]  # the hidden fields sent (its one-use id under "form_id")
    action: str


def issue_key(browser: httpx.Client, owner: Owner, name: str) -> IssuedThroughConsole:
    """Open the projects page and send its issue form for the owner's project; the new key as
    the answer shows it (once)."""
    projects = browser.get(f"/console/t/{owner.tenant_public_id}/projects/")
    assert projects.status_code == 200
    action = f"/console/t/{owner.tenant_public_id}/projects/{owner.project_public_id}/keys/new/"
    fields = issue_form(projects.text, action)
    assert fields.get("form_id"), "the issue form is one-use"
    issued = browser.post(action, data={**fields, f"{owner.project_public_id}-name": name})
    assert issued.status_code == 200, issued.text[-2000:]
    match = re.search(r'<input readonly id="new-key" value="(tgk_[0-9A-Za-z_]+)"', issued.text)
    assert match, "the new key is shown once"
    return IssuedThroughConsole(match.group(1), fields, action)
