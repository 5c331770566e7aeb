"""Pace rules (the burn-rate breaker): the plan's, overridden per tenant, project and key, resolve
into the pace counters the gateway reserves (quotas.limits.pace_counters); bad values are
refused by the services and the database; changes are audited; the admin edits them through
the services."""
from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.test import Client, RequestFactory

from quotas.engine import UNLIMITED, Unit
from quotas.limits import SPEND_RATE_EXCEEDED, Counter, pace_counters, request_counters
from quotas.pace import PaceLimit
from quotas.windows import WindowKind
from tenants.models import AuditEvent, Plan, Project, Tenant
from tenants.selectors import effective_limits
from tenants.services import (
    create_project,
    create_tenant,
    issue_key,
    set_tenant_limits,
    update_key,
    update_plan,
    update_project,
)

pytestmark = pytest.mark.django_db


def _tenant(plan: str = "free", **overrides: Any) -> Tenant:
    tenant = create_tenant(f"p-{plan}-{len(overrides)}-{Tenant.objects.count()}",
                           plan_name=plan, actor="test", **overrides)
    return Tenant.objects.select_related("plan").get(pk=tenant.pk)


def _counters(tenant: Tenant, project: Project, **key_options: Any) -> dict[tuple[str, Unit],
                                                                           Counter]:
    api_key = issue_key(project, actor="test", **key_options).api_key
    return {(c.kind, c.unit): c for c in pace_counters(tenant, effective_limits(tenant), project,
                                                          api_key)}


def test_the_seeded_enterprise_plan_is_protected_and_the_others_are_not() -> None:
    plans = {p.name: p for p in Plan.objects.all()}
    assert (plans["enterprise"].pace_share_percent, plans["enterprise"].pace_period_seconds,
            plans["enterprise"].pace_cooldown_seconds) == (25, 600, 1800)
    assert plans["free"].pace_share_percent is None and plans["standard"].pace_share_percent is None
    limits = effective_limits(_tenant("enterprise"))
    assert limits.paced and (limits.pace_share_percent, limits.pace_spend_micros) == (25, UNLIMITED)


def test_an_enterprise_call_is_checked_against_the_tenants_pace() -> None:
    tenant = _tenant("enterprise")
    project = create_project(tenant, "web", actor="test")
    api_key = issue_key(project, actor="test").api_key
    counters = request_counters(tenant, effective_limits(tenant), project, api_key, "gpt-4o")
    paced = [c for c in counters if isinstance(c.scope_limit, PaceLimit)]
    assert [(c.kind, c.limit, c.window, c.reason) for c in paced] == [
        ("tenant", 12_500_000, WindowKind.PACE_10M, SPEND_RATE_EXCEEDED)]
    assert counters[-1] is paced[-1]  # last: a full quota is reported as the quota


def test_tenant_overrides_switch_off_or_change_the_plans_rule() -> None:
    off = effective_limits(_tenant("enterprise", pace_share_percent=-1))
    assert not off.paced
    spend = effective_limits(_tenant("free", pace_spend_micros=5_000_000,
                                     pace_period_seconds=60, pace_cooldown_seconds=120))
    assert (spend.pace_share_percent, spend.pace_spend_micros, spend.pace_period_seconds,
            spend.pace_cooldown_seconds) == (UNLIMITED, 5_000_000, 60, 120)


def test_projects_and_keys_take_the_tenants_share_of_their_own_day_or_their_own() -> None:
    tenant = _tenant("free", tokens_per_day=-1, pace_share_percent=20,
                     pace_spend_micros=1_000_000, pace_cooldown_seconds=900)
    project = create_project(tenant, "web", actor="test", tokens_per_day=1_000_000,
                             pace_share_percent=10, pace_spend_micros=300_000)
    found = _counters(tenant, project, tokens_per_day=50_000)
    assert {k: c.limit for k, c in found.items()} == {
        ("project", Unit.TOKENS): 100_000,  # its own 10% of its own day
        ("key", Unit.TOKENS): 10_000,  # the tenant's 20% of the key's day
        ("tenant", Unit.MICROS): 1_000_000,
        ("project", Unit.MICROS): 300_000,
    }  # no tenant share: the tenant's day is unlimited
    assert all(c.scope_limit.cooldown_s == 900 for c in found.values())
    assert found[("project", Unit.TOKENS)].scope_limit.owner == f"project:{project.public_id}"
    # A key's own share and spend.
    own = _counters(tenant, project, tokens_per_day=50_000, pace_share_percent=50,
                    pace_spend_micros=7)
    assert (own[("key", Unit.TOKENS)].limit, own[("key", Unit.MICROS)].limit) == (25_000, 7)
    # Without a daily limit there is no share to take.
    bare = create_project(tenant, "bare", actor="test")
    assert set(_counters(tenant, bare)) == {("tenant", Unit.MICROS)}


