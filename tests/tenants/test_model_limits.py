from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from tenants.models import AuditEvent, Tenant
from tenants.selectors import effective_limits
from tenants.services import set_tenant_limits


@pytest.mark.django_db
def test_per_model_daily_limits_are_set_audited_and_effective(tenant: Tenant) -> None:
    set_tenant_limits(tenant, actor="cli", model_tokens_per_day={"gpt-4o": 1000, "o3": 0})
    tenant.refresh_from_db()
    assert effective_limits(tenant).model_tokens_per_day == {"gpt-4o": 1000, "o3": 0}
    event = AuditEvent.objects.get(action="tenant.limits_changed", tenant=tenant)
    assert event.data["changes"]["model_tokens_per_day"]["to"] == {"gpt-4o": 1000, "o3": 0}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "bad", [["gpt-4o"], {"gpt-4o": -1}, {"gpt-4o": 1.5}, {"gpt-4o": True}, {"": 5}, {"a b": 5}]
)
def test_malformed_model_limits_are_refused_and_nothing_changes(tenant: Tenant, bad: object) -> None:
    with pytest.raises(ValidationError):
        set_tenant_limits(tenant, actor="cli", model_tokens_per_day=bad)
    tenant.refresh_from_db()
    assert tenant.model_tokens_per_day == {}
    assert not AuditEvent.objects.filter(action="tenant.limits_changed").exists()
