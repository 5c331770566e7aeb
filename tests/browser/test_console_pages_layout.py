"""Every console page at laptop and phone width, on a tenant with a month of usage: no sideways
scrolling, every field labelled, and the dashboard's chart drawn as a picture. The laptop-width
dashboard screenshot is the README's (docs/console-dashboard.png is a copy of it)."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.browser.conftest import LAPTOP, PHONE, MakeAccount, check_layout, log_in, shoot
from tests.gateway.conftest import committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MODELS = {"gpt-4o": 9_000, "gpt-4o-mini": 26_000, "text-embedding-3-small": 4_000}


def _seed_month(tenant_public_id: str) -> None:
    """Two projects with limits, keys, and 30 days of ledger rows for three models."""
    from billing.models import UsageRecord
    from billing.rollups import insert_records  # rows and rollup, as the drain writes
    from tenants.models import Tenant
    from tenants.services import create_project, issue_key, set_tenant_limits

    tenant = Tenant.objects.get(public_id=tenant_public_id)
    set_tenant_limits(tenant, actor="test", tokens_per_day=2_000_000,
                      monthly_token_budget=40_000_000)
    web = create_project(tenant, "web", actor="test", name="Web app", tokens_per_day=800_000)
    batch = create_project(tenant, "batch", actor="test", name="Nightly batch")
    keys = [issue_key(web, actor="test", name="production").api_key,
            issue_key(batch, actor="test", name="etl").api_key]
    now = datetime.now(UTC)
    rows = []
    for day in range(30):
        when = now - timedelta(days=day)
        for index, (model, base) in enumerate(MODELS.items()):
            tokens = base + (day * 7919 + index * 3571) % (base // 2)
            key = keys[index % 2]
            rows.append(UsageRecord(
                request_id=f"seed-{tenant_public_id}-{day}-{model}", tenant=tenant,
                project=key.project, api_key=key, model=model, served_model=model,
                input_tokens=tokens * 3 // 4, output_tokens=tokens // 4, cost_micros=tokens,
                status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when))
    insert_records(rows)
    _settle_live(tenant, [row for row in rows if row.ended_at == now])


def _settle_live(tenant: Any, today: list[Any]) -> None:
    """Today's rows through the quota engine too, so the live gauges agree with the ledger."""
    from quotas.engine import ReserveRequest
    from quotas.keys import tenant_tag
    from quotas.limits import request_limits
    from quotas.runtime import get_engine
    from tenants.selectors import effective_limits

    engine = get_engine()
    limits = effective_limits(tenant)
    for row in today:
        scopes = request_limits(tenant, limits, row.project, row.api_key, row.model)
        reservation = engine.reserve(ReserveRequest(
            tenant=tenant_tag(tenant.pk), request_id=f"live-{row.request_id}",
            amount=row.input_tokens + row.output_tokens, limits=scopes))
        engine.settle(reservation.hold, row.input_tokens + row.output_tokens)


def _nav_urls(page: Any) -> list[str]:
    return page.eval_on_selector_all("nav.sidenav a", "links => links.map(a => a.href)")


def test_every_page_fits_laptop_and_phone(make_account: MakeAccount, new_page: Any,
                                          django_db_blocker: Any) -> None:
    owner = make_account("owner", name="Acme Robotics")
    committed(django_db_blocker, lambda: _seed_month(owner.tenant_id))
    page = new_page(LAPTOP)
    log_in(page, owner)
    page.goto(f"/console/t/{owner.tenant_id}/")
    # The 30-day chart (the forecast charts of the tenant's windows are SVG pictures too).
    chart = page.locator('[aria-labelledby="chart-title"] svg[role=img]')
    assert chart.count() == 1
    assert page.locator('[data-testid="forecast-chart"] svg[role=img]').count() >= 1
    assert chart.locator("rect").count() >= 30 * len(MODELS) // 2  # bars, not an empty frame
    body = page.inner_text("body")
    assert all(model in body for model in MODELS)
    today_used = page.locator(
        '.gauge-card[data-scope="tenant"] .gauge[data-window="day"] .label strong').first
    assert int(today_used.inner_text().replace(",", "")) > 0
    shoot(page, "dashboard-populated")

    urls = _nav_urls(page)
    assert len(urls) >= 7
    for viewport in (LAPTOP, PHONE):
        page.set_viewport_size(viewport)
        for url in urls:
            page.goto(url)
            assert page.locator("h1").count() >= 1, url
            check_layout(page)
        page.goto(f"/console/t/{owner.tenant_id}/")
        shoot(page, "dashboard-populated")
