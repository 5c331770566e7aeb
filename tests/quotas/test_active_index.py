"""The index of active tenants (quotas/active.py, lua/active_mark.lua, lua/active_forget.lua) on a
standalone Redis and on the 3-node cluster: marks, the shards' spread, removals that never drop
a tenant marked since, and the gateway engine's batched marks."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio

from quotas import active, keys
from quotas.engine import (
    AsyncQuotaEngine,
    EngineSettings,
    QuotaEngine,
    QuotaStoreUnavailable,
    ReserveRequest,
    ScopeLimit,
)
from quotas.windows import WindowKind
from tests.quotas.conftest import new_tenant

SHARDS = 16
LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 10**9),)


def score(client: Any, tenant: str) -> float | None:
    return client.zscore(keys.active_shard_key(active.shard_of(tenant, SHARDS)), tenant)


def server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_mark_scores_the_tenant_on_the_shards_clock_and_only_ever_raises_it(
        client: redis.Redis | redis.RedisCluster) -> None:
    tenant = new_tenant()
    before = server_ms(client)
    active.mark(client, [tenant], SHARDS)
    first = score(client, tenant)
    assert first is not None and before <= first <= server_ms(client)
    shard_key = keys.active_shard_key(active.shard_of(tenant, SHARDS))
    client.zadd(shard_key, {tenant: first + 60_000})  # a mark from a clock ahead
    active.mark(client, [tenant], SHARDS)
    assert score(client, tenant) == first + 60_000  # never lowered


def test_the_shards_are_separate_hash_tags_spread_over_the_cluster(
        cluster: redis.RedisCluster) -> None:
    slots = {cluster.keyslot(keys.active_shard_key(shard)) for shard in range(SHARDS)}
    assert len(slots) == SHARDS
    nodes = {cluster.get_node_from_key(keys.active_shard_key(shard)).name
             for shard in range(SHARDS)}
    assert len(nodes) == 3  # every master holds some: no single hot key
    # Tenants spread over every shard.
    assert {active.shard_of(new_tenant(), SHARDS) for _ in range(400)} == set(range(SHARDS))


def test_forget_removes_only_members_not_marked_within_the_idle_time(
        client: redis.Redis | redis.RedisCluster) -> None:
    old, fresh = new_tenant(), new_tenant()
    now = server_ms(client)
    for tenant, at in ((old, now - 10_000), (fresh, now)):
        client.zadd(keys.active_shard_key(active.shard_of(tenant, SHARDS)), {tenant: at})
    forget = client.register_script(active.scripts.ACTIVE_FORGET.text)
    for tenant in (old, fresh):
        removed, _ = forget(keys=[keys.active_shard_key(active.shard_of(tenant, SHARDS))],
                            args=[5_000, tenant])
        assert removed == (1 if tenant == old else 0)
    assert score(client, old) is None and score(client, fresh) is not None
    with pytest.raises(redis.ResponseError, match="job member"):
        forget(keys=[keys.active_shard_key(0)],
               args=[5_000, keys.active_walk_member("drain", SHARDS)])


def test_the_sync_engine_marks_every_operation_and_can_be_told_not_to(
        client: redis.Redis | redis.RedisCluster) -> None:
    tenant, unmarked = new_tenant(), new_tenant()
    engine = QuotaEngine(client)
    hold = engine.reserve(ReserveRequest(tenant, "r1", 10, LIMITS)).hold
    assert hold is not None and score(client, tenant) is not None
    client.zrem(keys.active_shard_key(active.shard_of(tenant, SHARDS)), tenant)
    engine.settle(hold, 5)
    assert score(client, tenant) is not None
    quiet = QuotaEngine(client, mark_active=False)
    quiet.reserve(ReserveRequest(unmarked, "r1", 10, LIMITS))
    assert score(client, unmarked) is None


def test_the_gateway_engine_marks_in_memory_and_flushes_one_call_per_shard(
        redis_url: str, redis_cluster_url: str) -> None:
    """A tenant's first reserve in a worker writes its mark before the hold (a worker killed
    before its flush leaves no hold the index does not know); its later calls only mark in
    memory, written by the flush, one script call per shard."""
    async def scenario(make: Any, sync: Any) -> None:
        aclient = make()
        if isinstance(aclient, redis.asyncio.RedisCluster):
            await aclient.initialize()
        engine = AsyncQuotaEngine(aclient, EngineSettings())
        tenants = [new_tenant() for _ in range(40)]
        for tenant in tenants:
            reservation = await engine.reserve(ReserveRequest(tenant, "r1", 10, LIMITS))
            assert reservation.admitted
            assert score(sync, tenant) is not None  # written before the reserve returned
        await engine.flush_active()
        for tenant in tenants:  # as if the sweep had forgotten them (it never does so soon)
            sync.zrem(keys.active_shard_key(active.shard_of(tenant, SHARDS)), tenant)
        for tenant in tenants:
            reservation = await engine.reserve(ReserveRequest(tenant, "r2", 10, LIMITS))
            assert reservation.admitted
        assert engine.marks.tenants == set(tenants)
        assert [score(sync, t) for t in tenants] == [None] * len(tenants)  # not yet flushed
        calls: list[list[str]] = []
        real = engine.client.register_script

        def counting(text: str) -> Any:
            script = real(text)

            async def call(keys: list[str], args: list[Any]) -> Any:
                calls.append(keys)
                return await script(keys=keys, args=args)
            return call

        engine.client.register_script = counting  # type: ignore[method-assign]
        assert await engine.flush_active() == len(tenants)
        engine.client.register_script = real  # type: ignore[method-assign]
        assert all(score(sync, t) is not None for t in tenants)
        shards_used = {active.shard_of(t, SHARDS) for t in tenants}
        assert sorted(k for [k] in calls) == sorted(keys.active_shard_key(s) for s in shards_used)
        assert engine.marks.tenants == set() and await engine.flush_active() == 0
        await aclient.aclose()

    standalone = redis.Redis.from_url(redis_url, decode_responses=True)
    asyncio.run(scenario(lambda: redis.asyncio.Redis.from_url(redis_url, decode_responses=True),
                         standalone))
    cluster = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    asyncio.run(scenario(
        lambda: redis.asyncio.RedisCluster.from_url(redis_cluster_url, decode_responses=True),
        cluster))


def test_a_tenant_not_confirmed_for_half_the_retention_is_marked_before_its_reserve(
        client: redis.Redis | redis.RedisCluster, redis_url: str,
        redis_cluster_url: str) -> None:
    """The gateway engine writes a tenant's mark before its reserve when this worker has not
    written it for half the index's retention (a mark that recent cannot have been forgotten by
    the sweep); the map of confirmed marks keeps only those of the last half-retention."""
    async def scenario() -> None:
        if isinstance(client, redis.RedisCluster):
            aclient: Any = redis.asyncio.RedisCluster.from_url(redis_cluster_url,
                                                               decode_responses=True)
            await aclient.initialize()
        else:
            aclient = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        engine = AsyncQuotaEngine(aclient, EngineSettings(active_retention_s=900))
        assert engine.marks.confirm_s == 450
        tenant, other = new_tenant(), new_tenant()
        shard_key = keys.active_shard_key(active.shard_of(tenant, SHARDS))
        await engine.reserve(ReserveRequest(tenant, "r1", 10, LIMITS))
        assert score(client, tenant) is not None and not engine.marks.unconfirmed(tenant)
        client.zrem(shard_key, tenant)
        await engine.reserve(ReserveRequest(tenant, "r2", 10, LIMITS))
        assert score(client, tenant) is None  # confirmed 0 s ago: marked in memory only
        engine.marks.confirmed[tenant] -= 451  # half the retention has passed
        assert engine.marks.unconfirmed(tenant)
        await engine.reserve(ReserveRequest(tenant, "r3", 10, LIMITS))
        assert score(client, tenant) is not None and not engine.marks.unconfirmed(tenant)
        # The map keeps the last half-retention's confirmations: an older one is dropped at
        # the next confirm (here: another tenant's first reserve).
        engine.marks.confirmed[tenant] -= 451
        await engine.reserve(ReserveRequest(other, "o1", 10, LIMITS))
        assert tenant not in engine.marks.confirmed and other in engine.marks.confirmed
        await aclient.aclose()

    asyncio.run(scenario())


def test_a_mark_that_fails_before_a_reserve_never_fails_the_call(redis_url: str) -> None:
    """The index's shard unreachable (on a cluster: another master than the tenant's slot)
    while the tenant's quota is fine: the reserve goes on, the tenant stays pending for the
    flush, and the next reserves skip the mark for a few seconds instead of each waiting for
    the same dead node."""
    async def scenario() -> None:
        aclient = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        engine = AsyncQuotaEngine(aclient, EngineSettings())
        run = engine._run
        marks_tried: list[str] = []

        async def shard_down(name: str, call_keys: list[str], args: list[Any]) -> Any:
            if name == "active_mark":
                marks_tried.append(args[0])
                raise QuotaStoreUnavailable("quota store unreachable: the shard's master")
            return await run(name, call_keys, args)

        engine._run = shard_down  # type: ignore[method-assign]
        tenants = [new_tenant() for _ in range(3)]
        for tenant in tenants:
            reservation = await engine.reserve(ReserveRequest(tenant, "r1", 10, LIMITS))
            assert reservation.admitted
        assert marks_tried == tenants[:1]  # then paused: one dead round trip, not one a call
        assert engine.marks.tenants == set(tenants)
        assert all(engine.marks.unconfirmed(t) for t in tenants)
        engine._mark_now_paused_until = 0.0  # the pause is over
        engine._run = run  # type: ignore[method-assign]
        await engine.reserve(ReserveRequest(tenants[1], "r2", 10, LIMITS))
        assert not engine.marks.unconfirmed(tenants[1])
        await aclient.aclose()

    asyncio.run(scenario())

def test_a_failed_flush_keeps_the_marks_for_the_next() -> None:
    async def scenario() -> None:
        dead = redis.asyncio.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        engine = AsyncQuotaEngine(dead, EngineSettings())
        engine.marks.add("t-a")
        engine.marks.add("t-b")
        with pytest.raises(QuotaStoreUnavailable):
            await engine.flush_active()
        assert engine.marks.tenants == {"t-a", "t-b"}
        await dead.aclose()

    asyncio.run(scenario())


class _SlowScripts:
    """The client, but its script calls wait a little first (a slow network): widens the gap
    between the removal's check of a tenant's work and the removal itself."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def register_script(self, text: str) -> Any:
        script = self._client.register_script(text)

        def call(keys: list[str], args: list[Any]) -> Any:
            time.sleep(random.uniform(0, 0.004))
            return script(keys=keys, args=args)
        return call


