"""Spending through the quota engine as the gateway does, allotment chains included, for the
tests of what the console and the API show of allotments."""
from __future__ import annotations

from typing import Any

from tenants.models import ApiKey, Project


def spend(project: Project, api_key: ApiKey, tokens: int, request_id: str) -> None:
    """A call of `tokens` with `api_key` (of `project`), reserved against the counters and the
    allotment chain its key lookup would give it, then settled at `tokens`."""
    from quotas.engine import ReserveRequest
    from quotas.keys import tenant_tag
    from quotas.limits import request_limits
    from quotas.runtime import get_engine
    from tenants.models import Tenant
    from tenants.selectors import allotment_sums, effective_limits

    tenant: Any = Tenant.objects.select_related("plan").get(pk=project.tenant_id)
    engine, tag = get_engine(), tenant_tag(tenant.pk)
    engine.set_epoch(tag)  # the tenant's data is present (no rebuild pending)
    limits = request_limits(tenant, effective_limits(tenant), project, api_key, "gpt-4o",
                            allotment_sums(project))
    reservation = engine.reserve(ReserveRequest(tag, request_id, tokens, limits))
    assert reservation.admitted, reservation
    engine.settle(reservation.hold, tokens)
