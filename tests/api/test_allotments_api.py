"""Management API: projects' and keys' allotments, read and written through the services; the
refusals in the API's error shape ({"field": ["message"]}, 400, nothing changed); the limits
document's per-window allotments, pool and over-quota warning."""

from __future__ import annotations

import pytest

from tenants.models import ApiKey, AuditEvent, Project
from tenants.services import issue_management_token, set_tenant_limits, update_project
from tests.support.allotments import spend
from tests.support.api_clients import bearer
from tests.world import World

pytestmark = pytest.mark.django_db


def base(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}"


@pytest.fixture
def quota(world: World) -> World:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000, monthly_token_budget=20_000)
    return world


def test_a_project_allotment_is_written_and_read(quota: World) -> None:
    url = f"{base(quota)}/projects/{quota.web.public_id}/"
    owner = quota.client(quota.owner)
    response = owner.patch(url, {"allotment_tokens_per_day": 600,
                                 "allotment_tokens_per_month": 5000}, format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["allotment_tokens_per_day"], body["allotment_tokens_per_month"]) == (600, 5000)
    assert owner.get(url).json()["allotment_tokens_per_day"] == 600
    listed = owner.get(f"{base(quota)}/projects/").json()["results"]
    assert listed[0]["allotment_tokens_per_month"] == 5000
    # A PATCH that leaves them out keeps them; null removes one.
    owner.patch(url, {"name": "Web"}, format="json")
    assert owner.get(url).json()["allotment_tokens_per_day"] == 600
    cleared = owner.patch(url, {"allotment_tokens_per_month": None}, format="json").json()
    assert (cleared["allotment_tokens_per_day"], cleared["allotment_tokens_per_month"]) == (
        600, None)
    assert AuditEvent.objects.filter(action="project.updated", actor="user:owner").count() == 3


def test_allotments_over_the_quota_are_refused_in_the_api_shape(quota: World) -> None:
    owner = quota.client(quota.owner)
    created = owner.post(f"{base(quota)}/projects/", {
        "slug": "batch", "allotment_tokens_per_day": 700}, format="json")
    assert created.status_code == 201 and created.json()["allotment_tokens_per_day"] == 700
    before = (AuditEvent.objects.count(), Project.objects.count())
    url = f"{base(quota)}/projects/{quota.web.public_id}/"
    response = owner.patch(url, {"allotment_tokens_per_day": 301}, format="json")
    assert response.status_code == 400
    assert response.json() == {"allotment_tokens_per_day": [
        "Allotments would total 1,001 tokens per day; the tenant's daily quota is 1,000."]}
    refused = owner.post(f"{base(quota)}/projects/", {
        "slug": "late", "allotment_tokens_per_day": 301}, format="json")
    assert refused.status_code == 400 and "allotment_tokens_per_day" in refused.json()
    assert (AuditEvent.objects.count(), Project.objects.count()) == before
    quota.web.refresh_from_db()
    assert quota.web.allotment_tokens_per_day is None


def test_a_key_allotment_is_written_read_and_nested_in_its_project(quota: World) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=500)
    owner = quota.client(quota.owner)
    issued = owner.post(f"{base(quota)}/keys/", {
        "project": quota.web.public_id, "name": "batch", "allotment_tokens_per_day": 300},
        format="json")
    assert issued.status_code == 201, issued.json()
    assert issued.json()["allotment_tokens_per_day"] == 300
    key = quota.issued.api_key
    url = f"{base(quota)}/keys/{key.public_id}/"
    response = owner.patch(url, {"allotment_tokens_per_day": 201}, format="json")
    assert response.status_code == 400
    assert response.json() == {"allotment_tokens_per_day": [
        "The allotments of project web's keys would total 501 tokens per day; the project's "
        "allotment is 500."]}
    ok = owner.patch(url, {"allotment_tokens_per_day": 200}, format="json")
    assert ok.status_code == 200 and ok.json()["allotment_tokens_per_day"] == 200
    assert owner.get(url).json()["allotment_tokens_per_day"] == 200


