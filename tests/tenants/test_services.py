from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from tenants.exceptions import SlugTaken, UnknownPlan
from tenants.models import UNLIMITED, ApiKey, AuditEvent, Project, Tenant
from tenants.services import (
    IssuedKey,
    change_plan,
    create_project,
    create_tenant,
    issue_key,
    record_audit_event,
    revoke_key,
    rotate_key,
    set_tenant_limits,
    set_tenant_status,
)

pytestmark = pytest.mark.django_db


def _only_new_event(before: set[int]) -> AuditEvent:
    new = list(AuditEvent.objects.exclude(pk__in=before))
    assert len(new) == 1, [e.action for e in new]
    return new[0]


def _event_ids() -> set[int]:
    return set(AuditEvent.objects.values_list("pk", flat=True))


def test_create_tenant_writes_one_event() -> None:
    tenant = create_tenant("globex", plan_name="free", actor="user:alice", tokens_per_day=1000)
    event = AuditEvent.objects.get()
    assert (event.action, event.actor, event.target) == (
        "tenant.created",
        "user:alice",
        tenant.public_id,
    )
    assert event.tenant == tenant
    assert event.data["plan"] == "free"
    assert event.data["overrides"] == {"tokens_per_day": 1000}
    assert tenant.public_id.startswith("ten_") and len(tenant.public_id) == 20
    assert tenant.name == "globex"
    assert tenant.alert_thresholds == [10, 5]
    assert tenant.status == Tenant.Status.ACTIVE


Service = Callable[[Tenant, Project, IssuedKey], Any]
Target = Callable[[Tenant, IssuedKey, Any], str]
_tenant_target: Target = lambda t, k, result: t.public_id  # noqa: E731
_key_target: Target = lambda t, k, result: k.api_key.public_id  # noqa: E731


@pytest.mark.parametrize(
    ("call", "action", "target"),
    [
        (
            lambda t, p, k: create_project(t, "api", actor="user:bob"),
            "project.created",
            lambda t, k, result: result.public_id,
        ),
        (
            lambda t, p, k: issue_key(p, actor="user:bob"),
            "key.issued",
            lambda t, k, result: result.api_key.public_id,
        ),
        (lambda t, p, k: rotate_key(k.api_key, actor="user:bob"), "key.rotated", _key_target),
        (lambda t, p, k: revoke_key(k.api_key, actor="user:bob"), "key.revoked", _key_target),
        (
            lambda t, p, k: change_plan(t, "enterprise", actor="user:bob"),
            "tenant.plan_changed",
            _tenant_target,
        ),
        (
            lambda t, p, k: set_tenant_limits(t, actor="user:bob", tokens_per_day=7),
            "tenant.limits_changed",
            _tenant_target,
        ),
        (
            lambda t, p, k: set_tenant_status(t, "suspended", actor="user:bob"),
            "tenant.status_changed",
            _tenant_target,
        ),
    ],
)
def test_every_service_writes_exactly_one_event(
    tenant: Tenant,
    project: Project,
    issued: IssuedKey,
    call: Service,
    action: str,
    target: Target,
) -> None:
    before = _event_ids()
    result = call(tenant, project, issued)
    event = _only_new_event(before)
    assert event.action == action
    assert event.actor == "user:bob"
    assert event.tenant_id == tenant.pk
    assert event.target == target(tenant, issued, result)


def test_event_data_describes_the_change(tenant: Tenant, issued: IssuedKey) -> None:
    before = _event_ids()
    change_plan(tenant, "free", actor="cli")
    # The free plan resets daily: the move changes the tenant's cycle too, and says when the
    # daily cycle takes over (at once here: the tenant never called, quotas.cycles).
    data = _only_new_event(before).data
    assert {k: data[k] for k in ("from", "to")} == {"from": "standard", "to": "free"}
    assert tenant.cycle_changes_at is not None
    assert data["cycle_changes_at"] == tenant.cycle_changes_at.isoformat(timespec="seconds")

    before = _event_ids()
    set_tenant_limits(tenant, actor="cli", tokens_per_day=UNLIMITED, requests_per_second=None)
    assert _only_new_event(before).data == {"changes": {"tokens_per_day": {"from": None, "to": -1}}}

    before = _event_ids()
    rotated = rotate_key(issued.api_key, actor="cli", grace_seconds=30)
    data = _only_new_event(before).data
    assert data["masked"] == rotated.masked
    assert data["grace_seconds"] == 30
    assert data["previous_secrets"] == 1


def test_no_op_changes_write_no_event(tenant: Tenant) -> None:
    before = _event_ids()
    change_plan(tenant, "standard", actor="cli")
    set_tenant_status(tenant, "active", actor="cli")
    set_tenant_limits(tenant, actor="cli", tokens_per_day=None)
    assert _event_ids() == before


