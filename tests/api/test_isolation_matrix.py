"""Tenant isolation matrix: every route under /api/ and /console/, every HTTP method it accepts.

The matrix is checked against Django's URL resolver, so a route added later without an entry
here fails `test_every_route_is_in_the_matrix` (and a method added to a view fails
`test_declared_methods_are_the_accepted_ones`).

For each tenant-scoped route and method, with acme's objects in the URL:
- the outsider (globex's owner) and a globex management token get 404, the same answer as for a
  tenant that does not exist, and the body names none of acme's objects;
- acme's owner gets 404 when one of globex's objects (project, key, webhook, delivery, token,
  invitation, member) is put into acme's URL, and the body names none of globex's objects;
- the member gets 403 for every change (and for the reads refused to members on purpose: cost
  reports, billing/access.py, and the confirmation pages of key revocation and webhook deletion),
  200 for every other read;
- anonymous gets 401/403 from /api and a redirect to the login page from /console;
- acme's own management tokens of narrower scope: a `read` token reads every route (200) and is
  refused every change (403); a `keys` token may also change projects and keys (KEYS_WRITES) and
  is refused every other change (403); each route's scope is what its view declares;
- every refused request wrote nothing: no audit event, no row added, changed or deleted;
- and, so that none of the above passes on a mistyped URL, the owner's own request works.
Plus the routes that are not below a tenant: plans (operators write), tenant creation, the
platform-wide cost report (operators only), the console index, switch and invitation pages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Self

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Model
from django.http import HttpResponse
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient
from rest_framework.views import APIView

from billing.models import AlertState, UsageRecord, WebhookDelivery, WebhookEndpoint
from billing.webhooks import create_endpoint
from config.console.frame import SESSION_TENANT
from quotas.keys import tenant_tag
from quotas.limits import pace_counters
from quotas.pace import PaceBreaker
from quotas.runtime import get_engine
from tenants.membership import invite_member
from tenants.models import (
    ApiKey,
    ApiKeySecret,
    AuditEvent,
    Invitation,
    ManagementToken,
    Membership,
    Plan,
    Project,
    Tenant,
)
from tenants.selectors import effective_limits
from tenants.services import issue_management_token, update_project
from tests.support.routes import management_routes
from tests.world import World
from tests.billing.rollup_events import create_usage

# -- access kinds -----------------------------------------------------------------------------

READ = "read"  # member: 200
WRITE = "write"  # member: 403
MEMBER_REFUSED_READ = "member-refused-read"  # a read refused to members on purpose: 403

EVERY_METHOD = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
PAGE = {"GET": READ, "HEAD": READ}
MONTH = "2025-01"
MISSING_TENANT = "ten_doesnotexist00000"
HOOK_BASE = "http://127.0.0.1:9"


# -- the fixture's objects --------------------------------------------------------------------


@dataclass
class Side:
    """One tenant's objects, by the URL kwarg that names them, plus what identifies them."""

    ids: dict[str, str]
    markers: set[str]
    token: str  # plaintext of a management token of this tenant


@dataclass
class Objects:
    world: World
    acme: Side
    globex: Side


@pytest.fixture(autouse=True)
def _fast_passwords_and_private_hooks(settings: Any) -> None:
    # Argon2 for the fixture's four users in each of several hundred tests is slow; the hasher
    # plays no part here. Webhooks point at 127.0.0.1:9 (closed), so private addresses are on.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True


