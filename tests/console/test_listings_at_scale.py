"""The keys and audit listings at a tenant's real size (issue 15): the console's keys page and
audit page, the management API's keys list and audit-events list.

- Filters select what they say (search by name or id, project, status including rotating, last
  use), in a total order, and a page boundary never loses or repeats a row.
- The audit trail walks by cursor through events of one same instant (ties) without a gap.
- Bad input is a 400 naming it, a page past the end an empty page saying so; never a 500.
- Exact query counts, the same with a few keys or events as with many more (a query per row
  fails), and response sizes bounded by the page size, not the tenant's size.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from django.test import Client
from django.utils import timezone

from tenants.models import ApiKey, AuditEvent
from tenants.services import issue_key, revoke_key, rotate_key
from tests.world import World

pytestmark = pytest.mark.django_db


def login(user: object) -> Client:
    client = Client()
    client.force_login(user)
    return client


def keys_page(world: World) -> str:
    return f"/console/t/{world.acme.public_id}/keys/"


def keys_api(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/keys/"


def audit_page(world: World) -> str:
    return f"/console/t/{world.acme.public_id}/audit/"


def audit_api(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/audit-events/"


def listed_names(html: str) -> list[str]:
    """The key names of the keys page's table, in order."""
    table = html[html.index('<table id="keys">'):]
    return re.findall(r'<td><a href="/console/t/[^/]+/keys/key_[^/]+/">([^<]+)</a></td>', table)


def add_keys(world: World, count: int, prefix: str = "bulk") -> list[ApiKey]:
    return [issue_key(world.web, actor="test", name=f"{prefix}-{n:03d}").api_key
            for n in range(count)]


def add_events(world: World, count: int) -> None:
    # bulk_create stamps every row with one instant (auto_now_add): all ties, on purpose.
    AuditEvent.objects.bulk_create(
        AuditEvent(tenant=world.acme, actor="user:bulk", action="key.updated",
                   target=f"key_bulk{n:04d}", data={"n": n}) for n in range(count))


# -- filters and order ---------------------------------------------------------------------------


def test_keys_page_filters_by_name_project_status_and_last_use(world: World) -> None:
    now = timezone.now()
    rotating = issue_key(world.web, actor="test", name="rotating-one").api_key
    rotate_key(rotating, actor="test", grace_seconds=3600)
    rotated_now = issue_key(world.web, actor="test", name="rotated-now").api_key
    rotate_key(rotated_now, actor="test", grace_seconds=0)  # old secret revoked: not rotating
    gone = issue_key(world.web, actor="test", name="gone").api_key
    revoke_key(gone, actor="test")
    lapsed = issue_key(world.web, actor="test", name="lapsed",
                       expires_at=now + timedelta(seconds=1)).api_key
    ApiKey.objects.filter(pk=lapsed.pk).update(expires_at=now - timedelta(hours=1))
    ApiKey.objects.filter(pk=rotating.pk).update(last_used_at=now - timedelta(hours=2))
    ApiKey.objects.filter(pk=gone.pk).update(last_used_at=now - timedelta(days=40))
    owner = login(world.owner)

    def names(**query: str) -> set[str]:
        response = owner.get(keys_page(world), query)
        assert response.status_code == 200, response.content[:300]
        return set(listed_names(response.content.decode()))

    issued = world.issued.api_key.name or world.issued.api_key.public_id
    assert names(status="rotating") == {"rotating-one"}
    assert names(status="revoked") == {"gone"}
    assert names(status="expired") == {"lapsed"}
    assert names(status="active") == {"rotating-one", "rotated-now", issued}
    assert names(q="ROTAT") == {"rotating-one", "rotated-now"}
    assert names(q=gone.public_id) == {"gone"}
    assert names(used="day") == {"rotating-one"}
    assert names(used="idle") == {"rotated-now", "gone", "lapsed", issued}
    assert names(used="never") == {"rotated-now", "lapsed", issued}
    assert names(project=world.web.public_id, status="revoked", q="go") == {"gone"}
    # The API's list: the same filters, the same keys.
    api = world.client(world.owner)
    for query, expected in (({"status": "rotating"}, {"rotating-one"}),
                            ({"q": "rotat", "used": "never"}, {"rotated-now"}),
                            ({"status": "revoked", "used": "idle"}, {"gone"})):
        body = api.get(keys_api(world), query).json()
        assert {row["name"] for row in body["results"]} == expected, query
        assert body["count"] == len(expected)
        assert all(row["rotating"] == (row["name"] == "rotating-one") for row in body["results"])
    # Another tenant's key is not found by its id.
    assert names(q=world.other_issued.api_key.public_id) == set()