def test_services_update_the_instance_they_are_given(tenant: Tenant) -> None:
    change_plan(tenant, "enterprise", actor="cli")
    set_tenant_limits(tenant, actor="cli", requests_per_second=3, alert_thresholds=[20])
    set_tenant_status(tenant, "suspended", actor="cli")
    assert (tenant.plan.name, tenant.requests_per_second, tenant.status) == (
        "enterprise",
        3,
        "suspended",
    )
    stored = Tenant.objects.get(pk=tenant.pk)
    assert (stored.plan.name, stored.requests_per_second, stored.status) == (
        "enterprise",
        3,
        "suspended",
    )
    assert stored.alert_thresholds == [20]


def test_unknown_plan_is_refused() -> None:
    with pytest.raises(UnknownPlan, match="platinum"):
        create_tenant("initech", plan_name="platinum", actor="cli")
    assert not Tenant.objects.exists()
    assert not AuditEvent.objects.exists()


def test_change_to_unknown_plan_is_refused(tenant: Tenant) -> None:
    with pytest.raises(UnknownPlan):
        change_plan(tenant, "platinum", actor="cli")
    assert Tenant.objects.get(pk=tenant.pk).plan.name == "standard"


def test_duplicate_tenant_slug_is_refused(tenant: Tenant) -> None:
    with pytest.raises(SlugTaken, match="acme"):
        create_tenant("acme", plan_name="free", actor="cli")
    assert Tenant.objects.count() == 1
    assert AuditEvent.objects.filter(action="tenant.created").count() == 1


def test_project_slugs_are_unique_per_tenant_only(tenant: Tenant, project: Project) -> None:
    with pytest.raises(SlugTaken):
        create_project(tenant, "web", actor="cli")
    other = create_tenant("other", plan_name="free", actor="cli")
    assert create_project(other, "web", actor="cli").slug == "web"
    assert Project.objects.filter(slug="web").count() == 2


def test_unknown_limit_fields_are_refused(tenant: Tenant) -> None:
    with pytest.raises(ValueError, match="tokens_per_week"):
        set_tenant_limits(tenant, actor="cli", tokens_per_week=5)
    with pytest.raises(ValueError, match="plan"):
        create_tenant("x", plan_name="free", actor="cli", plan="enterprise")
    with pytest.raises(ValueError):
        set_tenant_limits(tenant, actor="cli")


def test_invalid_limit_values_are_refused(tenant: Tenant) -> None:
    with pytest.raises(ValidationError) as excinfo:
        set_tenant_limits(tenant, actor="cli", tokens_per_day=-2, monthly_token_budget=-1)
    assert set(excinfo.value.message_dict) == {"tokens_per_day", "monthly_token_budget"}
    with pytest.raises(ValidationError):
        set_tenant_limits(tenant, actor="cli", alert_thresholds=[0, 150])
    assert Tenant.objects.get(pk=tenant.pk).tokens_per_day is None
    with pytest.raises(ValidationError):
        create_tenant("Not A Slug!", plan_name="free", actor="cli")


def test_invalid_sub_limits_are_refused(tenant: Tenant, project: Project) -> None:
    with pytest.raises(ValidationError):
        create_project(tenant, "neg", actor="cli", tokens_per_day=-1)
    with pytest.raises(ValidationError):
        issue_key(project, actor="cli", max_concurrency=-1)
    with pytest.raises(ValidationError):
        issue_key(project, actor="cli", allowed_models=["gpt-4o", "gpt-4o"])
    assert not ApiKey.objects.filter(project=project).exists()


def test_unknown_status_is_refused(tenant: Tenant) -> None:
    with pytest.raises(ValueError, match="deleted"):
        set_tenant_status(tenant, "deleted", actor="cli")


def test_issue_key_stores_sub_limits_and_creator(project: Project) -> None:
    issued = issue_key(
        project,
        actor="user:carol",
        name="batch",
        tokens_per_day=100,
        tokens_per_month=2000,
        requests_per_minute=60,
        max_concurrency=4,
        allowed_models=["gpt-4o-mini"],
    )
    key = ApiKey.objects.get(pk=issued.api_key.pk)
    assert key.public_id.startswith("key_")
    assert (
        key.tokens_per_day,
        key.tokens_per_month,
        key.requests_per_minute,
        key.max_concurrency,
    ) == (
        100,
        2000,
        60,
        4,
    )
    assert key.allowed_models == ["gpt-4o-mini"]
    assert key.created_by == "user:carol"
    assert key.secrets.count() == 1


def test_an_actor_is_required() -> None:
    with pytest.raises(ValueError, match="actor"):
        record_audit_event(actor=" ", action="tenant.created", target="ten_x")
    with pytest.raises(ValueError, match="actor"):
        create_tenant("nobody", plan_name="free", actor="")
    assert not Tenant.objects.exists()


def test_audit_events_outlive_their_tenant(tenant: Tenant, project: Project) -> None:
    ids = _event_ids()
    tenant.delete()
    assert _event_ids() == ids
    assert not AuditEvent.objects.filter(tenant__isnull=False).exists()
