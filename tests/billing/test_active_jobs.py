"""The background jobs visit the index of active tenants (quotas/active.py), not every tenant:
a tenant that reserves is drained and swept, an idle one costs no Redis call at all, and the
backstop (the jobs' full walk) finds what the index missed: a worker killed before its flush,
an index Redis lost."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from billing.models import UsageRecord
from billing.rebuild import rebuild_lost_tenants
from billing.tasks import (
    check_pending_health,
    check_quota_forecasts,
    check_quota_thresholds,
    drain_usage,
)
from quotas import active, keys, runtime
from quotas.engine import EngineSettings, QuotaEngine, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.tasks import sweep_stale_holds
from quotas.windows import WindowKind
from tenants.models import Tenant
from tenants.services import create_tenant

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
LIMITS = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
EVENT = json.dumps({"in": 30, "out": 20, "st": 200, "lat": 5, "outcome": "complete",
                    "pk": None, "stream": False, "soft": False})
META = json.dumps({"m": "gpt-4o", "served": "gpt-4o", "ep": "chat/completions"})


def tenant() -> Tenant:
    return create_tenant(f"act-{uuid.uuid4().hex[:10]}", plan_name="free", actor="test")


def indexed(client: Any, tenant_id: int) -> bool:
    tag = tenant_tag(tenant_id)
    shards = active.ActiveSettings.from_django().shards
    return client.zscore(keys.active_shard_key(active.shard_of(tag, shards)), tag) is not None


def walked_now(client: Any) -> None:
    """Every job's full walk done just now: the next runs visit the index only."""
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    for job in active.JOBS:
        active.walked(client, active.Visit(job, True, (), (), now_ms))


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def engine(request: pytest.FixtureRequest, redis_url: str,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[QuotaEngine]:
    """The jobs' engine (quotas.runtime.get_engine) over a standalone Redis or the cluster,
    holds stale after one second."""
    if request.param == "cluster":
        client: Any = redis.RedisCluster.from_url(request.getfixturevalue("redis_cluster_url"),
                                                  decode_responses=True)
    else:
        client = redis.Redis.from_url(redis_url, decode_responses=True)
    quick = dataclasses.replace(EngineSettings.from_django(), stale_hold_s=1)
    engine = QuotaEngine(client, quick)
    monkeypatch.setattr(runtime, "_engine", engine)
    walked_now(client)
    yield engine
    client.close()


def test_a_tenant_that_reserves_is_indexed_then_drained_and_swept(engine: QuotaEngine) -> None:
    acme = tenant()
    tag = tenant_tag(acme.pk)
    left = engine.reserve(ReserveRequest(tag, f"{tag}-left-open", 100, LIMITS, meta=META)).hold
    done = engine.reserve(ReserveRequest(tag, f"{tag}-done", 100, LIMITS, meta=META)).hold
    assert left is not None and done is not None
    engine.settle(done, 50, EVENT)
    assert indexed(engine.client, acme.pk)
    assert acme.pk in active.visit(engine.client, active.DRAIN).tenants

    assert drain_usage() == 1
    assert UsageRecord.objects.get(request_id=f"{tag}-done").status == "settled"
    time.sleep(1.1)  # the open hold is stale
    assert sweep_stale_holds() == 1
    assert engine.open_hold_ids(tag) == []
    assert drain_usage() == 1
    assert UsageRecord.objects.get(request_id=f"{tag}-left-open").status == "swept"
    assert indexed(engine.client, acme.pk)  # marked within the retention: kept


class _Spy:
    """The jobs' Redis client, recording every command and the keys it names (scripts and
    pipelines too); every call goes through to the real client."""

    def __init__(self, client: Any, calls: list[str]) -> None:
        self._client = client
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._client, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(f"{name} {args!r} {kwargs!r}")
            return value(*args, **kwargs)
        return call

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        return _Spy(self._client.pipeline(*args, **kwargs), self.calls)

    def register_script(self, text: str) -> Any:
        script = self._client.register_script(text)
        calls = self.calls

        def run(keys: Any = None, args: Any = None, client: Any = None) -> Any:
            calls.append(f"script {keys!r} {args!r}")
            return script(keys=keys, args=args)
        return run


def test_an_idle_tenant_costs_the_jobs_no_redis_call(redis_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    calls: list[str] = []
    spy = _Spy(client, calls)
    busy, idle = tenant(), tenant()
    busy_tag, idle_tag = tenant_tag(busy.pk), tenant_tag(idle.pk)
    setup = QuotaEngine(client)
    hold = setup.reserve(ReserveRequest(busy_tag, f"{busy_tag}-1", 100, LIMITS, meta=META)).hold
    assert hold is not None
    setup.settle(hold, 50, EVENT)
    walked_now(client)
    monkeypatch.setattr(runtime, "_engine", QuotaEngine(spy, EngineSettings.from_django()))

    assert drain_usage() == 1
    sweep_stale_holds()
    check_quota_thresholds()
    check_pending_health()
    check_quota_forecasts()
    rebuild_lost_tenants()

    def naming(tag: str) -> list[str]:
        return [c for c in calls if f"{{t{tag}}}" in c]

    assert naming(idle_tag) == []  # exactly none: never visited
    assert naming(busy_tag)  # the busy one was
    for job in active.JOBS:  # and nobody walked every tenant
        assert not active.visit(client, job).full
    client.close()


def test_a_worker_killed_before_its_flush_leaves_its_tenant_indexed_and_swept(
        engine: QuotaEngine, settings: Any, request: pytest.FixtureRequest,
        redis_url: str) -> None:
    """A gateway worker's first reserve for a tenant writes the tenant's mark before the hold
    (quotas/engine.py AsyncQuotaEngine.reserve), so a worker SIGKILLed right after it, before
    its next flush, leaves a stale hold the sweep's next run (no full walk) ends. Until
    2026-12-02 the tenant was unknown to the index until the hourly full walk, its quota held
    meanwhile. A tenant the index misses anyway (here: taken out by hand) is still found by the
    full walk, the backstop."""
    if isinstance(engine.client, redis.RedisCluster):
        url, kind = request.getfixturevalue("redis_cluster_url"), "RedisCluster"
    else:
        url, kind = redis_url, "Redis"
    acme, globex = tenant(), tenant()
    tag, other = tenant_tag(acme.pk), tenant_tag(globex.pk)
    code = f"""
import asyncio, os, signal
import redis.asyncio
from quotas.engine import AsyncQuotaEngine, EngineSettings, ReserveRequest, ScopeLimit
from quotas.windows import WindowKind

async def main():
    client = redis.asyncio.{kind}.from_url({url!r}, decode_responses=True)
    if {kind!r} == "RedisCluster":
        await client.initialize()
    engine = AsyncQuotaEngine(client, EngineSettings())
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
    for tenant, rid in (({tag!r}, "killed-1"), ({other!r}, "killed-2")):
        reservation = await engine.reserve(ReserveRequest(tenant, rid, 100, limits))
        assert reservation.admitted
    assert engine.marks.tenants == {{{tag!r}, {other!r}}}  # not flushed yet
    os.kill(os.getpid(), signal.SIGKILL)  # before the worker's next flush

asyncio.run(main())
"""
    worker = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert worker.returncode == -signal.SIGKILL, worker.stderr
    assert engine.open_hold_ids(tag) == ["killed-1"] and indexed(engine.client, acme.pk)
    assert engine.open_hold_ids(other) == ["killed-2"] and indexed(engine.client, globex.pk)
    shards = active.ActiveSettings.from_django().shards
    engine.client.zrem(keys.active_shard_key(active.shard_of(other, shards)), other)

    time.sleep(1.1)  # the holds are stale
    assert not active.visit(engine.client, active.SWEEP).full
    assert sweep_stale_holds() == 1
    assert engine.open_hold_ids(tag) == []
    assert engine.open_hold_ids(other) == ["killed-2"]  # the index does not know it
    # The sweep's full walk is due (an hour by default; a second here, and it has passed).
    settings.TOLLGATE_ACTIVE_FULL_WALK_SECONDS = 1
    assert active.visit(engine.client, active.SWEEP).why == "due"
    assert sweep_stale_holds() == 1
    assert engine.open_hold_ids(other) == []
    assert indexed(engine.client, globex.pk)  # marked again: its swept event waits for the drain
    assert drain_usage() == 2
    assert UsageRecord.objects.get(request_id="killed-1").status == "swept"
    assert UsageRecord.objects.get(request_id="killed-2").status == "swept"


def test_an_index_redis_lost_is_walked_at_once_and_rebuilt(engine: QuotaEngine) -> None:
    acme = tenant()
    tag = tenant_tag(acme.pk)
    hold = engine.reserve(ReserveRequest(tag, f"{tag}-1", 100, LIMITS, meta=META)).hold
    assert hold is not None
    engine.settle(hold, 50, EVENT)
    shards = active.ActiveSettings.from_django().shards
    for shard in range(shards):  # the index is lost (a flush, a failover behind)
        engine.client.delete(keys.active_shard_key(shard))

    run = active.visit(engine.client, active.DRAIN)
    assert run.full and run.why == "index lost" and acme.pk in run.tenants
    assert drain_usage() == 1  # found by the full walk
    assert UsageRecord.objects.get(request_id=f"{tag}-1").status == "settled"
    assert indexed(engine.client, acme.pk)  # marked again
    assert not active.visit(engine.client, active.DRAIN).full  # the walk is recorded
    # Each job notices on its own: the sweep's next run walks too.
    assert active.visit(engine.client, active.SWEEP).why == "index lost"
    sweep_stale_holds()
    assert not active.visit(engine.client, active.SWEEP).full


def test_the_backlog_reads_the_index_and_scans_redis_only_when_it_is_lost(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backlog gauges and alert (billing.ledger.usage_backlog) read the streams of the
    index's tenants, also while PostgreSQL is down; an idle tenant's stream is not read. With
    the index lost, every tenant's stream: PostgreSQL's list, or a SCAN of Redis while it is
    down."""
    from django.db import OperationalError

    from billing.ledger import usage_backlog

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    busy, idle = tenant(), tenant()
    busy_tag, idle_tag = tenant_tag(busy.pk), tenant_tag(idle.pk)
    engine = QuotaEngine(client)
    hold = engine.reserve(ReserveRequest(busy_tag, f"{busy_tag}-1", 100, LIMITS, meta=META)).hold
    assert hold is not None
    engine.settle(hold, 50, EVENT)
    walked_now(client)
    calls: list[str] = []
    spy = _Spy(client, calls)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection to server failed: Connection refused")

    for readable in (True, False):
        calls.clear()
        with monkeypatch.context() as outage:
            if not readable:
                outage.setattr(Tenant.objects, "filter", down)
                outage.setattr(Tenant.objects, "order_by", down)
            backlog = usage_backlog(spy)
        assert backlog.events >= 1
        assert any(f"{{t{busy_tag}}}" in c for c in calls)
        assert not [c for c in calls if f"{{t{idle_tag}}}" in c or c.startswith("scan_iter")]

    for shard in range(active.ActiveSettings.from_django().shards):  # the index is lost
        client.delete(keys.active_shard_key(shard))
    calls.clear()
    usage_backlog(spy)  # every tenant of PostgreSQL
    assert any(f"{{t{idle_tag}}}" in c for c in calls)
    calls.clear()
    with monkeypatch.context() as outage:
        outage.setattr(Tenant.objects, "order_by", down)
        usage_backlog(spy)  # PostgreSQL down too: Redis is scanned
    assert [c for c in calls if c.startswith("scan_iter")]
    client.delete(keys.usage_stream_key(busy_tag))
    walked_now(client)
    client.close()


def test_an_idle_tenant_whose_marker_went_is_rebuilt_by_the_full_walk(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """rebuild_lost_tenants visits the index: an idle tenant whose epoch marker is gone (and
    nothing else of its) is left to its next call, or to the job's full walk, which a lost
    index starts at once."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    monkeypatch.setattr(runtime, "_engine", QuotaEngine(client, EngineSettings.from_django()))
    idle = tenant()
    tag = tenant_tag(idle.pk)
    client.delete(keys.epoch_key(tag))
    walked_now(client)
    rebuild_lost_tenants()
    assert not client.exists(keys.epoch_key(tag))  # not visited
    for shard in range(active.ActiveSettings.from_django().shards):  # the index is lost
        client.delete(keys.active_shard_key(shard))
    assert rebuild_lost_tenants() >= 1
    assert client.exists(keys.epoch_key(tag))
    assert active.visit(client, active.REBUILD).why == ""  # the walk is recorded
    walked_now(client)
    client.close()


def test_a_new_shard_count_makes_every_job_walk_every_tenant_once(redis_url: str) -> None:
    """Tenants move between shards when TOLLGATE_ACTIVE_SHARDS changes: the full-walk members
    name the count, so none is found and every job walks (and re-marks) once."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    walked_now(client)
    now = active.ActiveSettings.from_django()
    assert not active.visit(client, active.DRAIN, now).full
    fewer = dataclasses.replace(now, shards=now.shards // 2)
    run = active.visit(client, active.DRAIN, fewer)
    assert run.full and run.why == "index lost"
    active.walked(client, run, fewer)
    assert not active.visit(client, active.DRAIN, fewer).full
    for shard in range(fewer.shards):
        client.zrem(keys.active_shard_key(shard),
                    keys.active_walk_member(active.DRAIN, fewer.shards))
    client.close()
