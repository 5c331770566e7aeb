"""Management API: plans (everyone reads, operators write), tenants (operators create, admins
rename), a tenant's limits with live status (503 without Redis) and alert thresholds."""

from __future__ import annotations

from typing import Any

import pytest

from quotas.engine import QuotaStoreUnavailable
from tenants.models import AuditEvent, Plan, Tenant
from tests.support.api_clients import bearer
from tests.world import World


def limits_url(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/limits"


# -- plans ----------------------------------------------------------------------------------------


def test_everyone_authenticated_reads_plans(world: World) -> None:
    for user in (world.owner, world.member, world.outsider, world.operator):
        response = world.client(user).get("/api/plans/")
        assert response.status_code == 200
        assert "standard" in {p["name"] for p in response.json()["results"]}
    assert world.client(world.member).get("/api/plans/standard/").json()["name"] == "standard"
    assert world.client(world.owner).get("/api/plans/nope/").status_code == 404
    assert world.client(None).get("/api/plans/").status_code in (401, 403)


def test_only_operators_write_plans(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    published: list[tuple[str, Any]] = []
    monkeypatch.setattr("tenants.invalidation.publish", lambda kind, ident=None:
                        published.append((kind, ident)))
    body = {"name": "tiny", "tokens_per_day": 100, "requests_per_second": 1}
    for user in (world.owner, world.member, world.outsider):
        assert world.client(user).post("/api/plans/", body, format="json").status_code == 403
        assert world.client(user).patch("/api/plans/standard/", {"tokens_per_day": 1},
                                        format="json").status_code == 403
    assert not Plan.objects.filter(name="tiny").exists()
    assert Plan.objects.get(name="standard").tokens_per_day != 1

    operator = world.client(world.operator)
    created = operator.post("/api/plans/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["display_name"] == "tiny"
    changed = operator.patch("/api/plans/tiny/", {"tokens_per_day": 200, "name": "renamed"},
                             format="json")
    assert changed.status_code == 200 and changed.json()["tokens_per_day"] == 200
    assert changed.json()["name"] == "tiny"
    plan = Plan.objects.get(name="tiny")
    assert ("plan", plan.pk) in published
    assert list(AuditEvent.objects.filter(target="tiny").values_list("action", flat=True)
                .order_by("id")) == ["plan.created", "plan.updated"]


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "standard", "tokens_per_day": 1, "requests_per_second": 1}, "name"),
    ({"name": "x", "tokens_per_day": -2, "requests_per_second": 1}, "tokens_per_day"),
    ({"name": "y", "tokens_per_day": 1, "requests_per_second": 1,
      "over_quota_policy": "fallback"}, "fallback_model"),
    ({"name": "z", "tokens_per_day": 1, "requests_per_second": 1, "safety_factor": "0.5"},
     "safety_factor"),
])
def test_bad_plans_are_400(world: World, body: dict[str, Any], field: str) -> None:
    before = (Plan.objects.count(), AuditEvent.objects.count())
    response = world.client(world.operator).post("/api/plans/", body, format="json")
    assert response.status_code == 400 and field in response.json()
    assert (Plan.objects.count(), AuditEvent.objects.count()) == before


def test_operator_token_writes_plans(world: World) -> None:
    from tenants.services import issue_management_token

    operator = bearer(issue_management_token(None, name="ops", actor="test").plaintext)
    tenant_token = bearer(issue_management_token(world.acme, name="ci", actor="test").plaintext)
    assert tenant_token.patch("/api/plans/standard/", {"queue_priority": 3},
                              format="json").status_code == 403
    assert operator.patch("/api/plans/standard/", {"queue_priority": 3},
                          format="json").status_code == 200


# -- tenants ----------------------------------------------------------------------------------------


