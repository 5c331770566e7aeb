"""The console dashboard: live gauges, the 30-day chart, open holds, refused requests, alerts;
for the owner and the member, a 404 for an outsider, and a page that survives Redis being down."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, date, datetime, timedelta

import pytest
from django.test import Client
from django.urls import reverse

from billing import dashboard
from config.console.charts import nice_ceiling, short, stacked_by_model
from billing.models import AlertState, UsageRecord, WebhookDelivery, WebhookEndpoint
from gateway.refusals import count_refusal
from quotas.client import make_async_redis
from quotas.engine import QuotaStoreUnavailable, ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from quotas.status import refused_today
from tenants.selectors import effective_limits
from tenants.services import set_tenant_limits
from tests.world import World
from tests.billing.rollup_events import create_usage


def _page(world: World, user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def _url(world: World) -> str:
    return reverse("console-dashboard", args=[world.acme.public_id])


def _reserve(world: World, request_id: str, amount: int):
    limits = request_limits(world.acme, effective_limits(world.acme), world.web,
                            world.issued.api_key, "gpt-4o")
    return get_engine().reserve(ReserveRequest(
        tenant=tenant_tag(world.acme.pk), request_id=request_id, amount=amount, limits=limits))


def _record(world: World, rid: str, when: datetime, model: str, tokens: int) -> None:
    create_usage(
        request_id=rid, tenant=world.acme, project=world.web, api_key=world.issued.api_key,
        model=model, served_model=model, input_tokens=tokens, output_tokens=0,
        cost_micros=tokens, status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)


def _count(world: World, reason: str, times: int = 1) -> None:
    async def run() -> None:
        client = make_async_redis()
        for _ in range(times):
            await count_refusal(client, tenant_tag(world.acme.pk), reason)
        await client.aclose()

    asyncio.run(run())


def test_owner_sees_live_gauges_holds_and_refusals(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    world.web.tokens_per_day = 400
    world.web.save(update_fields=["tokens_per_day"])
    settled = _reserve(world, "dash-1", 300)
    get_engine().settle(settled.hold, 250)
    _reserve(world, "dash-2", 50)  # left open: a hold in flight
    _count(world, "quota_tenant", 3)
    _count(world, "rate_limit")

    response = _page(world, world.owner).get(_url(world))
    assert response.status_code == 200
    html = response.content.decode()
    # Tenant day gauge: 250 used + 50 held of 1000, a bar; the project's own 400 too.
    tenant_card = re.search(r'data-scope="tenant".*?</div>\s*</div>\s*</div>', html, re.S).group(0)
    assert "<strong>250</strong> + 50 held of 1,000 tokens · 700 left" in tenant_card
    assert 'aria-valuenow="30"' in tenant_card
    project_card = html[html.index(f'data-ref="{world.web.public_id}"'):]
    assert "of 400 tokens · 100 left" in project_card
    # The month has no limit on the project: usage without a bar.
    assert "tokens · no limit" in project_card
    assert re.search(r'data-testid="open-holds">1<', html)
    assert re.search(r'data-testid="refused-total">4<', html)
    assert 'data-reason="quota_tenant"' in html and "Tenant token quota used up" in html
    assert ">3</td>" in html


def test_chart_is_an_svg_picture_stacked_by_model(world: World) -> None:
    now = datetime.now(UTC)
    _record(world, "c1", now, "gpt-4o", 1200)
    _record(world, "c2", now, "gpt-4o-mini", 300)
    _record(world, "c3", now - timedelta(days=3), "gpt-4o", 500)
    _record(world, "c4", now - timedelta(days=45), "gpt-4o", 9999)  # older than 30 days

    html = _page(world, world.member).get(_url(world)).content.decode()
    svg = html[html.index("<svg"):html.index("</svg>")]
    assert 'role="img"' in svg and "2,000 tokens in all" in svg
    assert svg.count("<rect") == 3
    assert f"{now.date().isoformat()} · gpt-4o: 1,200 tokens (day total 1,500)" in svg
    assert "9,999" not in svg
    assert "gpt-4o-mini" in html[html.index('class="legend"'):]


def test_stacked_chart_geometry_and_other_models() -> None:
    day = date(2026, 11, 30)
    rows = [{"day": day.isoformat(), "model": f"m{i}", "total_tokens": 100 * (i + 1)}
            for i in range(9)]
    chart = stacked_by_model(rows, day - timedelta(days=29), day)
    assert [item.name for item in chart.legend][-1] == "other models"
    assert len(chart.legend) == 7 and chart.total == 4500
    # The day's stack reaches exactly the top of the axis (nice ceiling 5000 -> 90 %).
    tops = min(s.y for s in chart.segments)
    assert abs((chart.plot_bottom - tops) / (chart.plot_bottom - chart.plot_top) - 0.9) < 0.01
    assert nice_ceiling(4500) == 5000 and nice_ceiling(1) == 1 and nice_ceiling(0) == 1
    assert short(1_250_000) == "1.2M" and short(2000) == "2k" and short(999) == "999"
    assert chart.x_ticks[-1].label == "Nov 30"


def test_recent_alerts_and_deliveries_are_listed(world: World) -> None:
    AlertState.objects.create(tenant=world.acme, scope="tenant", window="d2026-11-30",
                              threshold=10)
    AlertState.objects.create(tenant=world.acme, scope=f"project:{world.web.pk}",
                              window="m2026-11", threshold=0)
    AlertState.objects.create(tenant=world.globex, scope="tenant", window="d2026-11-30",
                              threshold=25)
    endpoint = WebhookEndpoint.objects.create(tenant=world.acme, url="https://hooks.example/a",
                                              secret_encrypted="x", events=["quota.threshold"])
    WebhookDelivery.objects.create(endpoint=endpoint, event_type="quota.threshold", payload={})

    html = _page(world, world.owner).get(_url(world)).content.decode()
    assert "10% or less left" in html and "day 2026-11-30" in html
    assert "Project web" in html and "exhausted" in html and "month 2026-11" in html
    assert "25%" not in html  # globex's alert
    assert "hooks.example/a" in html and "quota.threshold" in html


def test_redis_down_still_renders_with_a_notice(world: World, monkeypatch) -> None:
    def down(*args, **kwargs):
        raise QuotaStoreUnavailable("quota store unreachable: test")

    monkeypatch.setattr(dashboard, "quota_status", down)
    response = _page(world, world.owner).get(_url(world))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Live counters unavailable" in html and "<svg" in html
    assert "open-holds" not in html


def test_refused_today_reads_only_this_tenants_day(world: World) -> None:
    _count(world, "concurrency", 2)
    assert [(r.reason, r.count) for r in refused_today(world.acme)] == [("concurrency", 2)]
    assert refused_today(world.globex) == []
    tomorrow = datetime.now(UTC).timestamp() + 86400
    assert refused_today(world.acme, now_s=tomorrow) == []


@pytest.mark.parametrize("who, status", [("member", 200), ("outsider", 404), ("operator", 200)])
def test_who_may_see_the_dashboard(world: World, who: str, status: int) -> None:
    assert _page(world, getattr(world, who)).get(_url(world)).status_code == status


def test_anonymous_is_sent_to_login(world: World) -> None:
    response = _page(world, None).get(_url(world))
    assert response.status_code == 302 and "/console/login/" in response["Location"]


def test_project_month_without_a_monthly_limit_reads_the_ledger(world: World) -> None:
    # With no monthly limit there is no live month counter for the project (quotas/limits.py):
    # the gauge must show the ledger's figure, not a zero.
    settled = _reserve(world, "dash-month-1", 100)
    get_engine().settle(settled.hold, 80)
    _record(world, "dash-month-ledger", datetime.now(UTC), "gpt-4o", 80)

    html = _page(world, world.owner).get(_url(world)).content.decode()
    project_card = html[html.index(f'data-ref="{world.web.public_id}"'):]
    month = project_card[project_card.index('data-window="month"'):]
    assert "<strong>80</strong> tokens · no limit" in month[:400]
    assert "(ledger)" in month[:400]

    # With a monthly limit the live counter is used.
    world.web.tokens_per_month = 10_000
    world.web.save(update_fields=["tokens_per_month"])
    html = _page(world, world.owner).get(_url(world)).content.decode()
    project_card = html[html.index(f'data-ref="{world.web.public_id}"'):]
    month = project_card[project_card.index('data-window="month"'):]
    assert "of 10,000 tokens" in month[:400] and "(ledger)" not in month[:400]
