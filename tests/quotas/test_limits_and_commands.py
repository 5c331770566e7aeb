"""From PostgreSQL limits to Redis counters: scope resolution and the operators' quota commands."""
from __future__ import annotations

import json
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from quotas.engine import UNLIMITED, ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import AuditEvent, Tenant
from tenants.selectors import effective_limits
from tenants.services import (
    change_plan,
    create_project,
    create_tenant,
    issue_key,
    set_tenant_limits,
)

pytestmark = pytest.mark.django_db
DAY, MONTH = WindowKind.DAY, WindowKind.MONTH


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


def run(*args: str) -> dict:
    out = StringIO()
    call_command(*args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_scopes_follow_plan_overrides_and_sub_limits(acme: Tenant) -> None:
    project = create_project(acme, "web", actor="test", tokens_per_day=1000, tokens_per_month=20000)
    api_key = issue_key(project, actor="test", tokens_per_day=300).api_key
    set_tenant_limits(acme, actor="test", monthly_token_budget=9_000_000,
                      model_tokens_per_day={"gpt-4o": 5000})
    acme.refresh_from_db()
    scopes = {(s.scope, s.window): s.limit
              for s in request_limits(acme, effective_limits(acme), project, api_key, "gpt-4o")}
    assert scopes == {
        ("tenant", DAY): 500_000,  # the free plan
        ("tenant", MONTH): 9_000_000,
        (f"project:{project.pk}", DAY): 1000,
        (f"project:{project.pk}", MONTH): 20000,
        (f"key:{api_key.pk}", DAY): 300,
        ("model:gpt-4o", DAY): 5000,
    }
    other_model = {(s.scope, s.window): s.limit
                   for s in request_limits(acme, effective_limits(acme), project, api_key, "gpt-4o-mini")}
    assert other_model[("model:gpt-4o-mini", DAY)] == UNLIMITED
    assert (f"key:{api_key.pk}", MONTH) not in other_model  # unlimited monthly: not counted


def test_a_plan_change_takes_effect_on_the_next_reservation(acme: Tenant) -> None:
    project = create_project(acme, "web", actor="test")
    api_key = issue_key(project, actor="test").api_key
    engine = get_engine()
    tag = tenant_tag(acme.pk)

    def reserve(rid: str, amount: int) -> bool:
        limits = request_limits(acme, effective_limits(acme), project, api_key, "gpt-4o")
        return engine.reserve(ReserveRequest(tag, rid, amount, limits)).admitted

    assert reserve("a", 500_000)
    assert not reserve("b", 1)
    change_plan(acme, "standard", actor="test")
    acme.refresh_from_db()
    assert reserve("c", 4_500_000)
    assert not reserve("d", 1)


def test_quota_show_recharge_and_sweep_commands(acme: Tenant) -> None:
    project = create_project(acme, "web", actor="test", tokens_per_day=100)
    api_key = issue_key(project, actor="test").api_key
    engine = get_engine()
    tag = tenant_tag(acme.pk)
    limits = request_limits(acme, effective_limits(acme), project, api_key, "gpt-4o")
    held = engine.reserve(ReserveRequest(tag, "r1", 80, limits))
    assert held.admitted

    shown = run("quota_show", "acme")
    rows = {(r["scope"], r["window"]): r for r in shown["counters"]}
    assert rows[(f"project:{project.pk}", "day")]["pending"] == 80
    assert rows[(f"project:{project.pk}", "day")]["remaining"] == 20
    assert rows[(f"project:{project.pk}", "day")]["label"] == "web"
    assert rows[("tenant", "day")]["remaining"] == 500_000 - 80
    assert shown["open_holds"] == 1

    assert not engine.reserve(ReserveRequest(tag, "r2", 30, limits)).admitted
    recharged = run("quota_recharge", "acme", "50", "--project", "web")
    assert (recharged["credit"], recharged["remaining"]) == (50, 70)
    assert engine.reserve(ReserveRequest(tag, "r2", 30, limits)).admitted
    assert AuditEvent.objects.filter(action="quota.recharged", tenant=acme).count() == 1

    time.sleep(0.002)
    swept = run("quota_sweep", "acme", "--stale-seconds", "0")
    assert swept == {"swept": 2, "tenants": {"acme": {"swept": 2, "tokens_released": 110,
                                                      "tokens_charged": 0}}}
    assert engine.counter(tag, f"project:{project.pk}").pending == 0


@pytest.mark.parametrize(
    "args",
    [
        ("quota_show", "nope"),
        ("quota_recharge", "acme", "0"),
        ("quota_recharge", "acme", "10", "--project", "nope"),
        ("quota_sweep", "acme", "--stale-seconds", "-1"),
    ],
)
def test_quota_commands_refuse_bad_input(acme: Tenant, args: tuple[str, ...]) -> None:
    with pytest.raises(CommandError):
        call_command(*args, stdout=StringIO())
    assert not AuditEvent.objects.filter(action="quota.recharged").exists()
