"""A quota Redis that may forget counters is refused (quotas/durability.py): an evicting
maxmemory-policy always, no persistence in production mode; on a cluster, every master."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from config import embedded
from quotas import durability
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(private_redis: PrivateRedis) -> Iterator[redis.Redis]:  # noqa: F811
    client = private_redis.client()
    yield client
    client.close()


def issues(client: redis.Redis, *, require_persistence: bool) -> list[str]:
    return [p.issue for p in durability.check(client, require_persistence=require_persistence)]


def test_the_embedded_servers_pass(standalone: redis.Redis, tmp_path_factory: pytest.TempPathFactory) -> None:
    # The tests' server: noeviction, no persistence (not needed outside production).
    assert durability.check(standalone, require_persistence=False) == []
    # `make up`'s server: noeviction and AOF, so it would pass in production mode too.
    folder = tmp_path_factory.mktemp("up")
    embedded.start_redis(folder, persistent=True)
    try:
        persistent = redis.Redis(unix_socket_path=str(folder / "redis.sock"), decode_responses=True)
        assert durability.check(persistent, require_persistence=True) == []
        persistent.close()
    finally:
        embedded.stop_redis(folder)


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl",
                                    "allkeys-random", "volatile-lfu"])
def test_every_evicting_policy_is_refused(server: redis.Redis, policy: str) -> None:
    server.config_set("maxmemory-policy", policy)
    found = durability.check(server, require_persistence=False)
    assert [p.issue for p in found] == [f"maxmemory-policy {policy} may evict quota counters"]
    assert "noeviction" in str(found[0])
    server.config_set("maxmemory-policy", "noeviction")
    assert durability.check(server, require_persistence=False) == []


def test_persistence_is_required_only_when_asked(server: redis.Redis) -> None:
    assert server.config_get("appendonly")["appendonly"] == "no"
    assert server.config_get("save")["save"] == ""
    assert issues(server, require_persistence=False) == []
    assert issues(server, require_persistence=True) == [
        "no persistence (appendonly no, no save points)"]
    server.config_set("save", "900 1")  # RDB snapshots count as persistence
    assert issues(server, require_persistence=True) == []
    server.config_set("save", "")
    server.config_set("appendonly", "yes")
    assert issues(server, require_persistence=True) == []


def test_a_refused_config_command_is_reported_not_guessed(server: redis.Redis) -> None:
    # A managed Redis may deny CONFIG to the application's user.
    server.acl_setuser("app", enabled=True, nopass=True, commands=["+@all", "-config"],
                       keys=["*"], channels=["*"])
    app = redis.Redis(unix_socket_path=server.connection_pool.connection_kwargs["path"],
                      username="app", decode_responses=True)
    try:
        assert issues(app, require_persistence=False) == []  # the policy comes from INFO
        assert issues(app, require_persistence=True) == [
            "AOF is off and the RDB save points cannot be read"]
    finally:
        app.close()


def test_async_check_sees_the_same(server: redis.Redis) -> None:
    url = f"unix://{server.connection_pool.connection_kwargs['path']}"

    async def run() -> list[str]:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        try:
            return [p.issue for p in await durability.acheck(client, require_persistence=True)]
        finally:
            await client.aclose()

    server.config_set("maxmemory-policy", "allkeys-lfu")
    assert asyncio.run(run()) == ["maxmemory-policy allkeys-lfu may evict quota counters",
                                  "no persistence (appendonly no, no save points)"]


@pytest.mark.cluster
def test_each_cluster_master_is_checked(cluster: redis.RedisCluster) -> None:
    masters = cluster.get_primaries()
    assert len(masters) == 3
    assert durability.check(cluster, require_persistence=False) == []
    victim = masters[1]
    cluster.config_set("maxmemory-policy", "volatile-lru", target_nodes=victim)
    try:
        found = durability.check(cluster, require_persistence=False)
        assert [(p.node, p.issue) for p in found] == [
            (victim.name, "maxmemory-policy volatile-lru may evict quota counters")]

        async def run() -> list[str]:
            client = redis.asyncio.RedisCluster(host=masters[0].host, port=masters[0].port,
                                                decode_responses=True)
            try:
                return [p.node for p in await durability.acheck(client,
                                                                require_persistence=False)]
            finally:
                await client.aclose()

        assert asyncio.run(run()) == [victim.name]
    finally:
        cluster.config_set("maxmemory-policy", "noeviction", target_nodes=victim)


def test_production_mode_requires_persistence_by_default() -> None:
    def required(**env: str) -> str:
        code = "import config.settings as s; print(s.QUOTA_REDIS_REQUIRE_PERSISTENCE)"
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                                text=True, timeout=60, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    production = {"TOLLGATE_ENV": "production", "SECRET_KEY": "s" * 50,
                  "TOLLGATE_KEY_PEPPER": "p" * 50, "TOLLGATE_ENCRYPTION_KEYS": "k" * 44,
                  "ALLOWED_HOSTS": "tollgate.example"}  # production names its hosts
    assert required(**production) == "True"
    assert required(**production, QUOTA_REDIS_REQUIRE_PERSISTENCE="false") == "False"
    assert required(TOLLGATE_ENV="development") == "False"