@pytest.mark.parametrize("order", ["newest", "oldest", "name", "last_used"])
def test_pages_of_keys_neither_lose_nor_repeat_a_key(world: World, order: str) -> None:
    made = add_keys(world, 13)
    now = timezone.now()
    # Ties on purpose: three keys used at one instant, the rest never.
    ApiKey.objects.filter(pk__in=[k.pk for k in made[:3]]).update(last_used_at=now)
    api = world.client(world.owner)
    seen: list[str] = []
    for offset in range(0, 14, 4):
        body = api.get(keys_api(world), {"order": order, "limit": 4, "offset": offset}).json()
        seen += [row["id"] for row in body["results"]]
    assert sorted(seen) == sorted([k.public_id for k in made] + [world.issued.api_key.public_id])
    owner = login(world.owner)
    pages = [listed_names(owner.get(keys_page(world), {"sort": order, "per_page": "25",
                                                       "page": "1"}).content.decode())]
    assert len(pages[0]) == 14 and len(set(pages[0])) == 14
    if order == "name":
        assert pages[0] == sorted(pages[0])


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("query", "status", "text"), [
    ({"page": "abc"}, 400, "The page must be a whole number from 1."),
    ({"page": "0"}, 400, "The page must be a whole number from 1."),
    ({"page": "99999999999999999999"}, 400, "The page must be a whole number from 1."),
    ({"page": "²"}, 400, "The page must be a whole number from 1."),
    ({"page": "7"}, 200, "Page 7 is past the last page (1)."),
    ({"status": "sleeping"}, 400, "Select a valid choice."),
    ({"used": "yesterday"}, 400, "Select a valid choice."),
    ({"sort": "-id"}, 400, "Select a valid choice."),
    ({"per_page": "100000"}, 400, "Select a valid choice."),
    ({"project": "prj_nope"}, 400, "No such project in this tenant."),
    ({"q": "x" * 201}, 400, "at most 200 characters"),
])
def test_keys_page_bad_input_is_plain(world: World, query: dict[str, str], status: int,
                                      text: str) -> None:
    response = login(world.owner).get(keys_page(world), query)
    html = response.content.decode()
    assert response.status_code == status and text in html
    assert listed_names(html) == []


@pytest.mark.parametrize(("url", "query", "field"), [
    (keys_api, {"status": "sleeping"}, "status"),
    (keys_api, {"used": "yesterday"}, "used"),
    (keys_api, {"order": "-created_at"}, "order"),
    (keys_api, {"q": "x" * 201}, "q"),
    (keys_api, {"limit": "201"}, "limit"),
    (keys_api, {"offset": "-1"}, "offset"),
    (audit_api, {"cursor": "not-a-cursor"}, "cursor"),
    (audit_api, {"cursor": "x" * 5000}, "cursor"),
    (audit_api, {"limit": "0"}, "limit"),
])
def test_api_lists_bad_input_is_a_400_naming_it(world: World, url: Any, query: dict[str, str],
                                                field: str) -> None:
    response = world.client(world.owner).get(url(world), query)
    assert response.status_code == 400 and field in response.json(), response.content[:300]


def test_api_keys_page_past_the_end_is_empty(world: World) -> None:
    body = world.client(world.owner).get(keys_api(world), {"offset": "500"}).json()
    assert body["results"] == [] and body["count"] == 1


# -- the audit trail by cursor -------------------------------------------------------------------


def test_audit_cursor_walks_ties_without_a_gap(world: World) -> None:
    add_events(world, 23)  # one instant for all 23
    api = world.client(world.owner)
    url: str | None = audit_api(world) + "?action=key.updated&limit=5"
    seen: list[str] = []
    pages = 0
    while url:
        body = api.get(url).json()
        seen += [row["target"] for row in body["results"]]
        url = body["next"]
        pages += 1
        if url:
            assert "key_bulk" not in url and "cursor" in parse_qs(urlparse(url).query)
    assert pages == 5 and len(seen) == 23 and len(set(seen)) == 23
    # Newest first; among ties the later row (higher id) first.
    assert seen[0] == "key_bulk0022" and seen[-1] == "key_bulk0000"


