"""The burn-rate breaker on the console's limits page, in Chromium: a tripped project is listed
with its rule and cool-down, at laptop and phone width; an owner resumes it (audited
pace.resumed) and its calls are admitted again; a member sees it but has no Resume button."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import LAPTOP, PHONE, MakeAccount, check_layout, log_in, shoot
from tests.gateway.conftest import committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def _trip_a_project(django_db_blocker: Any, tenant_public_id: str) -> tuple[str, str]:
    """Give the tenant a pace rule and a project with a 1,000,000-token day, fill the project's
    pace counter and trip it, as the gateway does on a refusal. Returns (tag, scope)."""
    from quotas.engine import ReserveRequest
    from quotas.keys import tenant_tag
    from quotas.limits import pace_counters
    from quotas.pace import PaceBreaker
    from quotas.runtime import get_engine
    from tenants.models import Tenant
    from tenants.selectors import effective_limits
    from tenants.services import create_project, issue_key, set_tenant_limits

    def setup() -> tuple[Any, ...]:
        tenant = Tenant.objects.get(public_id=tenant_public_id)
        tenant = set_tenant_limits(tenant, actor="test", pace_share_percent=25,
                                   pace_period_seconds=600, pace_cooldown_seconds=1800)
        tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
        project = create_project(tenant, "loadtest", actor="test", tokens_per_day=1_000_000)
        api_key = issue_key(project, actor="test", name="script").api_key
        counters = pace_counters(tenant, effective_limits(tenant), project, api_key)
        return tenant.pk, [c.scope_limit for c in counters if c.kind == "project"]

    tenant_id, paced = committed(django_db_blocker, setup)
    tag = tenant_tag(tenant_id)
    engine = get_engine()
    full = engine.reserve(ReserveRequest(tag, "runaway-1", paced[0].limit, tuple(paced)))
    assert full.admitted
    refused = engine.reserve(ReserveRequest(tag, "runaway-2", 1, tuple(paced)))
    assert not refused.admitted and refused.refused.reason == "spend_rate_exceeded"
    assert PaceBreaker(engine.client).trip(tag, paced, refused.server_time_ms).first
    engine.settle(full.hold, paced[0].limit)
    return tag, paced[0].scope


def test_an_owner_resumes_a_tripped_project_from_the_limits_page(
    new_page: Callable[..., Any], make_account: MakeAccount, django_db_blocker: Any
) -> None:
    from quotas.engine import ReserveRequest
    from quotas.runtime import get_engine
    from tenants.models import AuditEvent

    owner = make_account("owner")
    member = make_account("member", tenant=owner)
    tag, scope = _trip_a_project(django_db_blocker, owner.tenant_id)

    page = new_page()
    log_in(page, owner)
    page.goto(f"/console/t/{owner.tenant_id}/limits/")
    expect(page.get_by_role("heading", name="Burn-rate breaker")).to_be_visible()
    expect(page.get_by_test_id("pace-rule")).to_contain_text("25% of its daily token limit")
    row = page.locator(f'[data-testid="pace-trip"][data-scope="{scope}"]')
    expect(row).to_contain_text("project loadtest")
    expect(row).to_contain_text("tripped")
    expect(row).to_contain_text("25% of 1,000,000 tokens a day = 250,000 tokens per 600 s")
    for viewport in (LAPTOP, PHONE):
        page.set_viewport_size(viewport)
        check_layout(page)
        shoot(page, "limits-pace-tripped")
    page.set_viewport_size(LAPTOP)

    # A member sees the trip, not the button.
    other = new_page(viewport=PHONE)
    log_in(other, member)
    other.goto(f"/console/t/{owner.tenant_id}/limits/")
    expect(other.locator(f'[data-testid="pace-trip"][data-scope="{scope}"]')).to_be_visible()
    expect(other.get_by_role("button", name="Resume")).to_have_count(0)
    check_layout(other)

    row.get_by_role("button", name="Resume").click()
    expect(page.get_by_text("Resumed project loadtest")).to_be_visible()
    expect(row).to_contain_text(f"resumed by user:{owner.username}")
    expect(page.get_by_role("button", name="Resume")).to_have_count(0)
    check_layout(page)
    shoot(page, "limits-pace-resumed")

    events = committed(django_db_blocker, lambda: list(AuditEvent.objects.filter(
        action="pace.resumed", tenant__public_id=owner.tenant_id).values_list("actor", "data")))
    assert [(actor, data["scope"]) for actor, data in events] == [
        (f"user:{owner.username}", scope)]
    # The scope admits calls again: a whole period's share from the resume.
    engine = get_engine()
    paced_limit = 250_000
    from quotas.pace import PaceLimit
    from quotas.windows import WindowKind

    again = engine.reserve(ReserveRequest(tag, "after-resume", paced_limit, (
        PaceLimit(scope, WindowKind.PACE_10M, paced_limit),)))
    assert again.admitted
    engine.release(again.hold)
