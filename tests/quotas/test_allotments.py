"""Allotments and the shared pool in the engine (lua/lib/tiers.lua), on standalone Redis and the
3-node cluster: a call takes from its key's allotment, then its project's, then the pool; ending
a hold gives back to the pool first; the pool never lends what is allotted to others."""
from __future__ import annotations

import pytest
import redis

from quotas import keys
from quotas.allotments import allotment_standing
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.runtime import get_engine
from tenants.selectors import allotment_sums, effective_limits
from tenants.services import create_project, create_tenant, issue_key
from quotas.engine import Phase, QuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.windows import UTC_MONTHLY, Calendar, WindowKind

DAY = WindowKind.DAY
QUOTA = 100
TENANT = ScopeLimit("tenant", DAY, QUOTA)


def protected(allot: int = 60, pool: int = 40) -> tuple[ScopeLimit, ...]:
    """Project 1 has an allotment; the pool is the quota minus it."""
    return (TENANT, ScopeLimit("project:1", DAY, allot, Unit.ALLOTMENT),
            ScopeLimit("tenant", DAY, pool, Unit.POOL))


def unprotected(pool: int = 40) -> tuple[ScopeLimit, ...]:
    return (TENANT, ScopeLimit("tenant", DAY, pool, Unit.POOL))


def keyed(key_allot: int, project_part: int, pool: int) -> tuple[ScopeLimit, ...]:
    """Key 7 has an allotment inside project 1's (whose own part is what its keys do not get)."""
    return (TENANT, ScopeLimit("key:7", DAY, key_allot, Unit.ALLOTMENT),
            ScopeLimit("project:1", DAY, project_part, Unit.ALLOTMENT),
            ScopeLimit("tenant", DAY, pool, Unit.POOL))


def window_id(engine: QuotaEngine) -> str:
    return Calendar(UTC_MONTHLY).window(DAY, engine.clock.now_ms()).id


def taken(client: redis.Redis, engine: QuotaEngine, tenant: str, scope: str | None) -> int:
    wid = window_id(engine)
    key = keys.pool_key(tenant, wid) if scope is None else keys.allotment_key(tenant, scope, wid)
    return int(client.hget(key, "taken") or 0)


def reserve(engine: QuotaEngine, tenant: str, rid: str, amount: int,
            limits: tuple[ScopeLimit, ...], min_amount: int | None = None):
    return engine.reserve(ReserveRequest(tenant, rid, amount, limits, min_amount=min_amount))


def test_the_pool_lends_only_what_is_not_allotted(engine, client, tenant) -> None:
    other = reserve(engine, tenant, "b1", 40, unprotected())
    assert other.admitted
    refused = reserve(engine, tenant, "b2", 1, unprotected())
    assert not refused.admitted
    assert refused.refused.unit is Unit.POOL and refused.refused.remaining == 0
    # The tenant counter still has 60 left: they are project 1's, and project 1 gets them.
    assert engine.counter(tenant, "tenant", DAY).pending == 40
    mine = reserve(engine, tenant, "a1", 60, protected())
    assert mine.admitted and mine.granted == 60
    assert taken(client, engine, tenant, "project:1") == 60
    assert taken(client, engine, tenant, None) == 40
    assert not reserve(engine, tenant, "a2", 1, protected()).admitted


def test_a_protected_project_borrows_beyond_its_allotment(engine, client, tenant) -> None:
    hold = reserve(engine, tenant, "a", 70, protected()).hold
    assert taken(client, engine, tenant, "project:1") == 70  # 60 own, 10 borrowed
    assert taken(client, engine, tenant, None) == 10
    # The others have 30 left in the pool.
    assert reserve(engine, tenant, "b", 30, unprotected()).admitted
    assert not reserve(engine, tenant, "c", 1, unprotected()).admitted
    # Settling below the hold gives back to the pool first.
    engine.settle(hold, 55)
    assert taken(client, engine, tenant, "project:1") == 55
    assert taken(client, engine, tenant, None) == 30
    assert engine.counter(tenant, "tenant", DAY).used == 55