def test_console_audit_walks_to_the_oldest(world: World) -> None:
    add_events(world, 120)
    owner = login(world.owner)
    url = audit_page(world) + "?action=key.updated"
    seen: set[str] = set()
    for _ in range(5):
        response = owner.get(url)
        assert response.status_code == 200
        html = response.content.decode()
        seen |= set(re.findall(r"<code>(key_bulk\d{4})</code>", html))
        older = re.search(r'href="\?([^"]+)">Older</a>', html)
        if older is None:
            break
        url = audit_page(world) + "?" + older.group(1).replace("&amp;", "&")
    assert len(seen) == 120


# -- query counts and sizes ------------------------------------------------------------------------


def _count_and_size(client: Any, url: str, django_assert_num_queries: Any,
                    expected: int) -> int:
    client.get(url)  # per-process caches fill on a first request
    with django_assert_num_queries(expected):
        response = client.get(url)
    assert response.status_code == 200, response.content[:300]
    return len(response.content)


# (url, who reads it, exact queries): the same with 3 keys or events and with 160 more.
LISTINGS = [
    pytest.param(lambda w: keys_page(w), "console", 14, id="console-keys"),
    pytest.param(lambda w: keys_page(w) + "?status=rotating&q=bulk&sort=last_used", "console",
                 14, id="console-keys-filtered"),
    pytest.param(lambda w: f"/console/t/{w.acme.public_id}/projects/", "console", 13,
                 id="console-projects"),
    pytest.param(lambda w: audit_page(w) + "?action=key.updated", "console", 10,
                 id="console-audit"),
    pytest.param(lambda w: keys_api(w), "api", 8, id="api-keys"),
    pytest.param(lambda w: keys_api(w) + "?status=rotating&order=name", "api", 8,
                 id="api-keys-rotating"),
    pytest.param(lambda w: audit_api(w), "api", 4, id="api-audit"),
]


@pytest.mark.parametrize(("url", "via", "queries"), LISTINGS)
def test_listing_queries_and_size_do_not_grow(world: World, django_assert_num_queries: Any,
                                              url: Any, via: str, queries: int) -> None:
    client = world.client(world.owner) if via == "api" else login(world.owner)

    def grow(keys: int, events: int) -> None:
        made = add_keys(world, keys, prefix=f"bulk{keys}")
        for api_key in made[::2]:
            rotate_key(api_key, actor="test", grace_seconds=3600)  # rotating: two valid secrets
        add_events(world, events)

    grow(3, 3)
    small = _count_and_size(client, url(world), django_assert_num_queries, queries)
    grow(160, 400)
    large = _count_and_size(client, url(world), django_assert_num_queries, queries)
    # A page is at most its page size (50 keys or events), whatever the tenant holds.
    assert large < 120_000, large
    assert small <= large


# -- the key scopes of /quota and /limits ------------------------------------------------------


@pytest.mark.parametrize("path", ["quota", "limits"])
def test_key_scopes_come_a_page_at_a_time(world: World, path: str) -> None:
    made = add_keys(world, 3, prefix="scoped")
    revoke_key(made[0], actor="test")  # a revoked key has no live counter: never listed
    live = {world.issued.api_key.public_id, made[1].public_id, made[2].public_id}
    api = world.client(world.owner)

    def document(url: str) -> dict[str, Any]:
        response = api.get(url)
        assert response.status_code == 200, response.content[:300]
        body = response.json()
        return body if path == "quota" else body["live"]

    url: str | None = f"/api/tenants/{world.acme.public_id}/{path}?key_limit=2"
    seen: list[str] = []
    pages = 0
    while url:
        body = document(url)
        assert body["keys"]["count"] == 3 and body["keys"]["limit"] == 2
        refs = {s["id"] for s in body["scopes"] if s["scope"] == "key"}
        assert len(refs) <= 2
        seen += sorted(refs)
        # The tenant's and projects' scopes are on every page.
        assert any(s["scope"] == "tenant" for s in body["scopes"])
        assert any(s["scope"] == "project" for s in body["scopes"])
        url = body["keys"]["next"]
        pages += 1
    assert pages == 2 and sorted(seen) == sorted(live)
    none = document(f"/api/tenants/{world.acme.public_id}/{path}?key_limit=0")
    assert not [s for s in none["scopes"] if s["scope"] == "key"]
    assert none["keys"] == {"count": 3, "limit": 0, "offset": 0, "next": None}
    for bad in ("key_limit=201", "key_limit=-1", "key_offset=x"):
        response = api.get(f"/api/tenants/{world.acme.public_id}/{path}?{bad}")
        assert response.status_code == 400 and bad.split("=")[0] in response.json()
