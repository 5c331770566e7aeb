"""Every console page and every management API read makes as many database queries for a
tenant with three times the data: a query per row (an N+1) fails here.

The routes come from Django's URL resolver (tests/support/routes.py), so a page or an API list
added later is counted without being listed here. Each is read by acme's owner (the platform
report by the operator, the login page by a visitor) with N of everything (projects and keys
with limits of their own, hence forecasts, the keys' secrets, members, invitations, management
tokens, webhooks and deliveries, usage rows, alerts, audit events, the owner's other tenants,
plans), then with 3N: the number of queries must be the same, and under MAX_QUERIES. Counts
are compared between the two sizes rather than pinned, so a change that adds one constant query
to a page does not break this test; a query per row does.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from billing.models import AlertState, UsageRecord, WebhookDelivery, WebhookEndpoint
from billing.webhooks import create_endpoint
from tenants.membership import invite_member
from tenants.models import Membership
from tenants.services import (
    create_plan,
    create_project,
    create_tenant,
    issue_key,
    issue_management_token,
    revoke_key,
    rotate_key,
)
from tests.support.routes import management_routes
from tests.world import World
from tests.billing.rollup_events import create_usage

N = 2
# A ceiling well above the busiest page (the dashboard); the equality of the two sizes is what
# catches a query per row.
MAX_QUERIES = 25
HOOK_BASE = "http://127.0.0.1:9"
ROUTES = management_routes()
OPERATOR_ONLY = {"platform-cost-report"}
ANONYMOUS_ONLY = {"console-login"}  # a signed-in user is sent on
# Query strings that take a route down another path (filters, groupings), counted too.
VARIANTS: dict[str, tuple[str, ...]] = {
    "api-usage": ("?group_by=day,project,key,model",),
    "api-key-list": ("?status=active", "?project={project_id}", "?status=rotating&order=name",
                     "?q=k&used=idle&order=last_used"),
    "console-keys": ("?status=rotating&sort=last_used", "?project={project_id}&q=k&used=idle"),
    "api-audit-events": ("?action=key.",),
}

READS = [pytest.param(name, query, id=name + query)
         for name, found in ROUTES.items() if found.answers_get
         for query in ("", *VARIANTS.get(name, ()))]
NOT_READS = [name for name, found in ROUTES.items() if not found.answers_get]


@pytest.fixture(autouse=True)
def _fast_passwords_and_private_hooks(settings: Any) -> None:
    # A user per member: the hasher plays no part here. Webhooks point at 127.0.0.1:9 (closed).
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True


@dataclass
class Scene:
    """acme, with one of everything a URL can name (`ids`), grown by `grow(n)`."""

    world: World
    ids: dict[str, str] = field(default_factory=dict)
    hook: WebhookEndpoint | None = None  # the webhook in the URLs; its deliveries grow too
    grown: int = 0

    def __post_init__(self) -> None:
        world = self.world
        hook, _ = create_endpoint(world.acme, f"{HOOK_BASE}/hook", ["quota.threshold"],
                                  actor="test")
        delivery = WebhookDelivery.objects.create(endpoint=hook, event_type="test",
                                                  payload={"type": "test"})
        token = issue_management_token(world.acme, name="ci-token", actor="test")
        secrets: list[str] = []
        invitation = invite_member(
            world.acme, "invitee@acme.test", role="member", actor="test",
            accept_url=lambda secret: secrets.append(secret) or f"/console/invite/{secret}/",
        ).invitation
        self.ids = {
            "tenant_id": world.acme.public_id, "project_id": world.web.public_id,
            "key_id": world.issued.api_key.public_id, "webhook_id": hook.public_id,
            "delivery_id": delivery.public_id, "token_id": token.token.public_id,
            "invitation_id": invitation.public_id, "member_id": "member", "username": "member",
            "secret": secrets[0], "name": "standard", "month": f"{timezone.now():%Y-%m}",
            "fmt": "csv",
        }
        self.hook = hook

    def url(self, name: str, query: str = "") -> str:
        unknown = [k for k in ROUTES[name].kwargs if k not in self.ids]
        assert not unknown, f"{name}: no object for URL kwargs {unknown}; add one to Scene"
        path = reverse(name, kwargs={k: self.ids[k] for k in ROUTES[name].kwargs})
        return path + query.format(**self.ids)

    def grow(self, n: int) -> None:
        """n more of everything a page or a list shows."""
        world, acme, now = self.world, self.world.acme, timezone.now()
        users = get_user_model()
        statuses = list(WebhookDelivery.Status)
        for i in range(self.grown, self.grown + n):
            # Limited: each project and key has counters with a forecast (dashboard, /quota),
            # whose history must not cost a ledger query per scope.
            project = create_project(acme, f"p{i}", actor="test", tokens_per_day=50_000,
                                     tokens_per_month=1_000_000)
            issued = issue_key(project, actor="test", name=f"k{i}", tokens_per_day=10_000,
                               tokens_per_month=100_000)
            on_web = issue_key(world.web, actor="test", name=f"web-k{i}")
            rotate_key(on_web.api_key, actor="test", grace_seconds=3600)
            if i % 2:
                revoke_key(on_web.api_key, actor="test")
            rotate_key(world.issued.api_key, actor="test", grace_seconds=3600)  # its secrets
            member = users.objects.create_user(f"m{i}", f"m{i}@acme.test", "pw")
            Membership.objects.create(user=member, tenant=acme, role=Membership.Role.MEMBER)
            invite_member(acme, f"i{i}@acme.test", role="member", actor="test",
                          accept_url=lambda secret: f"/console/invite/{secret}/")
            issue_management_token(acme, name=f"t{i}", actor="test")
            hook, _ = create_endpoint(acme, f"{HOOK_BASE}/h{i}", ["quota.threshold"],
                                      actor="test")
            for endpoint in (hook, self.hook):
                WebhookDelivery.objects.create(endpoint=endpoint, event_type="test",
                                               payload={"type": "test", "i": i},
                                               status=statuses[i % len(statuses)], attempts=1)
            AlertState.objects.create(tenant=acme, scope=f"project:{project.pk}",
                                      window=f"d{now:%Y-%m-%d}", threshold=50)
            AlertState.objects.create(tenant=acme, scope="tenant", window=f"d{now:%Y-%m-%d}",
                                      threshold=i + 1)
            other = create_tenant(f"acme{i}", plan_name="standard", actor="test")
            Membership.objects.create(user=world.owner, tenant=other,
                                      role=Membership.Role.OWNER)
            create_plan(f"plan{i}", actor="test", tokens_per_day=1000, requests_per_second=10)
            for tenant, proj, key in ((acme, project, issued.api_key),
                                      (acme, world.web, on_web.api_key),
                                      (acme, world.web, world.issued.api_key),
                                      (other, None, None)):
                create_usage(
                    request_id=f"req-{i}-{tenant.slug}-{key.pk if key else 0}", tenant=tenant,
                    project=proj, api_key=key, model=f"model-{i}", served_model=f"model-{i}",
                    input_tokens=100, output_tokens=50, cost_micros=1234,
                    status=UsageRecord.Status.SETTLED, started_at=now, ended_at=now)
        self.grown += n


@pytest.fixture
def scene(world: World) -> Scene:
    return Scene(world)


def _client(user: Any | None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_login(user)
    return client


def _reader(scene: Scene, name: str) -> APIClient:
    if name in ANONYMOUS_ONLY:
        return _client(None)
    return _client(scene.world.operator if name in OPERATOR_ONLY else scene.world.owner)


def _queries(client: APIClient, url: str) -> list[str]:
    """The SQL of one GET of `url`, after a first one (per-process caches fill on a first
    request, whatever the data)."""
    client.get(url)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code < 400, (url, response.status_code, response.content[:300])
    return [query["sql"] for query in captured.captured_queries]


def _shape(sql: str) -> str:
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", sql))


@pytest.mark.parametrize("name, query", READS)
def test_queries_do_not_grow_with_the_data(scene: Scene, name: str, query: str) -> None:
    client = _reader(scene, name)
    url = scene.url(name, query)
    scene.grow(N)
    small = _queries(client, url)
    scene.grow(2 * N)
    large = _queries(client, url)
    grew = Counter(map(_shape, large)) - Counter(map(_shape, small))
    assert len(large) == len(small), (
        f"{url}: {len(small)} queries with {N} of everything, {len(large)} with {3 * N}; "
        f"the extra ones: {list(grew.items())[:5]}")
    assert len(large) <= MAX_QUERIES, (url, len(large), large)


@pytest.mark.parametrize("name", NOT_READS)
def test_every_route_left_out_answers_get_with_405(scene: Scene, name: str) -> None:
    """What the test above leaves out is only what has no GET (checks routes.answers_get)."""
    response = _client(scene.world.owner).get(scene.url(name))
    assert response.status_code == 405, (name, response.status_code)
