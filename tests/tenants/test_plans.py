from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError

from tenants.models import UNLIMITED, OverQuotaPolicy, Plan


@pytest.mark.django_db
def test_the_three_plans_are_seeded() -> None:
    assert set(Plan.objects.values_list("name", flat=True)) >= {"free", "standard", "enterprise"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("name", "tokens_per_day", "rps", "policy", "timeout", "priority"),
    [
        ("free", 500_000, 5, OverQuotaPolicy.REJECT, 0, 0),
        ("standard", 5_000_000, 50, OverQuotaPolicy.QUEUE, 10, 10),
        ("enterprise", 50_000_000, 500, OverQuotaPolicy.QUEUE, 30, 20),
    ],
)
def test_seeded_plan_limits(
    name: str, tokens_per_day: int, rps: int, policy: str, timeout: int, priority: int
) -> None:
    plan = Plan.objects.get(name=name)
    assert plan.tokens_per_day == tokens_per_day
    assert plan.requests_per_second == rps
    assert plan.over_quota_policy == policy
    assert plan.queue_timeout_seconds == timeout
    assert plan.queue_priority == priority
    assert plan.safety_factor == Decimal("1.25")
    assert plan.tokens_per_minute == UNLIMITED
    assert plan.allowed_models == []
    assert plan.soft_limit_percent == 100
    assert plan.shrink_hold_to_headroom is True


@pytest.mark.django_db
def test_enterprise_is_served_before_standard() -> None:
    priorities = dict(Plan.objects.values_list("name", "queue_priority"))
    assert priorities["enterprise"] > priorities["standard"] > priorities["free"]


@pytest.mark.django_db
def test_plan_validation() -> None:
    plan = Plan(name="custom", display_name="Custom", tokens_per_day=-2, requests_per_second=1)
    with pytest.raises(ValidationError) as excinfo:
        plan.full_clean()
    assert "tokens_per_day" in excinfo.value.message_dict

    plan = Plan(
        name="cheap",
        display_name="Cheap",
        tokens_per_day=0,
        requests_per_second=1,
        over_quota_policy=OverQuotaPolicy.FALLBACK,
        safety_factor=Decimal("0.9"),
        soft_limit_percent=50,
        allowed_models="gpt-4o",
    )
    with pytest.raises(ValidationError) as excinfo:
        plan.full_clean()
    assert set(excinfo.value.message_dict) == {
        "fallback_model",
        "safety_factor",
        "soft_limit_percent",
        "allowed_models",
    }


@pytest.mark.django_db
def test_zero_and_unlimited_are_both_valid_plan_limits() -> None:
    plan = Plan(name="odd", display_name="Odd", tokens_per_day=0, requests_per_second=UNLIMITED)
    plan.full_clean()
    plan.save()
    assert Plan.objects.get(name="odd").tokens_per_day == 0


@pytest.mark.django_db
def test_database_refuses_limits_below_unlimited() -> None:
    with pytest.raises(IntegrityError):
        Plan.objects.create(
            name="broken", display_name="Broken", tokens_per_day=-5, requests_per_second=1
        )
