"""GET /api/tenants/<ten_>/usage (ledger aggregates) and /quota (live counters, refused today):
who may read, validation with field messages, filters, and a 503 when Redis is down."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from billing.models import UsageRecord
from config.api import usage_views
from gateway.refusals import count_refusal
from quotas.client import make_async_redis
from quotas.engine import QuotaStoreUnavailable, ReserveRequest
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from tenants.selectors import effective_limits
from tenants.services import create_project, issue_key, set_tenant_limits
from tests.world import World
from tests.billing.rollup_events import create_usage


def _usage(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/usage"


def _quota(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/quota"


def _record(world: World, rid: str, when: datetime, tokens: int, *, project=None, key=None,
            tenant=None, model: str = "gpt-4o") -> None:
    create_usage(
        request_id=rid, tenant=tenant or world.acme, project=project or world.web,
        api_key=key or world.issued.api_key, model=model, served_model=model,
        input_tokens=tokens, output_tokens=1, cost_micros=tokens * 10,
        status=UsageRecord.Status.SETTLED, started_at=when, ended_at=when)


@pytest.fixture
def ledger(world: World) -> World:
    now = datetime.now(UTC)
    batch = create_project(world.acme, "batch", actor="test")
    other_key = issue_key(batch, actor="test", name="nightly").api_key
    _record(world, "u1", now, 100)
    _record(world, "u2", now - timedelta(days=1), 10, model="gpt-4o-mini")
    _record(world, "u3", now, 1000, project=batch, key=other_key)
    _record(world, "u4", now - timedelta(days=40), 5)  # outside the default 30 days
    _record(world, "g1", now, 7, tenant=world.globex, project=world.app,
            key=world.other_issued.api_key)
    world.batch = batch  # type: ignore[attr-defined]
    world.nightly = other_key  # type: ignore[attr-defined]
    return world


def test_default_is_the_last_30_days_by_day_with_costs_for_the_owner(ledger: World) -> None:
    response = ledger.client(ledger.owner).get(_usage(ledger))
    assert response.status_code == 200
    body = response.json()
    today = datetime.now(UTC).date()
    assert body["to"] == today.isoformat()
    assert body["from"] == (today - timedelta(days=29)).isoformat()
    assert [(r["day"], r["requests"], r["total_tokens"]) for r in body["results"]] == [
        ((today - timedelta(days=1)).isoformat(), 1, 11), (today.isoformat(), 2, 1102)]
    assert body["results"][1]["cost_micros"] == 11000
    assert "ledger" in body["note"]


def test_group_by_and_filters(ledger: World) -> None:
    client = ledger.client(ledger.owner)
    by_model = client.get(_usage(ledger), {"group_by": "project,model"}).json()["results"]
    assert {(r["project_slug"], r["model"], r["input_tokens"]) for r in by_model} == {
        ("web", "gpt-4o", 100), ("web", "gpt-4o-mini", 10), ("batch", "gpt-4o", 1000)}
    only_batch = client.get(_usage(ledger), {"group_by": "key",
                                             "project": ledger.batch.public_id}).json()
    assert [(r["key"], r["key_name"]) for r in only_batch["results"]] == [
        (ledger.nightly.public_id, "nightly")]
    one_key = client.get(_usage(ledger), {"group_by": "model",
                                          "key": ledger.issued.api_key.public_id}).json()
    assert {r["model"] for r in one_key["results"]} == {"gpt-4o", "gpt-4o-mini"}
    old = client.get(_usage(ledger), {"from": (datetime.now(UTC) - timedelta(days=45)).date(),
                                      "to": (datetime.now(UTC) - timedelta(days=35)).date()})
    assert [r["total_tokens"] for r in old.json()["results"]] == [6]


@pytest.mark.parametrize("params, field", [
    ({"from": "2026-11-30", "to": "2026-11-01"}, "from"),
    ({"from": "2024-01-01", "to": "2026-11-01"}, "to"),
    ({"from": "yesterday"}, "from"),
    ({"to": "2026-02-30"}, "to"),
    ({"group_by": "day,tenant"}, "group_by"),
    ({"group_by": ","}, "group_by"),
])
def test_bad_queries_are_400_with_field_messages(ledger: World, params: dict, field: str) -> None:
    response = ledger.client(ledger.owner).get(_usage(ledger), params)
    assert response.status_code == 400
    assert field in response.json()


def test_member_reads_usage_without_costs(ledger: World) -> None:
    response = ledger.client(ledger.member).get(_usage(ledger), {"group_by": "model"})
    assert response.status_code == 200
    rows = response.json()["results"]
    assert rows and all("cost_micros" not in r for r in rows)


def test_outsider_and_foreign_ids_get_404(ledger: World) -> None:
    assert ledger.client(ledger.outsider).get(_usage(ledger)).status_code == 404
    assert ledger.client(ledger.outsider).get(_quota(ledger)).status_code == 404
    owner = ledger.client(ledger.owner)
    assert owner.get(_usage(ledger), {"project": ledger.app.public_id}).status_code == 404
    assert owner.get(_usage(ledger),
                     {"key": ledger.other_issued.api_key.public_id}).status_code == 404
    assert ledger.client(None).get(_usage(ledger)).status_code in (401, 403)


def test_quota_shows_live_counters_holds_and_refusals(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=500)
    world.acme.refresh_from_db()
    limits = request_limits(world.acme, effective_limits(world.acme), world.web,
                            world.issued.api_key, "gpt-4o")
    get_engine().reserve(ReserveRequest(tenant=tenant_tag(world.acme.pk), request_id="q-1",
                                        amount=120, limits=limits))

    async def refuse() -> None:
        client = make_async_redis()
        await count_refusal(client, tenant_tag(world.acme.pk), "spend_budget")
        await client.aclose()

    asyncio.run(refuse())
    for user in (world.owner, world.member):
        body = world.client(user).get(_quota(world)).json()
        tenant_day = next(s for s in body["scopes"]
                          if s["scope"] == "tenant" and s["window"] == "day")
        assert (tenant_day["limit"], tenant_day["pending"], tenant_day["remaining"]) == (
            500, 120, 380)
        assert body["open_holds"] == 1
        assert body["refused_today"]["total"] == 1
        assert body["refused_today"]["by_reason"][0]["reason"] == "spend_budget"


def test_quota_is_503_when_redis_is_down(world: World, monkeypatch) -> None:
    def down(*args, **kwargs):
        raise QuotaStoreUnavailable("quota store unreachable: test")

    monkeypatch.setattr(usage_views, "quota_status", down)
    response = world.client(world.owner).get(_quota(world))
    assert response.status_code == 503 and "Redis" in response.json()["detail"]


def test_usage_includes_the_token_classes(ledger: World) -> None:
    """Cached input, cache writes and reasoning per group (parts of the input and output
    totals), for members too (they are tokens, not finance data)."""
    now = datetime.now(UTC)
    create_usage(
        request_id="claude-1", tenant=ledger.acme, project=ledger.web,
        api_key=ledger.issued.api_key, model="claude-sonnet-4-5",
        served_model="claude-sonnet-4-5", input_tokens=10_000, output_tokens=1_000,
        cached_input_tokens=6_000, cache_write_tokens=2_000, reasoning_tokens=400,
        cost_micros=30_300, status=UsageRecord.Status.SETTLED, started_at=now, ended_at=now)
    create_usage(
        request_id="claude-2", tenant=ledger.acme, project=ledger.web,
        api_key=ledger.issued.api_key, model="claude-sonnet-4-5",
        served_model="claude-sonnet-4-5", input_tokens=500, output_tokens=10,
        cached_input_tokens=500, cost_micros=165, status=UsageRecord.Status.SETTLED,
        started_at=now, ended_at=now)
    for user in (ledger.owner, ledger.member):
        rows = ledger.client(user).get(_usage(ledger), {"group_by": "model"}).json()["results"]
        by_model = {r["model"]: r for r in rows}
        claude = by_model["claude-sonnet-4-5"]
        assert (claude["requests"], claude["input_tokens"], claude["output_tokens"],
                claude["total_tokens"], claude["cached_input_tokens"],
                claude["cache_write_tokens"], claude["reasoning_tokens"]) == (
            2, 10_500, 1_010, 11_510, 6_500, 2_000, 400)
        gpt = by_model["gpt-4o"]
        assert (gpt["cached_input_tokens"], gpt["cache_write_tokens"],
                gpt["reasoning_tokens"]) == (0, 0, 0)
        assert ("cost_micros" in claude) == (user is ledger.owner)