def _side(world: World, tenant: Tenant, project: Project, key: ApiKey, member: str,
          slug: str) -> Side:
    hook, _ = create_endpoint(tenant, f"{HOOK_BASE}/{slug}-hook", ["quota.threshold"],
                              actor="test")
    # Delivered, so redeliverable (a pending one is refused: 409).
    delivery = WebhookDelivery.objects.create(endpoint=hook, event_type="test",
                                              payload={"type": "test"}, status="delivered")
    token = issue_management_token(tenant, name=f"{slug}-ci-token", actor="test")
    invitation = invite_member(tenant, f"invitee@{slug}-corp.test", role="member", actor="test",
                               accept_url=lambda secret: f"/console/invite/{secret}/").invitation
    model = f"{slug}-secret-model"  # the usage API, dashboard chart and reports name it
    for when in (timezone.now(), datetime(2025, 1, 15, 12, tzinfo=UTC)):
        create_usage(
            request_id=f"req-{slug}-{when:%Y%m%d}", tenant=tenant, project=project, api_key=key,
            model=model, served_model=model, input_tokens=100, output_tokens=50,
            cost_micros=1234, status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)
    users = get_user_model()
    emails = set(users.objects.filter(tenant_memberships__tenant=tenant)
                 .values_list("email", flat=True))
    # A tripped burn-rate breaker on the project, so that resuming it works for the owner.
    project = update_project(project, actor="test", tokens_per_day=1_000, pace_share_percent=10)
    limits_of = Tenant.objects.select_related("plan").get(pk=tenant.pk)
    [paced] = pace_counters(limits_of, effective_limits(limits_of), project, key)
    breaker = PaceBreaker(get_engine().client)
    assert breaker.trip(tenant_tag(tenant.pk), [paced.scope_limit], breaker.now_ms()).first
    ids = {
        "pace_scope": paced.scope,
        "project_id": project.public_id, "key_id": key.public_id, "webhook_id": hook.public_id,
        "delivery_id": delivery.public_id, "token_id": token.token.public_id,
        "invitation_id": invitation.public_id, "member_id": member, "username": member,
    }
    markers = {
        tenant.public_id, tenant.name, project.public_id, key.public_id,
        *key.secrets.values_list("prefix", flat=True),
        hook.public_id, hook.url, delivery.public_id, token.token.public_id, token.token.name,
        token.token.prefix, invitation.public_id, invitation.email, model, *emails,
    }
    return Side(ids=ids, markers=markers, token=token.plaintext)


@pytest.fixture
def objs(world: World) -> Objects:
    acme = _side(world, world.acme, world.web, world.issued.api_key, "member", "acme")
    globex = _side(world, world.globex, world.app, world.other_issued.api_key, "outsider",
                   "globex")
    return Objects(world=world, acme=acme, globex=globex)


# -- the matrix -------------------------------------------------------------------------------

Body = Callable[[dict[str, str]], dict[str, Any]]


@dataclass(frozen=True)
class Route:
    methods: Mapping[str, str]
    bodies: Mapping[str, Body] = field(default_factory=dict)  # method -> body from acme's ids

    def body(self, method: str, ids: dict[str, str]) -> dict[str, Any]:
        builder = self.bodies.get(method)
        return builder(ids) if builder else {}


def _get(kind: str = READ) -> dict[str, str]:
    return {"GET": kind, "HEAD": kind}


API_ROUTES: dict[str, Route] = {
    "api-tenant-detail": Route({**_get(), "PATCH": WRITE},
                               {"PATCH": lambda i: {"name": "Renamed"}}),
    "api-project-list": Route({**_get(), "POST": WRITE},
                              {"POST": lambda i: {"slug": "newproj", "name": "New project"}}),
    "api-project-detail": Route({**_get(), "PATCH": WRITE},
                                {"PATCH": lambda i: {"name": "Renamed", "tokens_per_day": 10}}),
    "api-key-list": Route({**_get(), "POST": WRITE},
                          {"POST": lambda i: {"project": i["project_id"], "name": "new key"}}),
    "api-key-detail": Route({**_get(), "PATCH": WRITE},
                            {"PATCH": lambda i: {"name": "renamed", "tokens_per_day": 10}}),
    "api-key-rotate": Route({"POST": WRITE}, {"POST": lambda i: {"grace_seconds": 0}}),
    "api-key-revoke": Route({"POST": WRITE}),
    "api-tenant-limits": Route({**_get(), "PATCH": WRITE},
                               {"PATCH": lambda i: {"alert_thresholds": [50, 10]}}),
    "api-tenant-pace-trips": Route(_get()),
    "api-tenant-pace-resume": Route({"POST": WRITE}, {"POST": lambda i: {"scope": i["pace_scope"]}}),
    "api-token-list": Route({**_get(), "POST": WRITE}, {"POST": lambda i: {"name": "new"}}),
    "api-token-revoke": Route({"POST": WRITE}),
    "api-audit-events": Route(_get()),
    "api-member-list": Route(_get()),
    "api-member-detail": Route({**_get(), "PATCH": WRITE, "DELETE": WRITE},
                               {"PATCH": lambda i: {"role": "admin"}}),
    "api-invitation-list": Route({**_get(), "POST": WRITE},
                                 {"POST": lambda i: {"email": "new@example.test",
                                                     "role": "member"}}),
    "api-invitation-revoke": Route({"POST": WRITE}),
    "api-usage": Route(_get()),
    "api-quota": Route(_get()),
    "api-webhook-list": Route({**_get(), "POST": WRITE},
                              {"POST": lambda i: {"url": f"{HOOK_BASE}/new",
                                                  "events": ["quota.threshold"]}}),
    "api-webhook-detail": Route({**_get(), "PATCH": WRITE, "DELETE": WRITE},
                                {"PATCH": lambda i: {"enabled": False}}),
    "api-webhook-test": Route({"POST": WRITE}),
    "api-webhook-rotate-secret": Route({"POST": WRITE},
                                       {"POST": lambda i: {"grace_seconds": 3600}}),
    "api-webhook-deliveries": Route(_get()),
    "api-webhook-redeliver": Route({"POST": WRITE}),
    "api-tenant-cost-report": Route(_get(MEMBER_REFUSED_READ)),
}

