"""quotas.status (live counters for dashboards) and billing.usage (ledger aggregates)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from billing.models import UsageRecord
from billing.usage import usage_totals
from quotas.engine import ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from quotas.status import quota_status
from tenants.selectors import effective_limits
from tenants.services import set_tenant_limits
from tests.world import World
from tests.billing.rollup_events import create_usage


def _reserve(world: World, request_id: str, amount: int):
    api_key = world.issued.api_key
    limits = request_limits(world.acme, effective_limits(world.acme), world.web, api_key,
                            "gpt-4o-mini")
    return get_engine().reserve(ReserveRequest(
        tenant=tenant_tag(world.acme.pk), request_id=request_id, amount=amount, limits=limits))


def test_quota_status_reads_used_pending_and_remaining(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    world.acme.refresh_from_db()
    settled = _reserve(world, "req-status-1", 100)
    get_engine().settle(settled.hold, 60)
    held = _reserve(world, "req-status-2", 40)

    status = quota_status(world.acme)
    (tenant_day,) = status.of("tenant", "day")
    assert (tenant_day.limit, tenant_day.used, tenant_day.pending) == (1000, 60, 40)
    assert tenant_day.remaining == 900
    assert tenant_day.percent_used == 10.0
    (project_day,) = status.of("project", "day")
    assert project_day.ref == world.web.public_id and project_day.used == 60
    assert not project_day.limited and project_day.remaining == -1
    (key_day,) = status.of("key", "day")
    assert key_day.ref == world.issued.api_key.public_id and key_day.pending == 40
    assert status.open_holds == 1
    assert tenant_day.as_dict()["remaining"] == 900
    assert project_day.as_dict()["limit"] is None

    get_engine().release(held.hold)
    after = quota_status(world.acme)
    assert after.open_holds == 0 and after.of("tenant", "day")[0].pending == 0


def test_quota_status_never_shows_another_tenants_counters(world: World) -> None:
    _reserve(world, "req-status-3", 10)
    other = quota_status(world.globex)
    assert all(s.used == 0 and s.pending == 0 for s in other.scopes)
    assert {s.ref for s in other.of("project", "day")} == {world.app.public_id}


def _record(world: World, request_id: str, when: datetime, model: str, tokens: int,
            tenant=None, project=None, api_key=None) -> UsageRecord:
    return create_usage(
        request_id=request_id, tenant=tenant or world.acme, project=project or world.web,
        api_key=api_key or world.issued.api_key, model=model, served_model=model,
        input_tokens=tokens, output_tokens=tokens // 2, cost_micros=tokens * 3,
        status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)


def test_usage_totals_group_and_filter_by_dates(world: World) -> None:
    d1 = datetime(2026, 11, 1, 12, tzinfo=UTC)
    d2 = d1 + timedelta(days=1)
    _record(world, "u1", d1, "gpt-4o", 100)
    _record(world, "u2", d1, "gpt-4o-mini", 10)
    _record(world, "u3", d2, "gpt-4o", 200)
    _record(world, "u4", d2 + timedelta(days=5), "gpt-4o", 1000)  # outside the range
    _record(world, "g1", d1, "gpt-4o", 7, tenant=world.globex, project=world.app,
            api_key=world.other_issued.api_key)

    by_day = usage_totals(world.acme, date(2026, 11, 1), date(2026, 11, 2))
    assert [(r["day"], r["requests"], r["total_tokens"]) for r in by_day] == [
        ("2026-11-01", 2, 165), ("2026-11-02", 1, 300)]
    by_model = usage_totals(world.acme, date(2026, 11, 1), date(2026, 11, 2), ("model",))
    assert {r["model"]: r["input_tokens"] for r in by_model} == {"gpt-4o": 300, "gpt-4o-mini": 10}
    by_day_model = usage_totals(world.acme, date(2026, 11, 1), date(2026, 11, 2), ("day", "model"))
    assert len(by_day_model) == 3
    by_key = usage_totals(world.acme, date(2026, 11, 1), date(2026, 11, 30), ("key",))
    assert {row["key"]: row["total_tokens"] for row in by_key} == {
        world.issued.api_key.public_id: 165 + 300 + 1500}


def test_usage_totals_refuses_unknown_grouping(world: World) -> None:
    import pytest

    with pytest.raises(ValueError, match="Unknown grouping"):
        usage_totals(world.acme, date(2026, 11, 1), date(2026, 11, 2), ("tenant",))