def test_the_chain_shrinks_a_hold_to_its_room(engine, client, tenant) -> None:
    assert reserve(engine, tenant, "b", 35, unprotected()).admitted
    result = reserve(engine, tenant, "a", 90, protected(), min_amount=10)
    assert result.admitted and result.granted == 65  # 60 allotted + 5 left in the pool
    assert taken(client, engine, tenant, None) == 40


def test_release_and_sweep_give_back_where_taken(engine, client, tenant) -> None:
    hold = reserve(engine, tenant, "a", 80, protected()).hold
    engine.release(hold)
    assert taken(client, engine, tenant, "project:1") == 0
    assert taken(client, engine, tenant, None) == 0
    stale = reserve(engine, tenant, "s", 80, protected()).hold
    engine.progress(stale, Phase.FORWARDED)
    swept = engine.sweep(tenant, stale_s=0)
    assert [s.request_id for s in swept.swept] == ["s"]
    # A forwarded call is charged its hold: 60 of its allotment and 20 borrowed, kept.
    assert taken(client, engine, tenant, "project:1") == 80
    assert taken(client, engine, tenant, None) == 20
    # Its late settle corrects to the real usage: the borrowed part goes back first.
    engine.settle(stale, 50)
    assert taken(client, engine, tenant, "project:1") == 50
    assert taken(client, engine, tenant, None) == 0
    assert engine.counter(tenant, "tenant", DAY).used == 50


def test_a_key_allotment_inside_its_projects(engine, client, tenant) -> None:
    # Project 1 is allotted 60, 20 of them to key 7: its own part is 40; the pool is 40.
    hold = reserve(engine, tenant, "k", 70, keyed(20, 40, 40)).hold
    assert taken(client, engine, tenant, "key:7") == 70
    assert taken(client, engine, tenant, "project:1") == 50  # 40 of its part, 10 borrowed
    assert taken(client, engine, tenant, None) == 10
    engine.settle(hold, 15)
    assert taken(client, engine, tenant, "key:7") == 15
    assert taken(client, engine, tenant, "project:1") == 0
    assert taken(client, engine, tenant, None) == 0


def test_an_allotment_change_moves_what_was_borrowed(engine, client, tenant) -> None:
    hold = reserve(engine, tenant, "a", 50, protected()).hold
    engine.settle(hold, 50)
    assert taken(client, engine, tenant, None) == 0
    # The allotment drops to 30 (the pool grows to 70): 20 of the 50 are now borrowed.
    assert reserve(engine, tenant, "a2", 1, protected(allot=30, pool=70)).admitted
    assert taken(client, engine, tenant, "project:1") == 51
    assert taken(client, engine, tenant, None) == 21
    assert client.hget(keys.allotment_key(tenant, "project:1", window_id(engine)), "allot") == "30"


def test_a_lost_hold_record_is_still_charged_to_the_chain(engine, client, tenant) -> None:
    hold = reserve(engine, tenant, "a", 70, protected()).hold
    client.delete(keys.hold_key(tenant, "a"))
    client.hset(keys.allotment_key(tenant, "project:1", window_id(engine)), "taken", 0)
    client.hset(keys.pool_key(tenant, window_id(engine)), "taken", 0)
    result = engine.settle(hold, 65)
    assert result.outcome == "settled"
    assert taken(client, engine, tenant, "project:1") == 65
    assert taken(client, engine, tenant, None) == 5


# -- the live picture (quotas/allotments.py) through the real services ---------------------------