CONSOLE_ROUTES: dict[str, Route] = {
    "console-dashboard": Route(PAGE),
    "console-reports": Route(PAGE),
    "console-webhooks": Route({"GET": READ, "POST": WRITE},
                              {"POST": lambda i: {"url": f"{HOOK_BASE}/new",
                                                  "events": ["quota.threshold"]}}),
    "console-webhook-detail": Route({"GET": READ, "POST": WRITE},
                                    {"POST": lambda i: {"events": ["quota.threshold", "test"]}}),
    "console-webhook-toggle": Route({"POST": WRITE}),
    "console-webhook-test": Route({"POST": WRITE}),
    "console-webhook-delete": Route({"GET": MEMBER_REFUSED_READ, "POST": WRITE}),
    "console-webhook-rotate-secret": Route({"POST": WRITE},
                                           {"POST": lambda i: {"grace_seconds": "3600"}}),
    "console-webhook-redeliver": Route({"POST": WRITE}),
    "console-projects": Route({"GET": READ, "POST": WRITE},
                              {"POST": lambda i: {"slug": "newproj", "name": "New project"}}),
    "console-key-issue": Route({"POST": WRITE},
                               {"POST": lambda i: {f"{i['project_id']}-name": "new key"}}),
    "console-keys": Route({"GET": READ}),
    "console-key": Route({"GET": READ, "POST": WRITE},
                         {"POST": lambda i: {"name": "renamed", "tokens_per_day": "10"}}),
    "console-key-rotate": Route({"POST": WRITE}, {"POST": lambda i: {"grace_seconds": "0"}}),
    "console-key-revoke": Route({"GET": MEMBER_REFUSED_READ, "POST": WRITE},
                                {"POST": lambda i: {"confirm": "on"}}),
    "console-limits": Route({"GET": READ, "POST": WRITE},
                            {"POST": lambda i: {"form": "alerts",
                                                "alerts-alert_thresholds": "50, 10"}}),
    "console-audit": Route({"GET": READ}),
    "console-tokens": Route({"GET": READ, "POST": WRITE}, {"POST": lambda i: {"name": "new"}}),
    "console-token-revoke": Route({"POST": WRITE}, {"POST": lambda i: {"confirm": "1"}}),
    "console-members": Route(PAGE),
    "console-member-invite": Route({"POST": WRITE},
                                   {"POST": lambda i: {"email": "new@example.test",
                                                       "role": "member"}}),
    "console-member-role": Route({"POST": WRITE}, {"POST": lambda i: {"role": "admin"}}),
    "console-member-remove": Route({"POST": WRITE}),
    "console-invitation-revoke": Route({"POST": WRITE}),
}

TENANT_ROUTES: dict[str, Route] = {**API_ROUTES, **CONSOLE_ROUTES}

# The changes a `keys` token may make (config/api/scopes.py); every other change needs `full`.
KEYS_WRITES: set[tuple[str, str]] = {
    ("api-project-list", "POST"), ("api-project-detail", "PATCH"), ("api-key-list", "POST"),
    ("api-key-detail", "PATCH"), ("api-key-rotate", "POST"), ("api-key-revoke", "POST"),
}

# Routes not below a tenant, with the test that covers each.
GLOBAL_ROUTES: dict[str, str] = {
    "api-tenant-list": "test_tenant_list_and_creation",
    "api-plan-list": "test_plans_are_read_only_for_tenants",
    "api-plan-detail": "test_plans_are_read_only_for_tenants",
    "platform-cost-report": "test_platform_report_is_for_operators_only",
    "api-schema": "test_schema_and_docs_name_no_tenant_object",
    "api-docs": "test_schema_and_docs_name_no_tenant_object",
    "console-login": "test_login_and_logout",
    "console-logout": "test_login_and_logout",
    "console-index": "test_console_index_never_lands_on_a_foreign_tenant",
    "console-switch": "test_switch_to_a_foreign_tenant_is_404",
    "console-invite-accept": "test_unknown_invitation_link_changes_nothing",
}

