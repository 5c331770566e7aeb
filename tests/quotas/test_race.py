"""The race the product exists for: 1,000 concurrent reservations from 4 OS processes against a
quota that admits exactly 100, on a standalone Redis and on a 3-node Redis Cluster."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from quotas import keys
from quotas.engine import UNLIMITED, ConcurrencyLimit, QuotaEngine, RateLimit, ScopeLimit
from quotas.windows import WindowKind
from tests.quotas import race_worker

PROCESSES = 4
PER_PROCESS = 250
AMOUNT = 1000
ADMITS = 100


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_thousand_concurrent_reservations_admit_exactly_the_limit(
    request: pytest.FixtureRequest, kind: str, tenant: str
) -> None:
    url = request.getfixturevalue("redis_cluster_url" if kind == "cluster" else "redis_url")
    limits = (
        ScopeLimit("tenant", WindowKind.DAY, ADMITS * AMOUNT),
        ScopeLimit("project:p1", WindowKind.DAY, UNLIMITED),
        ScopeLimit("key:k1", WindowKind.DAY, 10 * ADMITS * AMOUNT),
        ScopeLimit("model:gpt-4o", WindowKind.DAY, UNLIMITED),
        ScopeLimit("tenant", WindowKind.MONTH, 20 * ADMITS * AMOUNT),
    )
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
            futures = [
                pool.submit(race_worker.run, url, kind == "cluster", tenant, w, PER_PROCESS,
                            AMOUNT, limits, barrier)
                for w in range(PROCESSES)
            ]
            rows = [row for f in futures for row in f.result(timeout=120)]

    assert len(rows) == PROCESSES * PER_PROCESS
    granted = [r for r in rows if r[1]]
    assert len(granted) == ADMITS
    assert all(r[2] == AMOUNT for r in granted)
    assert {r[3] for r in granted} <= {"settled", "released"}
    assert all(r[3] == "refused:quota" for r in rows if not r[1])

    settled_sum = sum(race_worker.actual_for(r[0], r[2]) for r in granted if r[3] == "settled")
    assert 0 < settled_sum < ADMITS * AMOUNT
    sync_client = request.getfixturevalue("cluster" if kind == "cluster" else "standalone")
    engine = QuotaEngine(sync_client)
    for limit in limits:
        counter = engine.counter(tenant, limit.scope, limit.window)
        assert counter.pending == 0, limit
        assert counter.used == settled_sum, limit
    assert engine.open_hold_ids(tenant) == []


def race(request: pytest.FixtureRequest, kind: str, tenant: str, **kwargs) -> list[tuple]:
    url = request.getfixturevalue("redis_cluster_url" if kind == "cluster" else "redis_url")
    limits = (ScopeLimit("tenant", WindowKind.DAY, UNLIMITED),)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
            futures = [
                pool.submit(race_worker.run, url, kind == "cluster", tenant, w, 100, 10, limits,
                            barrier, **kwargs)
                for w in range(PROCESSES)
            ]
            return [row for f in futures for row in f.result(timeout=120)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_request_rate_bucket_admits_exactly_its_capacity_under_a_race(
    request: pytest.FixtureRequest, kind: str, tenant: str
) -> None:
    # 50 requests per hour: refill during the test is far below one request.
    rows = race(request, kind, tenant, rates=(RateLimit("tenant", 50, 3_600_000),))
    assert sum(1 for r in rows if r[1]) == 50
    assert {r[3] for r in rows if not r[1]} == {"refused:rate"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_concurrency_cap_admits_exactly_the_cap_under_a_race(
    request: pytest.FixtureRequest, kind: str, tenant: str
) -> None:
    rows = race(request, kind, tenant, concurrency=ConcurrencyLimit("key:k1", 7))
    assert sum(1 for r in rows if r[1]) == 7
    assert {r[3] for r in rows if not r[1]} == {"refused:concurrency"}
    client = request.getfixturevalue("cluster" if kind == "cluster" else "standalone")
    assert client.zcard(keys.gauge_key(tenant, "key:k1")) == 0  # every slot freed at the end