@pytest.mark.django_db
def test_allotment_standing_shows_used_borrowed_and_the_pool() -> None:
    tenant = create_tenant("allotted", plan_name="standard", actor="test")
    quota = effective_limits(tenant).tokens_per_day
    web = create_project(tenant, "web", actor="test", allotment_tokens_per_day=quota // 4)
    batch = create_project(tenant, "batch", actor="test")
    mine, theirs = issue_key(web, actor="test").api_key, issue_key(batch, actor="test").api_key
    limits = effective_limits(tenant)
    engine, tag = get_engine(), tenant_tag(tenant.pk)
    engine.set_epoch(tag)
    for_web = request_limits(tenant, limits, web, mine, "gpt-4o", allotment_sums(web))
    for_batch = request_limits(tenant, limits, batch, theirs, "gpt-4o", allotment_sums(batch))
    assert [s.unit for s in for_web if s.unit.tiered] == [Unit.ALLOTMENT, Unit.POOL]
    held = engine.reserve(ReserveRequest(tag, "w1", quota // 4 + 100, for_web)).hold
    engine.settle(held, quota // 4 + 50)
    assert engine.reserve(ReserveRequest(tag, "b1", 1000, for_batch)).admitted

    standing = allotment_standing(tenant)
    (pool,) = standing.pools  # the day: the tenant has no cycle budget to allot from
    assert (pool.window, pool.quota, pool.allotted, pool.size) == (
        "day", quota, quota // 4, quota - quota // 4)
    assert (pool.borrowed, pool.left) == (1050, pool.size - 1050)
    (figures,) = standing.for_window("day")
    assert (figures.kind, figures.label, figures.allotment, figures.used, figures.borrowed) == (
        "project", "web", quota // 4, quota // 4, 50)
    assert standing.as_dict()["allotments"][0]["used_from_allotment"] == quota // 4


def test_a_recharge_of_the_tenant_credits_its_pool(engine, client, tenant) -> None:
    assert reserve(engine, tenant, "b", 40, unprotected()).admitted
    assert not reserve(engine, tenant, "c", 10, unprotected()).admitted
    engine.recharge(tenant, TENANT, 10, pool=True)
    assert client.hget(keys.pool_key(tenant, window_id(engine)), "credit") == "10"
    assert reserve(engine, tenant, "c", 10, unprotected()).admitted
    # The protected project's 60 are still there.
    assert reserve(engine, tenant, "a", 60, protected()).admitted


def test_an_allotment_made_mid_window_is_not_lent_twice(engine, client, tenant) -> None:
    # 30 used before any allotment existed in the window: they were the pool's.
    before = engine.reserve(ReserveRequest(tenant, "early", 30, (TENANT,))).hold
    engine.settle(before, 30)
    assert reserve(engine, tenant, "b", 10, unprotected()).admitted
    assert taken(client, engine, tenant, None) == 40  # seeded with the 30, then the call's 10
    assert not reserve(engine, tenant, "b2", 1, unprotected()).admitted
    assert reserve(engine, tenant, "a", 60, protected()).admitted  # the allotment is whole


# -- a change of allotments applied at once (lua/allotments_set.lua) -------------------------------


def day_window(engine: QuotaEngine):
    return Calendar(UTC_MONTHLY).window(DAY, engine.clock.now_ms())


def test_a_removed_allotment_is_not_lent_again(engine, client, tenant) -> None:
    # A allotted 40 and C 30: the pool is 30. A uses its 40, then loses its allotment.
    a_chain = (TENANT, ScopeLimit("project:1", DAY, 40, Unit.ALLOTMENT),
               ScopeLimit("tenant", DAY, 30, Unit.POOL))
    engine.settle(reserve(engine, tenant, "a1", 40, a_chain).hold, 40)
    moved = engine.set_allotments(tenant, day_window(engine),
                                  [("project:1", 0, 0), ("project:2", 30, 0)], drop_pool=False)
    assert moved == 40 and taken(client, engine, tenant, None) == 40
    pool_70 = (TENANT, ScopeLimit("tenant", DAY, 70, Unit.POOL))
    second = reserve(engine, tenant, "a2", 60, pool_70, min_amount=1)
    assert second.granted == 30  # the pool of 70 minus the 40 A took
    c_chain = (TENANT, ScopeLimit("project:2", DAY, 30, Unit.ALLOTMENT),
               ScopeLimit("tenant", DAY, 70, Unit.POOL))
    assert reserve(engine, tenant, "c1", 30, c_chain).admitted  # C's guarantee holds


def test_a_revoked_keys_allotment_moves_what_it_took(engine, client, tenant) -> None:
    quota = ScopeLimit("tenant", DAY, 200)
    k7 = (quota, ScopeLimit("key:7", DAY, 50, Unit.ALLOTMENT),
          ScopeLimit("project:1", DAY, 50, Unit.ALLOTMENT), ScopeLimit("tenant", DAY, 50, Unit.POOL))
    engine.settle(reserve(engine, tenant, "k1", 50, k7).hold, 50)
    engine.settle(reserve(engine, tenant, "b1", 50, (quota, ScopeLimit("tenant", DAY, 50,
                                                                        Unit.POOL))).hold, 50)
    # Key 7 revoked: P's own part grows to 100, and what key 7 took is now P's.
    engine.set_allotments(tenant, day_window(engine),
                          [("key:7", 0, 2), ("project:1", 100, 0), ("project:2", 50, 0)],
                          drop_pool=False)
    assert taken(client, engine, tenant, "project:1") == 50
    p8 = (quota, ScopeLimit("project:1", DAY, 100, Unit.ALLOTMENT),
          ScopeLimit("tenant", DAY, 50, Unit.POOL))
    assert reserve(engine, tenant, "k8", 100, p8, min_amount=1).granted == 50
    c = (quota, ScopeLimit("project:2", DAY, 50, Unit.ALLOTMENT),
         ScopeLimit("tenant", DAY, 50, Unit.POOL))
    assert reserve(engine, tenant, "c1", 50, c).admitted
    # Idempotent: run again, nothing moves.
    assert engine.set_allotments(tenant, day_window(engine),
                                 [("key:7", 0, 2), ("project:1", 100, 0), ("project:2", 50, 0)],
                                 drop_pool=False) == 0


def test_a_window_left_without_allotments_drops_its_pool(engine, client, tenant) -> None:
    engine.settle(reserve(engine, tenant, "a", 50, protected()).hold, 50)
    engine.set_allotments(tenant, day_window(engine), [("project:1", 0, 0)], drop_pool=True)
    assert not client.exists(keys.pool_key(tenant, window_id(engine)))
    # An allotment back in the window: the new pool starts from the tenant's 50, the tier's 50
    # count in its allotment again, so the pool holds nothing of them twice.
    assert reserve(engine, tenant, "a2", 10, protected()).admitted
    assert taken(client, engine, tenant, "project:1") == 60
    assert taken(client, engine, tenant, None) == 0


@pytest.mark.django_db
def test_the_services_apply_a_removed_allotment_at_once(django_capture_on_commit_callbacks) -> None:
    """Through the real services: A (allotted 400) uses its 400 and loses its allotment; the
    pool grows, but what A took moves into it at once, so C's allotment stays whole."""
    from tenants.services import update_project

    tenant = create_tenant("relend", plan_name="standard", actor="test", tokens_per_day=1000)
    a = create_project(tenant, "a", actor="test", allotment_tokens_per_day=400)
    c = create_project(tenant, "c", actor="test", allotment_tokens_per_day=300)
    key_a, key_c = issue_key(a, actor="test").api_key, issue_key(c, actor="test").api_key
    engine, tag = get_engine(), tenant_tag(tenant.pk)
    engine.set_epoch(tag)

    def chain(project, api_key):
        project.refresh_from_db()
        return request_limits(tenant, effective_limits(tenant), project, api_key, "gpt-4o",
                              allotment_sums(project))

    engine.settle(engine.reserve(ReserveRequest(tag, "a1", 400, chain(a, key_a))).hold, 400)
    with django_capture_on_commit_callbacks(execute=True):
        update_project(a, actor="test", allotment_tokens_per_day=None)
    second = engine.reserve(ReserveRequest(tag, "a2", 700, chain(a, key_a), min_amount=1))
    assert second.granted == 300  # the pool is 700, of which A's 400 are taken
    assert engine.reserve(ReserveRequest(tag, "c1", 300, chain(c, key_c))).admitted