def test_other_refusals_name_their_field(world: World) -> None:
    owner = world.client(world.owner)
    url = f"{base(world)}/keys/{world.issued.api_key.public_id}/"
    no_budget = owner.patch(url, {"allotment_tokens_per_month": 10}, format="json")
    assert no_budget.status_code == 400
    assert no_budget.json() == {"allotment_tokens_per_month": [
        "The tenant has no cycle token budget to allot from: it has no monthly token budget."]}
    own_limit = owner.patch(url, {"tokens_per_day": 100, "allotment_tokens_per_day": 101},
                            format="json")
    assert own_limit.status_code == 400
    assert own_limit.json()["allotment_tokens_per_day"][0].startswith(
        "Must be at most 100, the key's own tokens per day")
    wrong_type = owner.patch(url, {"allotment_tokens_per_day": "100"}, format="json")
    assert wrong_type.status_code == 400
    assert wrong_type.json() == {"allotment_tokens_per_day": ["Must be a whole number."]}
    negative = owner.patch(url, {"allotment_tokens_per_day": -1}, format="json")
    assert negative.status_code == 400
    key = ApiKey.objects.get(pk=world.issued.api_key.pk)
    assert (key.tokens_per_day, key.allotment_tokens_per_day) == (None, None)


def test_who_may_set_allotments(quota: World) -> None:
    # Owners, admins and full-scope tokens only: an allotment carves the tenant's shared pool for
    # every project and key, which is more than managing keys (a keys-scope token was allowed).
    url = f"{base(quota)}/projects/{quota.web.public_id}/"
    body = {"allotment_tokens_per_day": 10}
    assert quota.client(quota.member).patch(url, body, format="json").status_code == 403
    assert quota.client(quota.outsider).patch(url, body, format="json").status_code == 404
    reader = issue_management_token(quota.acme, name="r", actor="test", scope="read")
    assert bearer(reader.plaintext).patch(url, body, format="json").status_code == 403
    full = issue_management_token(quota.acme, name="f", actor="test", scope="full")
    response = bearer(full.plaintext).patch(url, body, format="json")
    assert response.status_code == 200 and response.json()["allotment_tokens_per_day"] == 10
    response = quota.client(quota.owner).patch(url, {"allotment_tokens_per_day": 20},
                                               format="json")
    assert response.status_code == 200 and response.json()["allotment_tokens_per_day"] == 20


def test_a_keys_token_cannot_change_allotments(quota: World) -> None:
    keys_token = bearer(issue_management_token(quota.acme, name="k", actor="test",
                                               scope="keys").plaintext)
    project_url = f"{base(quota)}/projects/{quota.web.public_id}/"
    key = quota.issued.api_key
    key_url = f"{base(quota)}/keys/{key.public_id}/"
    update_project(quota.web, actor="test", allotment_tokens_per_day=300)
    events = AuditEvent.objects.count()
    refusals = [
        (project_url, "patch", {"name": "Web", "allotment_tokens_per_day": 301},
         "allotment_tokens_per_day"),
        (project_url, "patch", {"allotment_tokens_per_day": None}, "allotment_tokens_per_day"),
        (key_url, "patch", {"allotment_tokens_per_month": 5}, "allotment_tokens_per_month"),
        (f"{base(quota)}/projects/", "post",
         {"slug": "batch", "allotment_tokens_per_day": 1, "allotment_tokens_per_month": 1},
         "allotment_tokens_per_day and allotment_tokens_per_month"),
        (f"{base(quota)}/keys/", "post",
         {"project": quota.web.public_id, "name": "deploy", "allotment_tokens_per_day": 1},
         "allotment_tokens_per_day"),
    ]
    for url, method, body, fields in refusals:
        response = getattr(keys_token, method)(url, body, format="json")
        assert response.status_code == 403, (url, body, response.content)
        assert response.json() == {"detail": (
            f"This management token's scope is 'keys'; changing {fields} needs 'full': an "
            "allotment carves the tenant's shared pool for every project and key.")}
    # Nothing changed: no rename with the refused allotment, no project or key created.
    assert AuditEvent.objects.count() == events
    web = Project.objects.get(pk=quota.web.pk)
    assert (web.name, web.allotment_tokens_per_day) == ("web", 300)
    assert not Project.objects.filter(slug="batch").exists()
    assert not ApiKey.objects.filter(name="deploy").exists()
    # Everything else it still may: the stored allotment sent back (a PATCH of the document it
    # read), null allotments on a new key, other fields.
    document = keys_token.get(project_url).json()
    response = keys_token.patch(project_url, {
        "name": "Web", "tokens_per_day": 900,
        "allotment_tokens_per_day": document["allotment_tokens_per_day"],
        "allotment_tokens_per_month": document["allotment_tokens_per_month"]}, format="json")
    assert response.status_code == 200, response.json()
    web = Project.objects.get(pk=quota.web.pk)
    assert (web.name, web.tokens_per_day, web.allotment_tokens_per_day) == ("Web", 900, 300)
    issued = keys_token.post(f"{base(quota)}/keys/", {
        "project": quota.web.public_id, "name": "deploy", "allotment_tokens_per_day": None},
        format="json")
    assert issued.status_code == 201, issued.json()
    assert issued.json()["allotment_tokens_per_day"] is None
    renamed = keys_token.patch(key_url, {"name": "renamed", "allotment_tokens_per_day": None},
                               format="json")
    assert renamed.status_code == 200 and renamed.json()["name"] == "renamed"


