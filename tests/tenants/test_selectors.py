from __future__ import annotations

from decimal import Decimal

import pytest

from tenants.exceptions import ApiKeyNotFound, ProjectNotFound, TenantNotFound
from tenants.models import UNLIMITED, Plan, Project, Tenant
from tenants.selectors import (
    allowed_models_for_key,
    api_key_by_public_id,
    effective_limits,
    masked_key,
    project_by_slug,
    tenant_by_slug,
)
from tenants.services import IssuedKey, create_tenant, issue_key, revoke_key, set_tenant_limits

pytestmark = pytest.mark.django_db


def test_effective_limits_without_overrides_are_the_plan() -> None:
    tenant = create_tenant("plain", plan_name="enterprise", actor="test")
    limits = effective_limits(tenant)
    assert limits.plan_name == "enterprise"
    assert limits.tokens_per_day == 50_000_000
    assert limits.requests_per_second == 500
    assert limits.tokens_per_minute == UNLIMITED
    assert limits.monthly_token_budget == UNLIMITED
    assert limits.monthly_spend_budget_micros == UNLIMITED
    assert limits.over_quota_policy == "queue"
    assert limits.queue_timeout_seconds == 30
    assert limits.queue_priority == 20
    assert limits.safety_factor == Decimal("1.25")
    assert limits.allowed_models == ()


def test_overrides_win_over_the_plan_including_zero_and_unlimited() -> None:
    tenant = create_tenant(
        "custom",
        plan_name="free",
        actor="test",
        tokens_per_day=0,
        tokens_per_minute=1_000,
        requests_per_second=UNLIMITED,
        monthly_token_budget=9_000_000,
        monthly_spend_budget_micros=25_000_000,
    )
    limits = effective_limits(tenant)
    assert limits.tokens_per_day == 0
    assert limits.tokens_per_minute == 1_000
    assert limits.requests_per_second == UNLIMITED
    assert limits.monthly_token_budget == 9_000_000
    assert limits.monthly_spend_budget_micros == 25_000_000
    assert limits.over_quota_policy == "reject"


def test_clearing_an_override_inherits_the_plan_again(tenant: Tenant) -> None:
    set_tenant_limits(tenant, actor="test", tokens_per_day=42)
    assert effective_limits(tenant).tokens_per_day == 42
    set_tenant_limits(tenant, actor="test", tokens_per_day=None)
    assert effective_limits(tenant).tokens_per_day == 5_000_000


def test_plan_edits_reach_tenants_without_overrides(tenant: Tenant) -> None:
    Plan.objects.filter(name="standard").update(tokens_per_day=123, allowed_models=["m1"])
    limits = effective_limits(Tenant.objects.select_related("plan").get(pk=tenant.pk))
    assert limits.tokens_per_day == 123
    assert limits.allowed_models == ("m1",)


@pytest.mark.parametrize(
    ("plan_models", "key_models", "expected"),
    [
        ([], [], None),
        (["a", "b"], [], ["a", "b"]),
        ([], ["b"], ["b"]),
        (["a", "b", "c"], ["c", "b", "z"], ["c", "b"]),
        (["a"], ["z"], []),
    ],
)
def test_allowed_models_intersection(
    project: Project,
    plan_models: list[str],
    key_models: list[str],
    expected: list[str] | None,
) -> None:
    Plan.objects.filter(name="standard").update(allowed_models=plan_models)
    issued = issue_key(project, actor="test", allowed_models=key_models)
    key = api_key_by_public_id(issued.api_key.public_id)
    assert allowed_models_for_key(key) == expected


def test_masked_key_falls_back_to_newest_secret_once_revoked(issued: IssuedKey) -> None:
    assert masked_key(issued.api_key) == issued.masked
    revoke_key(issued.api_key, actor="test")
    assert masked_key(issued.api_key) == issued.masked
    assert issued.plaintext not in masked_key(issued.api_key)


def test_lookups_raise_domain_errors(tenant: Tenant) -> None:
    assert tenant_by_slug("acme") == tenant
    with pytest.raises(TenantNotFound, match="nope"):
        tenant_by_slug("nope")
    with pytest.raises(ProjectNotFound, match="nope"):
        project_by_slug(tenant, "nope")
    with pytest.raises(ApiKeyNotFound, match="key_missing"):
        api_key_by_public_id("key_missing")