def test_a_project_may_have_a_pace_while_its_tenant_has_none() -> None:
    tenant = _tenant("free", pace_share_percent=-1)
    project = create_project(tenant, "web", actor="test", tokens_per_day=10_000,
                             pace_share_percent=30)
    assert {k: c.limit for k, c in _counters(tenant, project).items()} == {
        ("project", Unit.TOKENS): 3_000}


@pytest.mark.parametrize("fields", [
    {"pace_share_percent": 0}, {"pace_share_percent": 101}, {"pace_share_percent": -2},
    {"pace_spend_micros": 0}, {"pace_period_seconds": 7}, {"pace_cooldown_seconds": 0},
    {"pace_cooldown_seconds": 86_401},
])
def test_bad_tenant_overrides_are_refused(fields: dict[str, int]) -> None:
    tenant = _tenant("free")
    with pytest.raises(ValidationError) as error:
        set_tenant_limits(tenant, actor="test", **fields)
    assert set(error.value.error_dict) == set(fields)


@pytest.mark.parametrize("fields", [
    {"pace_share_percent": 0}, {"pace_share_percent": -1}, {"pace_spend_micros": 0},
    {"pace_period_seconds": 7}, {"pace_cooldown_seconds": 0},
])
def test_bad_plan_rules_are_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ValidationError):
        update_plan(Plan.objects.get(name="standard"), actor="test", **fields)


def test_a_cool_down_is_at_most_3600_periods_on_a_plan_and_for_a_tenant() -> None:
    # A trip closes each period of its cool-down in one script call: bounded.
    plan = Plan.objects.get(name="standard")
    with pytest.raises(ValidationError) as error:
        update_plan(plan, actor="test", pace_period_seconds=1, pace_cooldown_seconds=3_601)
    assert set(error.value.error_dict) == {"pace_cooldown_seconds"}
    update_plan(plan, actor="test", pace_period_seconds=1, pace_cooldown_seconds=3_600)
    tenant = _tenant("enterprise")  # 600-second periods, 1,800 s cool-down
    set_tenant_limits(tenant, actor="test", pace_cooldown_seconds=86_400)
    with pytest.raises(ValidationError) as error:
        set_tenant_limits(tenant, actor="test", pace_period_seconds=10)  # 8,640 periods
    assert set(error.value.error_dict) == {"pace_cooldown_seconds"}


def test_bad_project_and_key_paces_are_refused_and_the_database_agrees() -> None:
    tenant = _tenant("free")
    project = create_project(tenant, "web", actor="test")
    with pytest.raises(ValidationError):
        update_project(project, actor="test", pace_share_percent=0)
    api_key = issue_key(project, actor="test").api_key
    with pytest.raises(ValidationError):
        update_key(api_key, actor="test", pace_spend_micros=0)
    with transaction.atomic(), pytest.raises(IntegrityError):
        Project.objects.filter(pk=project.pk).update(pace_share_percent=101)


def test_pace_changes_are_audited() -> None:
    tenant = _tenant("free")
    project = create_project(tenant, "web", actor="test")
    update_project(project, actor="user:alice", pace_share_percent=40)
    set_tenant_limits(tenant, actor="user:alice", pace_cooldown_seconds=600)
    actions = list(AuditEvent.objects.filter(tenant=tenant, actor="user:alice")
                   .order_by("id").values_list("action", "data"))
    assert [a for a, _ in actions] == ["project.updated", "tenant.limits_changed"]
    assert "pace_share_percent" in json.dumps(actions[0][1])
    assert "pace_cooldown_seconds" in json.dumps(actions[1][1])


def test_the_admin_edits_a_keys_pace_through_the_service(world: Any) -> None:
    from django.contrib import admin

    world.operator.is_superuser = True
    world.operator.save()
    client = Client()
    client.force_login(world.operator)
    key = world.issued.api_key
    request = RequestFactory().get("/")
    request.user = world.operator
    form = admin.site._registry[type(key)].get_form(request, key)
    assert {"pace_share_percent", "pace_spend_micros"} <= set(form.base_fields)
    data = {}
    for name in form.base_fields:
        value = getattr(key, name)
        data[name] = (json.dumps(value) if isinstance(value, list) else
                      value.pk if hasattr(value, "pk") else "" if value is None else value)
    data.update({"pace_share_percent": 33, "secrets-TOTAL_FORMS": "0",
                 "secrets-INITIAL_FORMS": "0"})
    response = client.post(f"/admin/tenants/apikey/{key.pk}/change/", data)
    assert response.status_code == 302, response.content[:2000]
    key.refresh_from_db()
    assert key.pace_share_percent == 33
    assert AuditEvent.objects.filter(action="key.updated", target=key.public_id).exists()
