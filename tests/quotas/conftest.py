"""Quota engine fixtures: engines over the real standalone Redis and the real 3-node cluster.

Every test gets a fresh tenant id, so tests never share counters and need no FLUSHDB.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from quotas.engine import EngineSettings, QuotaEngine


def new_tenant() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def tenant() -> str:
    return new_tenant()


@pytest.fixture(scope="session")
def standalone(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def cluster(redis_cluster_url: str) -> Iterator[redis.RedisCluster]:
    client = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def client(request: pytest.FixtureRequest) -> redis.Redis | redis.RedisCluster:
    """The same contract tests run on a standalone server and on a Redis Cluster."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def engine(client: redis.Redis | redis.RedisCluster) -> QuotaEngine:
    return QuotaEngine(client, EngineSettings(tombstone_s=60, stale_hold_s=600, sweep_batch=50))