def test_operator_creates_tenants_others_cannot(world: World) -> None:
    body = {"slug": "initech", "name": "Initech", "plan": "standard"}
    for user in (world.owner, world.member, world.outsider):
        assert world.client(user).post("/api/tenants/", body, format="json").status_code == 403
    created = world.client(world.operator).post("/api/tenants/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["id"].startswith("ten_") and created.json()["plan"] == "standard"
    again = world.client(world.operator).post("/api/tenants/", body, format="json")
    assert again.status_code == 400 and "slug" in again.json()
    unknown = world.client(world.operator).post(
        "/api/tenants/", {"slug": "x", "plan": "gold"}, format="json")
    assert unknown.status_code == 400 and "plan" in unknown.json()
    assert Tenant.objects.filter(slug="initech").count() == 1


def test_patch_tenant_name_plan_status(world: World) -> None:
    url = f"/api/tenants/{world.acme.public_id}/"
    owner = world.client(world.owner)
    renamed = owner.patch(url, {"name": "Acme Inc"}, format="json")
    assert renamed.status_code == 200 and renamed.json()["name"] == "Acme Inc"
    assert owner.patch(url, {"plan": "free"}, format="json").status_code == 403
    assert owner.patch(url, {"status": "suspended"}, format="json").status_code == 403
    assert world.client(world.member).patch(url, {"name": "x"}, format="json").status_code == 403
    assert world.client(world.outsider).patch(url, {"name": "x"},
                                              format="json").status_code == 404
    assert owner.patch(url, {"name": ""}, format="json").status_code == 400
    operator = world.client(world.operator)
    done = operator.patch(url, {"plan": "free", "status": "suspended"}, format="json")
    assert done.status_code == 200 and done.json()["plan"] == "free"
    world.acme.refresh_from_db()
    assert (world.acme.name, world.acme.plan.name, world.acme.status) == (
        "Acme Inc", "free", "suspended")
    actions = set(AuditEvent.objects.filter(target=world.acme.public_id)
                  .values_list("action", flat=True))
    assert {"tenant.renamed", "tenant.plan_changed", "tenant.status_changed"} <= actions


# -- limits -------------------------------------------------------------------------------------


def test_limits_owner_member_outsider(world: World) -> None:
    response = world.client(world.owner).get(limits_url(world))
    assert response.status_code == 200
    body = response.json()
    assert body["plan"]["name"] == "standard"
    assert set(body["effective"]) >= {"tokens_per_day", "monthly_token_budget"}
    scopes = {(s["scope"], s["id"], s["window"]) for s in body["live"]["scopes"]}
    assert ("project", world.web.public_id, "day") in scopes
    assert ("key", world.issued.api_key.public_id, "day") in scopes
    assert not any(s["id"] in (world.app.public_id, world.other_issued.api_key.public_id)
                   for s in body["live"]["scopes"])
    assert world.client(world.member).get(limits_url(world)).status_code == 200
    assert world.client(world.member).get(limits_url(world) + "/").status_code == 200
    assert world.client(world.outsider).get(limits_url(world)).status_code == 404


def test_limits_with_redis_down_is_503_with_static_part(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(tenant: Tenant, **kwargs: object) -> None:
        raise QuotaStoreUnavailable("connection refused")

    monkeypatch.setattr("config.api.limit_views.quota_status", down)
    response = world.client(world.owner).get(limits_url(world))
    assert response.status_code == 503
    body = response.json()
    assert "quota store" in body["detail"] and body["live"] is None
    assert body["plan"]["name"] == "standard"


def test_alert_thresholds_by_admin_overrides_by_operator(world: World) -> None:
    owner = world.client(world.owner)
    ok = owner.patch(limits_url(world), {"alert_thresholds": [5, 20]}, format="json")
    assert ok.status_code == 200 and ok.json()["alert_thresholds"] == [20, 5]
    before = AuditEvent.objects.count()
    assert owner.patch(limits_url(world), {"tokens_per_day": 10},
                       format="json").status_code == 403
    assert world.client(world.member).patch(limits_url(world), {"alert_thresholds": [3]},
                                            format="json").status_code == 403
    assert world.client(world.outsider).patch(limits_url(world), {"alert_thresholds": [3]},
                                              format="json").status_code == 404
    bad = owner.patch(limits_url(world), {"alert_thresholds": [0, 100]}, format="json")
    assert bad.status_code == 400 and "alert_thresholds" in bad.json()
    assert owner.patch(limits_url(world), {}, format="json").status_code == 400
    assert AuditEvent.objects.count() == before
    operator = world.client(world.operator)
    set_ = operator.patch(limits_url(world), {"tokens_per_day": 5000,
                                              "model_tokens_per_day": {"gpt-4o": 100}},
                          format="json")
    assert set_.status_code == 200
    assert set_.json()["effective"]["tokens_per_day"] == 5000
    assert set_.json()["overrides"]["model_tokens_per_day"] == {"gpt-4o": 100}
    unlimited = operator.patch(limits_url(world), {"tokens_per_day": -1}, format="json")
    assert unlimited.json()["effective"]["tokens_per_day"] is None
    bad_override = operator.patch(limits_url(world), {"tokens_per_day": -5}, format="json")
    assert bad_override.status_code == 400 and "tokens_per_day" in bad_override.json()


def test_saved_limits_answer_200_even_with_redis_down(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(tenant: Tenant, **kwargs: object) -> None:
        raise QuotaStoreUnavailable("connection refused")

    monkeypatch.setattr("config.api.limit_views.quota_status", down)
    response = world.client(world.owner).patch(limits_url(world), {"alert_thresholds": [30]},
                                               format="json")
    assert response.status_code == 200
    assert response.json()["live"] is None and "quota store" in response.json()["detail"]
    world.acme.refresh_from_db()
    assert world.acme.alert_thresholds == [30]
