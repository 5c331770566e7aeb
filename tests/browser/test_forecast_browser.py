"""The forecast on the console dashboard, in Chromium at laptop and phone width: the tenant's
day gauge carries a dashed forecast mark with its words, and the day chart draws the usage so
far and a dashed forecast line to the window's end; the page fits both widths."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import LAPTOP, PHONE, MakeAccount, check_layout, log_in, shoot
from tests.gateway.conftest import committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def _busy_day(django_db_blocker: Any, tenant_public_id: str) -> None:
    """A 100,000-token day, 40,000 used, and the last five hours at 4,000 tokens an hour in the
    ledger: the forecast runs past the limit."""
    from datetime import UTC, datetime, timedelta

    from billing.models import UsageRecord
    from billing.rollups import insert_records  # rows and rollup, as the drain writes
    from quotas.engine import ReserveRequest
    from quotas.keys import tenant_tag
    from quotas.limits import request_limits
    from quotas.runtime import get_engine
    from tenants.models import Tenant
    from tenants.selectors import effective_limits
    from tenants.services import create_project, issue_key, set_tenant_limits

    def setup() -> tuple[int, Any]:
        tenant = Tenant.objects.get(public_id=tenant_public_id)
        set_tenant_limits(tenant, actor="test", tokens_per_day=100_000)
        tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
        project = create_project(tenant, "web", actor="test")
        api_key = issue_key(project, actor="test", name="ci").api_key
        now = datetime.now(UTC)
        insert_records([UsageRecord(
            request_id=f"{tenant_public_id}-{i}", tenant=tenant, project=project,
            api_key=api_key, model="gpt-4o", served_model="gpt-4o", input_tokens=400,
            output_tokens=0, cost_micros=0, status=UsageRecord.Status.SETTLED,
            started_at=now - timedelta(minutes=6 * i + 1),
            ended_at=now - timedelta(minutes=6 * i + 1)) for i in range(50)])
        return tenant.pk, request_limits(tenant, effective_limits(tenant), project, api_key,
                                         "gpt-4o")

    tenant_id, limits = committed(django_db_blocker, setup)
    engine = get_engine()
    held = engine.reserve(ReserveRequest(tenant_tag(tenant_id), "busy-day", 40_000, limits))
    assert held.admitted
    engine.settle(held.hold, 40_000)


def test_the_dashboard_draws_the_forecast_dashed_at_laptop_and_phone_width(
    new_page: Callable[..., Any], make_account: MakeAccount, django_db_blocker: Any
) -> None:
    owner = make_account("owner")
    _busy_day(django_db_blocker, owner.tenant_id)
    page = new_page()
    log_in(page, owner)
    page.goto(f"/console/t/{owner.tenant_id}/")
    card = page.locator('.gauge-card[data-scope="tenant"] .gauge[data-window="day"]')
    mark = card.get_by_test_id("forecast-mark")
    expect(mark).to_be_attached()
    expect(card.get_by_test_id("forecast-text")).to_contain_text("Forecast")
    expect(card.get_by_test_id("forecast-text")).to_contain_text("of the limit")
    style = mark.evaluate("el => { const s = getComputedStyle(el); return "
                          "[s.borderLeftStyle, s.position, el.getBoundingClientRect().height] }")
    assert style[0] == "dashed" and style[1] == "absolute" and style[2] > 12
    chart = page.locator('[data-testid="forecast-chart"][data-window="day"]')
    expect(chart).to_be_visible()
    line = chart.get_by_test_id("forecast-line")
    assert line.evaluate("el => getComputedStyle(el).strokeDasharray") in ("7px, 5px", "7, 5")
    # The dashed line runs from now to the window's end: its length depends on the hour the
    # test runs (a few pixels just before midnight UTC), so check where it ends, not how long
    # it is (a fixed "> 20" failed a run at 23:28 UTC).
    xs = [float(p.split(",")[0]) for p in line.get_attribute("points").split()]
    plot_right = float(chart.get_by_test_id("forecast-limit").get_attribute("x2"))
    assert len(xs) >= 2 and xs == sorted(xs) and xs[-1] == pytest.approx(plot_right)
    assert line.evaluate("el => el.getTotalLength()") >= xs[-1] - xs[0] > 0
    assert chart.get_by_test_id("forecast-used").evaluate("el => el.getTotalLength()") > 20
    for viewport in (LAPTOP, PHONE):
        page.set_viewport_size(viewport)
        check_layout(page)
        expect(mark).to_be_visible()
        box = mark.bounding_box()
        bar = card.locator(".bar").bounding_box()
        # The mark stands on the bar, within it (the forecast's share of the limit).
        assert bar["x"] - 2 <= box["x"] <= bar["x"] + bar["width"] + 2
        chart.scroll_into_view_if_needed()
        # A narrow screen scrolls the chart sideways, opened on its right end: the dashed
        # forecast is in view without scrolling.
        seen = chart.locator(".chart-scroll").bounding_box()
        dashed = line.bounding_box()
        assert dashed["x"] + dashed["width"] <= seen["x"] + seen["width"] + 1
        assert dashed["x"] + dashed["width"] > seen["x"] + 20
        shoot(page, "dashboard-forecast")
