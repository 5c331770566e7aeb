"""Management API and the burn-rate breaker: pace rules on plans (operators), tenant overrides
(operators), projects and keys (tenant admins), the effective rule in the limits document; the
tenant's trips and resume (admins; audited pace.resumed; 409 when not tripped)."""

from __future__ import annotations

import pytest

from quotas.keys import tenant_tag
from quotas.limits import pace_counters
from quotas.pace import PaceBreaker
from quotas.runtime import get_engine
from tenants.models import AuditEvent, Tenant
from tenants.selectors import effective_limits
from tests.world import World


def test_operators_set_pace_on_plans_and_tenants(world: World) -> None:
    operator = world.client(world.operator)
    plan = operator.patch("/api/plans/standard/", {"pace_share_percent": 20,
                                                   "pace_period_seconds": 300}, format="json")
    assert plan.status_code == 200, plan.json()
    assert (plan.json()["pace_share_percent"], plan.json()["pace_period_seconds"]) == (20, 300)
    url = f"/api/tenants/{world.acme.public_id}/limits"
    assert world.client(world.owner).patch(url, {"pace_share_percent": 50},
                                           format="json").status_code == 403
    changed = operator.patch(url, {"pace_spend_micros": 2_000_000, "pace_cooldown_seconds": 600},
                             format="json")
    assert changed.status_code == 200, changed.json()
    effective = changed.json()["effective"]
    assert (effective["pace_share_percent"], effective["pace_spend_micros"],
            effective["pace_period_seconds"], effective["pace_cooldown_seconds"]) == (
        20, 2_000_000, 300, 600)
    assert changed.json()["overrides"]["pace_spend_micros"] == 2_000_000
    off = operator.patch(url, {"pace_share_percent": -1}, format="json").json()["effective"]
    assert off["pace_share_percent"] is None
    for bad in ({"pace_period_seconds": 7}, {"pace_share_percent": 0},
                {"pace_cooldown_seconds": 0}, {"pace_share_percent": "25"}):
        response = operator.patch(url, bad, format="json")
        assert response.status_code == 400 and set(bad) <= set(response.json()), bad


def test_admins_set_a_projects_and_a_keys_pace(world: World) -> None:
    owner = world.client(world.owner)
    base = f"/api/tenants/{world.acme.public_id}"
    project = owner.patch(f"{base}/projects/{world.web.public_id}/",
                          {"tokens_per_day": 1_000, "pace_share_percent": 30}, format="json")
    assert project.status_code == 200, project.json()
    assert project.json()["pace_share_percent"] == 30
    key = owner.patch(f"{base}/keys/{world.issued.api_key.public_id}/",
                      {"pace_spend_micros": 5_000}, format="json")
    assert key.status_code == 200 and key.json()["pace_spend_micros"] == 5_000
    created = owner.post(f"{base}/projects/", {"slug": "batch", "pace_spend_micros": 9},
                         format="json")
    assert created.status_code == 201 and created.json()["pace_spend_micros"] == 9
    assert owner.patch(f"{base}/projects/{world.web.public_id}/", {"pace_share_percent": 101},
                       format="json").status_code == 400
    assert world.client(world.member).patch(
        f"{base}/projects/{world.web.public_id}/", {"pace_share_percent": 5},
        format="json").status_code == 403


@pytest.mark.django_db
def test_trips_are_listed_and_resumed_by_admins_once(world: World) -> None:
    from tenants.services import update_project

    web = update_project(world.web, actor="test", tokens_per_day=1_000, pace_share_percent=10)
    acme = Tenant.objects.select_related("plan").get(pk=world.acme.pk)
    [counter] = pace_counters(acme, effective_limits(acme), web, world.issued.api_key)
    breaker = PaceBreaker(get_engine().client)
    assert breaker.trip(tenant_tag(acme.pk), [counter.scope_limit], breaker.now_ms()).first

    base = f"/api/tenants/{acme.public_id}/pace"
    listed = world.client(world.member).get(f"{base}/trips").json()
    assert [(t["scope"], t["kind"], t["id"], t["label"], t["active"]) for t in listed] == [
        (counter.scope, "project", web.public_id, "web", True)]
    assert listed[0]["rules"] == ["10% of 1,000 tokens a day = 100 tokens per 600 s"]
    assert world.client(world.outsider).get(f"{base}/trips").status_code == 404
    body = {"scope": counter.scope}
    assert world.client(world.member).post(f"{base}/resume", body,
                                           format="json").status_code == 403
    resumed = world.client(world.owner).post(f"{base}/resume", body, format="json")
    assert resumed.status_code == 200, resumed.json()
    assert not resumed.json()["active"] and resumed.json()["resumed_by"] == "user:owner"
    assert world.client(world.owner).post(f"{base}/resume", body,
                                          format="json").status_code == 409
    assert list(AuditEvent.objects.filter(action="pace.resumed").values_list(
        "actor", "target")) == [("user:owner", f"project:{web.public_id}")]