def test_concurrent_marks_and_removals_never_drop_a_tenant_that_has_work(
        client: redis.Redis | redis.RedisCluster) -> None:
    """Gateway-like threads give tenants work (a hold, then a usage event) and mark them
    after it, as a flush does, again a few milliseconds after each tenant fell idle; removal
    threads run the sweep's forget_idle (retention 1 s) over the index as fast as they can,
    their script calls slowed a little, so a removal that found a tenant idle lands after its
    next reserve and mark. While the work exists the tenant must stay in the index: the
    removal must not take it out (lua/active_forget.lua compares the score with the cutoff;
    a plain ZREM fails this test)."""
    settings = active.ActiveSettings(shards=SHARDS, retention_s=1, full_walk_s=3600)
    tenants = [new_tenant() for _ in range(12)]
    engine = QuotaEngine(client, mark_active=False)
    slow = _SlowScripts(client)
    stop = threading.Event()
    missing: list[str] = []
    checks = [0]
    removed = [0]
    counting = threading.Lock()
    cycles = 6

    def present(tag: str, what: str) -> None:
        checks[0] += 1
        if score(client, tag) is None:
            missing.append(f"{tag}: {what}")

    def gateway(tag: str) -> None:
        for n in range(cycles):
            hold = engine.reserve(ReserveRequest(tag, f"race-{n}", 10, LIMITS)).hold
            assert hold is not None
            active.mark(client, [tag], SHARDS)  # the flush, after the reserve
            time.sleep(0.02)  # a removal racing the mark has landed by now
            present(tag, "hold just opened")
            time.sleep(1.05)  # marked over a second ago: only the work keeps it
            present(tag, "hold open")
            engine.settle(hold, 5)  # the hold ends, its usage event waits for the drain
            time.sleep(0.02)
            present(tag, "event waiting")
            client.delete(keys.usage_stream_key(tag))  # drained: idle, removable at once
            time.sleep(random.uniform(0, 0.003))

    def remover() -> None:
        while not stop.is_set():
            indexed, _walks, now_ms = active.read_index(client, SHARDS)
            ours = tuple(i for i in indexed if i.tenant in tenants)
            run = active.Visit("sweep", False, (), ours, now_ms)
            # Counted after the pass, under a lock: `removed[0] += forget_idle(...)` reads the
            # total before the (slow) pass and writes it back after, undoing what the other
            # removers counted meanwhile (the total could end at 0 on a loaded machine).
            count = active.forget_idle(slow, run, settings)
            with counting:
                removed[0] += count

    threads = [threading.Thread(target=gateway, args=(tag,)) for tag in tenants]
    removers = [threading.Thread(target=remover) for _ in range(3)]
    for thread in removers + threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in removers:
        thread.join()
    assert missing == []
    assert checks[0] == 3 * cycles * len(tenants)
    # Removals did happen (a tenant is removable between its cycles): the removers raced.
    assert removed[0] > 0
    for tag in tenants:
        client.zrem(keys.active_shard_key(active.shard_of(tag, SHARDS)), tag)