def test_the_limits_document_carries_the_pool_and_the_warning(quota: World) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=800)
    url = f"{base(quota)}/limits"
    body = quota.client(quota.member).get(url).json()
    assert body["allotments"] == [
        {"window": "day", "quota": 1000, "allotted": 800, "pool": 200, "over": 0, "warning": ""},
        {"window": "month", "quota": 20_000, "allotted": 0, "pool": 20_000, "over": 0,
         "warning": ""},
    ]
    # An operator lowers the quota below the allotments: allowed, and the document says so.
    operator = issue_management_token(None, name="ops", actor="test")
    lowered = bearer(operator.plaintext).patch(url, {"tokens_per_day": 600}, format="json")
    assert lowered.status_code == 200
    day = lowered.json()["allotments"][0]
    assert (day["quota"], day["allotted"], day["pool"], day["over"]) == (600, 800, 0, 200)
    assert day["warning"].startswith("Allotments total 800 tokens per day, more than the "
                                     "tenant's daily quota of 600")


def test_the_quota_endpoint_returns_the_consoles_allotment_figures(quota: World) -> None:
    from tenants.services import create_project, issue_key, update_key

    set_tenant_limits(quota.acme, actor="test", tokens_per_day=10_000)
    update_project(quota.web, actor="test", allotment_tokens_per_day=4000)
    key = quota.issued.api_key
    update_key(key, actor="test", allotment_tokens_per_day=1000)
    batch = create_project(quota.acme, "batch", actor="test")
    etl = issue_key(batch, actor="test", name="etl").api_key
    spend(Project.objects.get(pk=quota.web.pk), ApiKey.objects.get(pk=key.pk), 1500, "ci-1")
    spend(batch, etl, 2000, "etl-1")

    response = quota.client(quota.member).get(f"{base(quota)}/quota")
    assert response.status_code == 200
    allotments = response.json()["allotments"]
    assert allotments["pools"] == [{
        "window": "day", "quota": 10_000, "allotted": 4000, "pool": 6000, "credit": 0,
        "borrowed": 2000, "left": 4000, "over": 0}]
    by_scope = {(a["scope"], a["id"]): a for a in allotments["allotments"]}
    assert by_scope[("key", key.public_id)] == {
        "scope": "key", "id": key.public_id, "label": "ci", "window": "day", "allotment": 1000,
        "used_from_allotment": 1000, "borrowed": 500, "left": 0}
    project = by_scope[("project", quota.web.public_id)]
    assert (project["allotment"], project["used_from_allotment"], project["borrowed"],
            project["left"]) == (4000, 1500, 0, 2500)
    assert len(by_scope) == 2
    # No other tenant's allotments, and none for a tenant without any.
    other = quota.client(quota.outsider).get(f"/api/tenants/{quota.globex.public_id}/quota")
    assert other.json()["allotments"] == {"pools": [], "allotments": []}