# URL kwargs that name no object.
FIXED_KWARGS = {"month": MONTH, "fmt": "csv"}


# -- the resolver -----------------------------------------------------------------------------


FOUND = management_routes()


def _object_kwargs(name: str) -> tuple[str, ...]:
    return tuple(k for k in FOUND[name].kwargs if k not in ("tenant_id", *FIXED_KWARGS))


def _url(name: str, tenant_id: str, ids: Mapping[str, str]) -> str:
    kwargs = {"tenant_id": tenant_id}
    for kwarg in FOUND[name].kwargs:
        if kwarg in FIXED_KWARGS:
            kwargs[kwarg] = FIXED_KWARGS[kwarg]
        elif kwarg != "tenant_id":
            kwargs[kwarg] = ids[kwarg]
    return reverse(name, kwargs=kwargs)


def _foreign_variants(name: str) -> list[tuple[str, ...]]:
    """Which of the URL's object kwargs get globex's ids: each alone, and all at once (a
    delivery of globex's below a webhook of globex's)."""
    keys = _object_kwargs(name)
    variants = [(k,) for k in keys]
    if len(keys) > 1:
        variants.append(keys)
    return variants


def _cases(routes: Mapping[str, Route],
           keep: Callable[[str], bool] = lambda kind: True) -> list[Any]:
    return [pytest.param(name, method, id=f"{name}-{method}")
            for name, route in routes.items() for method, kind in route.methods.items()
            if keep(kind)]


ALL_CASES = _cases(TENANT_ROUTES)
API_CASES = _cases(API_ROUTES)
FOREIGN_CASES = [
    pytest.param(name, method, variant, id=f"{name}-{method}-{'+'.join(variant)}")
    for name, route in TENANT_ROUTES.items() for method in route.methods
    for variant in _foreign_variants(name)
]


# -- requests and what they change ------------------------------------------------------------


