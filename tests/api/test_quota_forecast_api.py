"""GET /api/tenants/<id>/quota carries each limited tenant, project and key window's forecast
(billing/forecast.py) beside its standing counter; unlimited scopes have none."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from billing.forecast import scope_forecasts
from billing.models import UsageRecord
from quotas.engine import ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from tenants.selectors import effective_limits
from tenants.services import set_tenant_limits
from tests.world import World
from tests.billing.rollup_events import create_usage


def test_quota_lists_the_forecast_of_each_limited_scope(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=50_000)
    world.acme.refresh_from_db()
    world.web.tokens_per_day = 20_000
    world.web.save(update_fields=["tokens_per_day"])
    limits = request_limits(world.acme, effective_limits(world.acme), world.web,
                            world.issued.api_key, "gpt-4o")
    engine = get_engine()
    engine.settle(engine.reserve(ReserveRequest(tenant=tenant_tag(world.acme.pk),
                                                request_id="fq-1", amount=2_000,
                                                limits=limits)).hold, 2_000)
    now = datetime.now(UTC)
    for i in range(40):
        when = now - timedelta(minutes=6 * i + 2)
        create_usage(
            request_id=f"fq-{i}", tenant=world.acme, project=world.web,
            api_key=world.issued.api_key, model="gpt-4o", served_model="gpt-4o",
            input_tokens=60, output_tokens=0, cost_micros=0,
            status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)

    for user in (world.owner, world.member):
        body = world.client(user).get(f"/api/tenants/{world.acme.public_id}/quota").json()
        by_scope = {(s["scope"], s["window"]): s for s in body["scopes"]}
        tenant_day = by_scope["tenant", "day"]["forecast"]
        project_day = by_scope["project", "day"]["forecast"]
        assert by_scope["tenant", "month"]["forecast"] is None  # no monthly budget
        assert by_scope["key", "day"]["forecast"] is None  # the key has no limit
        expected = {(f.kind, f.window_kind.value): f.forecast for f in scope_forecasts(world.acme)}
        for got, want in ((tenant_day, expected["tenant", "day"]),
                          (project_day, expected["project", "day"])):
            assert set(got) == {"window", "window_start", "window_end", "used", "pending",
                                "limit", "credit", "forecast", "percent",
                                "would_reach_limit_at", "method", "inputs"}
            assert (got["window"], got["used"], got["limit"], got["method"]) == (
                want.window.id, 2_000, want.limit, "trailing_rate")
            assert abs(got["forecast"] - want.tokens) <= 5
            assert got["window_end"] == want.as_dict()["window_end"]
            assert got["inputs"]["trailing_hours"] == 3
        assert tenant_day["limit"] == 50_000 and project_day["limit"] == 20_000
        # 600 tokens an hour, within a row of the three hours' sum.
        assert abs(tenant_day["inputs"]["rate_per_hour"] - 600) <= 20


def test_tenant_admins_set_the_forecast_threshold_through_the_limits_api(world: World) -> None:
    from tenants.models import AuditEvent

    url = f"/api/tenants/{world.acme.public_id}/limits"
    owner = world.client(world.owner)
    assert owner.get(url).json()["forecast_threshold_percent"] == 80
    changed = owner.patch(url, {"forecast_threshold_percent": 0}, format="json")
    assert changed.status_code == 200 and changed.json()["forecast_threshold_percent"] == 0
    assert "forecast_threshold_percent" not in changed.json()["overrides"]  # not an operator's
    world.acme.refresh_from_db()
    assert world.acme.forecast_threshold_percent == 0
    event = AuditEvent.objects.filter(action="tenant.limits_changed").latest("pk")
    assert event.data["changes"]["forecast_threshold_percent"] == {"from": 80, "to": 0}

    before = AuditEvent.objects.count()
    for bad in (101, -1, "high", None):
        refused = owner.patch(url, {"forecast_threshold_percent": bad}, format="json")
        assert refused.status_code == 400 and "forecast_threshold_percent" in refused.json()
    assert world.client(world.member).patch(url, {"forecast_threshold_percent": 50},
                                            format="json").status_code == 403
    world.acme.refresh_from_db()
    assert world.acme.forecast_threshold_percent == 0 and AuditEvent.objects.count() == before