def _client(user: Any | None = None, token: str | None = None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_login(user)
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def call(client: Client, name: str, method: str, url: str, body: dict[str, Any]) -> HttpResponse:
    send = getattr(client, method.lower())
    if method in ("GET", "HEAD"):
        return send(url)
    if name.startswith("api-"):
        return send(url, body, format="json")
    return send(url, body)


VOLATILE = {"last_used_at", "last_login"}
SNAPSHOT_MODELS: tuple[type[Model], ...] = (
    Plan, Tenant, Project, ApiKey, ApiKeySecret, Membership, ManagementToken, Invitation,
    AuditEvent, WebhookEndpoint, WebhookDelivery, AlertState, UsageRecord, get_user_model(),
)


def snapshot() -> dict[str, list[str]]:
    """Every row (minus last-used stamps, which authentication itself touches) of every table a
    management request could change."""
    state: dict[str, list[str]] = {}
    for model in SNAPSHOT_MODELS:
        columns = [f.attname for f in model._meta.concrete_fields if f.name not in VOLATILE]
        state[model._meta.label] = sorted(map(repr, model.objects.values_list(*columns)))
    return state


class Unchanged:
    """`with Unchanged(): ...` fails if the block wrote anything (audit events first, clearly)."""

    def __enter__(self) -> Self:
        self.audits = AuditEvent.objects.count()
        self.before = snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        assert AuditEvent.objects.count() == self.audits, list(
            AuditEvent.objects.values_list("action", "target")[: AuditEvent.objects.count()
                                                                - self.audits])
        after = snapshot()
        changed = [label for label in after if after[label] != self.before[label]]
        assert not changed, f"a refused request changed {changed}"


def assert_names_none_of(response: HttpResponse, markers: set[str], sent: str) -> None:
    """The answer names none of the objects in `markers`, except what the caller sent."""
    content = response.content.decode(errors="replace")
    leaked = sorted(m for m in markers if m and m not in sent and m in content)
    assert not leaked, f"the response reveals {leaked}"


def _is_login_redirect(response: HttpResponse) -> bool:
    return response.status_code == 302 and response["Location"].startswith("/console/login/")


# -- the matrix is complete -------------------------------------------------------------------


def test_every_route_is_in_the_matrix() -> None:
    covered = set(TENANT_ROUTES) | set(GLOBAL_ROUTES)
    assert not set(TENANT_ROUTES) & set(GLOBAL_ROUTES)
    assert covered == set(FOUND), (
        f"routes without an isolation entry: {sorted(set(FOUND) - covered)}; "
        f"entries without a route: {sorted(covered - set(FOUND))}")
    for name in TENANT_ROUTES:
        assert "tenant_id" in FOUND[name].kwargs, f"{name} is not below a tenant"
        for kwarg in _object_kwargs(name):
            assert kwarg in {"project_id", "key_id", "webhook_id", "delivery_id", "token_id",
                             "invitation_id", "member_id", "username"}, (
                f"{name}: no foreign object for URL kwarg {kwarg!r}; add one to _side()")
    for name, test in GLOBAL_ROUTES.items():
        assert "tenant_id" not in FOUND[name].kwargs, f"{name} is below a tenant"
        assert test in globals(), f"{name}: no test {test}"


def _accepted_methods(client: Client, name: str) -> set[str]:
    cls = FOUND[name].view_class
    if cls is not None and issubclass(cls, APIView):
        methods = {m.upper() for m in ("get", "post", "put", "patch", "delete") if hasattr(cls, m)}
        return methods | ({"HEAD"} if "GET" in methods else set())
    # A function view: require_http_methods answers 405 before login_required redirects.
    url = _url(name, MISSING_TENANT, {k: "x" for k in FOUND[name].kwargs})
    return {m for m in EVERY_METHOD
            if getattr(client, m.lower())(url).status_code != 405}


def test_declared_methods_are_the_accepted_ones(db: None) -> None:
    client = Client()
    wrong = {name: (sorted(route.methods), sorted(_accepted_methods(client, name)))
             for name, route in TENANT_ROUTES.items()
             if set(route.methods) != _accepted_methods(client, name)}
    assert not wrong, f"declared vs accepted methods: {wrong}"


# -- the owner's own requests work (so that every refusal below is meaningful) ----------------


@pytest.mark.parametrize("name, method", ALL_CASES)
def test_owner_request_works(objs: Objects, name: str, method: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    response = call(_client(objs.world.owner), name, method, url,
                    TENANT_ROUTES[name].body(method, ids))
    assert response.status_code < 400, (response.status_code, response.content[:300])
    assert_names_none_of(response, objs.globex.markers, "")


# -- narrower token scopes: reads for `read`, projects and keys too for `keys` ---------------


def _scope_expectation(scope: str, name: str, method: str) -> int:
    kind = API_ROUTES[name].methods[method]
    if kind != WRITE or (scope == "keys" and (name, method) in KEYS_WRITES):
        return 200
    return 403


@pytest.mark.parametrize("scope", ["read", "keys"])
@pytest.mark.parametrize("name, method", API_CASES)
def test_narrow_token_scopes(objs: Objects, name: str, method: str, scope: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    token = issue_management_token(objs.world.acme, name=f"{scope}-token", actor="test",
                                   scope=scope).plaintext
    expected = _scope_expectation(scope, name, method)
    body = API_ROUTES[name].body(method, ids)
    if expected == 403:
        with Unchanged():
            response = call(_client(token=token), name, method, url, body)
        assert response.status_code == 403, (response.status_code, response.content[:300])
        needed = "keys" if (name, method) in KEYS_WRITES else "full"
        assert response.json() == {"detail": f"This management token's scope is '{scope}'; "
                                             f"this request needs '{needed}'."}
    else:
        response = call(_client(token=token), name, method, url, body)
        assert response.status_code in (200, 201), (response.status_code, response.content[:300])


def test_every_api_write_is_in_scope_matrix() -> None:
    """KEYS_WRITES names real writes of the matrix (a renamed route cannot hide there)."""
    for name, method in KEYS_WRITES:
        assert API_ROUTES[name].methods[method] == WRITE, (name, method)


# -- outsiders: 404, like a tenant that does not exist ----------------------------------------


@pytest.mark.parametrize("name, method", ALL_CASES)
def test_outsider_gets_404_and_changes_nothing(objs: Objects, name: str, method: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    missing_url = _url(name, MISSING_TENANT, ids)
    body = TENANT_ROUTES[name].body(method, ids)
    client = _client(objs.world.outsider)
    with Unchanged():
        response = call(client, name, method, url, body)
        missing = call(client, name, method, missing_url, body)
    assert response.status_code == 404, (response.status_code, response.content[:300])
    assert (response.status_code, response.content) == (missing.status_code, missing.content)
    assert_names_none_of(response, objs.acme.markers, url + repr(body))


@pytest.mark.parametrize("name, method", API_CASES)
def test_other_tenants_token_gets_404_and_changes_nothing(objs: Objects, name: str,
                                                          method: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    body = API_ROUTES[name].body(method, ids)
    with Unchanged():
        response = call(_client(token=objs.globex.token), name, method, url, body)
    assert response.status_code == 404, (response.status_code, response.content[:300])
    assert_names_none_of(response, objs.acme.markers, url + repr(body))


@pytest.mark.parametrize("name", list(API_ROUTES))
def test_options_says_nothing_about_a_foreign_tenant(objs: Objects, name: str) -> None:
    ids = objs.acme.ids
    client = _client(objs.world.outsider)
    foreign = client.options(_url(name, objs.world.acme.public_id, ids))
    missing = client.options(_url(name, MISSING_TENANT, ids))
    assert foreign.status_code in (200, 404)
    assert (foreign.status_code, foreign.content) == (missing.status_code, missing.content)
    assert_names_none_of(foreign, objs.acme.markers, _url(name, objs.world.acme.public_id, ids))


# -- a foreign object inside acme's URL: 404 for acme's owner --------------------------------


@pytest.mark.parametrize("name, method, variant", FOREIGN_CASES)
def test_foreign_object_in_own_tenant_url_is_404(objs: Objects, name: str, method: str,
                                                 variant: tuple[str, ...]) -> None:
    ids = {**objs.acme.ids, **{k: objs.globex.ids[k] for k in variant}}
    url = _url(name, objs.world.acme.public_id, ids)
    body = TENANT_ROUTES[name].body(method, objs.acme.ids)
    clients = [_client(objs.world.owner)]
    if name.startswith("api-"):
        clients.append(_client(token=objs.acme.token))  # acme's own token, an admin of acme
    for client in clients:
        with Unchanged():
            response = call(client, name, method, url, body)
        assert response.status_code == 404, (response.status_code, response.content[:300])
        assert_names_none_of(response, objs.globex.markers, url)


def _foreign_in_body_cases() -> list[Any]:
    return [
        pytest.param("api-key-list", "POST", lambda g: {"project": g["project_id"], "name": "x"},
                     "", id="api-key-issue-foreign-project"),
        pytest.param("api-usage", "GET", None, "?project={project_id}", id="usage-foreign-project"),
        pytest.param("api-usage", "GET", None, "?key={key_id}", id="usage-foreign-key"),
        pytest.param("api-key-list", "GET", None, "?project={project_id}",
                     id="key-list-foreign-project"),
        pytest.param("console-limits", "POST",
                     lambda g: {"form": f"p-{g['project_id']}",
                                f"p-{g['project_id']}-tokens_per_day": "5"},
                     "", id="console-limits-foreign-project"),
        pytest.param("console-keys", "GET", None, "?project={project_id}",
                     id="console-keys-foreign-project"),
        pytest.param("console-limits", "POST",
                     lambda g: {"form": f"k-{g['key_id']}",
                                f"k-{g['key_id']}-tokens_per_day": "5"},
                     "", id="console-limits-foreign-key"),
    ]


@pytest.mark.parametrize("name, method, body, query", _foreign_in_body_cases())
def test_foreign_object_in_body_or_query_is_refused_like_a_missing_one(
        objs: Objects, name: str, method: str, body: Callable[[dict[str, str]], dict] | None,
        query: str) -> None:
    """A globex id in the body or query of acme's request: the same refusal as an id that
    exists nowhere (404, or the key list's 400 "no such project in this tenant")."""
    missing_ids = {k: f"{v[:4]}doesnotexist000" for k, v in objs.globex.ids.items()}
    url = _url(name, objs.world.acme.public_id, objs.acme.ids)
    client = _client(objs.world.owner)
    answers = []
    for ids in (objs.globex.ids, missing_ids):
        with Unchanged():
            answers.append(call(client, name, method, url + query.format(**ids),
                                body(ids) if body else {}))
    foreign, missing = answers
    assert foreign.status_code in (400, 404), (foreign.status_code, foreign.content[:300])
    assert foreign.status_code == missing.status_code
    assert_names_none_of(foreign, objs.globex.markers, query.format(**objs.globex.ids))


# -- the member reads, never changes ----------------------------------------------------------


@pytest.mark.parametrize("name, method", ALL_CASES)
def test_member_reads_but_cannot_change(objs: Objects, name: str, method: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    kind = TENANT_ROUTES[name].methods[method]
    with Unchanged():
        response = call(_client(objs.world.member), name, method, url,
                        TENANT_ROUTES[name].body(method, ids))
    expected = 200 if kind == READ else 403
    assert response.status_code == expected, (kind, response.status_code, response.content[:300])


def test_member_usage_has_no_costs(objs: Objects) -> None:
    url = _url("api-usage", objs.world.acme.public_id, {}) + "?group_by=day,project"
    member = _client(objs.world.member).get(url)
    assert member.status_code == 200 and member.json()["results"]
    assert "cost_micros" not in member.content.decode()
    owner = _client(objs.world.owner).get(url).json()["results"]
    assert sum(row["cost_micros"] for row in owner) == 1234


# -- anonymous --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, method", ALL_CASES)
def test_anonymous_is_refused(objs: Objects, name: str, method: str) -> None:
    ids = objs.acme.ids
    url = _url(name, objs.world.acme.public_id, ids)
    with Unchanged():
        response = call(APIClient(), name, method, url, TENANT_ROUTES[name].body(method, ids))
    if name.startswith("api-"):
        assert response.status_code in (401, 403), response.status_code
    else:
        assert _is_login_redirect(response), (response.status_code, response.get("Location"))
    assert_names_none_of(response, objs.acme.markers, url)


# -- routes that are not below a tenant -------------------------------------------------------


def test_tenant_list_and_creation(objs: Objects) -> None:
    world = objs.world
    for client, own in ((_client(world.outsider), world.globex),
                        (_client(token=objs.globex.token), world.globex),
                        (_client(world.member), world.acme)):
        listing = client.get("/api/tenants/")
        assert listing.status_code == 200
        assert [t["id"] for t in listing.json()["results"]] == [own.public_id]
    assert APIClient().get("/api/tenants/").status_code in (401, 403)
    for client in (_client(world.owner), _client(world.outsider), _client(token=objs.acme.token),
                   _client(token=objs.globex.token), APIClient()):
        with Unchanged():
            created = client.post("/api/tenants/", {"slug": "initech", "plan": "standard"},
                                  format="json")
        assert created.status_code in (401, 403)
    assert _client(world.operator).post("/api/tenants/", {"slug": "initech", "plan": "standard"},
                                        format="json").status_code == 201


def test_plans_are_read_only_for_tenants(objs: Objects) -> None:
    world = objs.world
    plan = Plan.objects.get(name="standard")
    for client in (_client(token=objs.acme.token), _client(token=objs.globex.token),
                   _client(world.owner), _client(world.member)):
        assert client.get("/api/plans/").status_code == 200
        assert client.get(f"/api/plans/{plan.name}/").status_code == 200
        with Unchanged():
            created = client.post("/api/plans/", {"name": "gold", "tokens_per_day": 1},
                                  format="json")
            changed = client.patch(f"/api/plans/{plan.name}/", {"tokens_per_day": 1},
                                   format="json")
        assert created.status_code == changed.status_code == 403
    anonymous = APIClient()
    with Unchanged():
        assert anonymous.get("/api/plans/").status_code in (401, 403)
        assert anonymous.patch(f"/api/plans/{plan.name}/", {"tokens_per_day": 1},
                               format="json").status_code in (401, 403)
    operator = _client(world.operator).patch(f"/api/plans/{plan.name}/", {"tokens_per_day": 7},
                                             format="json")
    assert operator.status_code == 200 and operator.json()["tokens_per_day"] == 7


def test_operator_only_changes_refuse_tenant_admins_and_tokens(objs: Objects) -> None:
    world = objs.world
    tenant_url = f"/api/tenants/{world.acme.public_id}/"
    for client in (_client(token=objs.acme.token), _client(world.owner)):
        with Unchanged():
            plan = client.patch(tenant_url, {"plan": "standard", "name": "x"}, format="json")
            state = client.patch(tenant_url, {"status": "suspended"}, format="json")
            limits = client.patch(f"{tenant_url}limits", {"tokens_per_day": 5}, format="json")
        assert plan.status_code == state.status_code == limits.status_code == 403
    operator = _client(world.operator).patch(f"{tenant_url}limits", {"tokens_per_day": 5},
                                             format="json")
    assert operator.status_code == 200


def test_platform_report_is_for_operators_only(objs: Objects) -> None:
    world = objs.world
    operator_token = issue_management_token(None, name="ops", actor="test").plaintext
    for fmt in ("csv", "xlsx"):
        url = f"/api/reports/{MONTH}.{fmt}"
        for client in (_client(world.owner), _client(world.member), _client(world.outsider),
                       _client(token=objs.acme.token), _client(token=objs.globex.token)):
            response = client.get(url)
            assert response.status_code == 403, response.status_code
            assert_names_none_of(response, objs.acme.markers | objs.globex.markers, url)
        assert APIClient().get(url).status_code in (401, 403)
        for client in (_client(world.operator), _client(token=operator_token)):
            response = client.get(url)
            assert response.status_code == 200
            assert response["Content-Disposition"] == (
                f'attachment; filename="all-tenants-{MONTH}.{fmt}"')


def test_schema_and_docs_name_no_tenant_object(objs: Objects) -> None:
    for url in (reverse("api-schema"), reverse("api-docs")):
        response = APIClient().get(url)
        # Signed-in users and tokens only (issue 11, item 13): anonymous is refused.
        assert response.status_code == 401
        assert_names_none_of(response, objs.acme.markers | objs.globex.markers, url)
        for client in (_client(objs.world.outsider), _client(token=objs.acme.token)):
            shown = client.get(url)
            assert shown.status_code == 200
            assert_names_none_of(shown, objs.acme.markers | objs.globex.markers, url)


def test_login_and_logout(objs: Objects) -> None:
    client = _client(objs.world.outsider)
    page = APIClient().get(reverse("console-login"))
    assert page.status_code == 200
    assert_names_none_of(page, objs.acme.markers | objs.globex.markers, "")
    assert client.get("/api/tenants/").status_code == 200
    assert client.post(reverse("console-logout")).status_code in (200, 302)
    assert client.get("/api/tenants/").status_code in (401, 403)


def test_console_index_never_lands_on_a_foreign_tenant(objs: Objects) -> None:
    client = _client(objs.world.outsider)
    session = client.session
    session[SESSION_TENANT] = objs.world.acme.public_id  # e.g. left over from another login
    session.save()
    response = client.get(reverse("console-index"))
    assert response.status_code == 302
    assert response["Location"] == reverse("console-dashboard", args=[objs.world.globex.public_id])
    assert _is_login_redirect(APIClient().get(reverse("console-index")))


def test_switch_to_a_foreign_tenant_is_404(objs: Objects) -> None:
    client = _client(objs.world.outsider)
    with Unchanged():
        response = client.post(reverse("console-switch"), {"tenant": objs.world.acme.public_id})
    assert response.status_code == 404
    assert client.session.get(SESSION_TENANT) != objs.world.acme.public_id
    assert_names_none_of(response, objs.acme.markers, objs.world.acme.public_id)
    own = client.post(reverse("console-switch"), {"tenant": objs.world.globex.public_id})
    assert own.status_code == 302 and client.session[SESSION_TENANT] == objs.world.globex.public_id


def test_unknown_invitation_link_changes_nothing(objs: Objects) -> None:
    url = reverse("console-invite-accept", args=["not-a-real-secret-" + "x" * 22])
    for client in (_client(objs.world.outsider), APIClient()):
        with Unchanged():
            shown = client.get(url)
            posted = client.post(url, {"username": "mallory", "password1": "p4ss-Word-long!",
                                       "password2": "p4ss-Word-long!"})
        assert shown.status_code == posted.status_code == 410
        assert_names_none_of(posted, objs.acme.markers | objs.globex.markers, url)
    assert not Membership.objects.filter(user__username="mallory").exists()


def test_markers_are_real(objs: Objects) -> None:
    """The leak checks above look for these strings: they must be in acme's own answers."""
    owner = _client(objs.world.owner)
    shown = owner.get(f"/api/tenants/{objs.world.acme.public_id}/keys/").content.decode()
    assert objs.acme.ids["key_id"] in shown and objs.acme.ids["project_id"] in shown
    assert re.search(re.escape(objs.acme.ids["webhook_id"]), owner.get(
        f"/api/tenants/{objs.world.acme.public_id}/webhooks/").content.decode())
    acme_model, globex_model = "acme-secret-model", "globex-secret-model"
    assert acme_model in objs.acme.markers and globex_model in objs.globex.markers
    usage = owner.get(f"/api/tenants/{objs.world.acme.public_id}/usage?group_by=model")
    assert acme_model in usage.content.decode()
    report = owner.get(f"/api/tenants/{objs.world.acme.public_id}/reports/{MONTH}.csv")
    assert acme_model in report.content.decode()
    dashboard = owner.get(reverse("console-dashboard", args=[objs.world.acme.public_id]))
    assert acme_model in dashboard.content.decode()
    platform = _client(objs.world.operator).get(f"/api/reports/{MONTH}.csv").content.decode()
    assert "\nacme,standard,1," in platform and "\nglobex,standard,1," in platform


def test_another_tenants_slug_is_no_oracle(objs: Objects) -> None:
    """Project slugs are per tenant: acme may take globex's `app`, so a create never tells acme
    which slugs exist elsewhere."""
    created = _client(objs.world.owner).post(
        f"/api/tenants/{objs.world.acme.public_id}/projects/", {"slug": objs.world.app.slug},
        format="json")
    assert created.status_code == 201
    assert_names_none_of(created, objs.globex.markers, "")
