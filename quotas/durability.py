"""Is the quota Redis safe to count on? A Redis that forgets keys resets counters silently.

Two settings of the server decide it, and both are read here (INFO and CONFIG GET, on every
master of a cluster):

- `maxmemory-policy` must be `noeviction`. Every other policy may delete keys when memory is
  full: the `allkeys-*` ones any key, the `volatile-*` ones any key with a TTL, and every quota
  counter has a TTL. A deleted counter is a tenant's day starting again at zero. Under
  `noeviction` a full Redis refuses writes instead (OOM), which the gateway turns into 503: it
  fails closed rather than admitting on a counter that vanished.
- Persistence (AOF, or RDB save points) must be on in production: a restart without it loses
  every counter. The tenants' epoch markers (lua/rebuild.lua) catch such a loss and the counters
  are rebuilt from the ledger, but only the ledger's rows: the usage events still waiting in
  Redis for the drain are lost with it. Outside production (the tests, `make up` on a laptop)
  persistence is optional.

The gateway's readiness probe (/readyz), the first build of each gateway worker, the Celery
worker and `python -m config.serve` all refuse an unsafe server with these messages.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import ResponseError

SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class NodeConfig:
    """What one Redis server (a cluster master, or the standalone server) says of itself."""

    node: str  # "host:port", a socket path, or the URL's server
    policy: str | None  # maxmemory-policy; None when INFO was refused
    aof: bool
    save: str | None  # RDB save points ("" when none); None when CONFIG GET was refused
    error: str = ""  # why a figure is missing (a renamed command, an ACL without the right)


@dataclass(frozen=True)
class Problem:
    """One unsafe setting of one server."""

    node: str
    issue: str  # short, without the server's address: safe for /readyz's public answer
    fix: str

    def __str__(self) -> str:
        return f"quota Redis {self.node}: {self.issue}; {self.fix}"


def node_problems(config: NodeConfig, *, require_persistence: bool) -> list[Problem]:
    """The unsafe settings of one server; empty when it is safe."""
    problems = []
    if config.policy is None:
        problems.append(Problem(
            config.node, "maxmemory-policy cannot be read",
            f"the quota store must be known to run with noeviction ({config.error})"))
    elif config.policy != SAFE_POLICY:
        problems.append(Problem(
            config.node, f"maxmemory-policy {config.policy} may evict quota counters",
            "they all have a TTL, and an evicted counter silently resets a tenant's usage: set "
            "maxmemory-policy noeviction (redis.conf, or CONFIG SET maxmemory-policy noeviction)"))
    if require_persistence and not config.aof:
        if config.save is None:
            problems.append(Problem(
                config.node, "AOF is off and the RDB save points cannot be read",
                f"turn on appendonly yes, or set QUOTA_REDIS_REQUIRE_PERSISTENCE=false if the "
                f"server persists its data in a way Tollgate cannot see ({config.error})"))
        elif not config.save.strip():
            problems.append(Problem(
                config.node, "no persistence (appendonly no, no save points)",
                "a restart loses every counter and every undrained usage event: set appendonly "
                "yes (appendfsync everysec)"))
    return problems


def problems_of(configs: Sequence[NodeConfig], *, require_persistence: bool) -> list[Problem]:
    return [p for c in configs for p in node_problems(c, require_persistence=require_persistence)]


def _name(client: Any) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def _config(node: str, memory: Any, persistence: Any, save: Any, errors: list[str]) -> NodeConfig:
    policy = memory.get("maxmemory_policy") if isinstance(memory, dict) else None
    aof = bool(int(persistence.get("aof_enabled", 0))) if isinstance(persistence, dict) else False
    if isinstance(save, dict):
        save = save.get("save", "")
    return NodeConfig(node, str(policy) if policy is not None else None, aof,
                      None if save is None else str(save), "; ".join(errors))


# -- sync ----------------------------------------------------------------------------------------


def _read_node(client: Any, node: str, target: Any = None) -> NodeConfig:
    extra = {} if target is None else {"target_nodes": target}
    errors: list[str] = []
    values: list[Any] = []
    # A managed Redis may rename CONFIG or deny it to the app's user; each figure is then
    # reported as unknown, never guessed. Connection errors propagate: unreachable is not unsafe.
    for call in (lambda: client.info("memory", **extra),
                 lambda: client.info("persistence", **extra),
                 lambda: client.config_get("save", **extra)):
        try:
            values.append(call())
        except ResponseError as exc:
            errors.append(str(exc))
            values.append(None)
    return _config(node, *values, errors)


def read_configs(client: redis.Redis | redis.RedisCluster) -> list[NodeConfig]:
    """The configuration of the standalone server, or of every master of a cluster."""
    if isinstance(client, redis.RedisCluster):
        return [_read_node(client, node.name, node) for node in client.get_primaries()]
    return [_read_node(client, _name(client))]


def check(client: redis.Redis | redis.RedisCluster, *,
          require_persistence: bool | None = None) -> list[Problem]:
    """Problems of the quota Redis (empty: safe). Raises redis' ConnectionError/TimeoutError
    when it cannot be reached."""
    return problems_of(read_configs(client), require_persistence=_required(require_persistence))


# -- async ---------------------------------------------------------------------------------------


async def _aread_node(client: Any, node: str, target: Any = None) -> NodeConfig:
    extra = {} if target is None else {"target_nodes": target}
    errors: list[str] = []
    values: list[Any] = []
    for call in (lambda: client.info("memory", **extra),
                 lambda: client.info("persistence", **extra),
                 lambda: client.config_get("save", **extra)):
        try:
            values.append(await call())
        except ResponseError as exc:
            errors.append(str(exc))
            values.append(None)
    return _config(node, *values, errors)


async def aread_configs(client: redis.asyncio.Redis | redis.asyncio.RedisCluster) -> list[NodeConfig]:
    if isinstance(client, redis.asyncio.RedisCluster):
        await client.initialize()  # idempotent; the primaries are known only after it
        return [await _aread_node(client, node.name, node) for node in client.get_primaries()]
    return [await _aread_node(client, _name(client))]


async def acheck(client: redis.asyncio.Redis | redis.asyncio.RedisCluster, *,
                 require_persistence: bool | None = None) -> list[Problem]:
    configs = await aread_configs(client)
    return problems_of(configs, require_persistence=_required(require_persistence))


def _required(require_persistence: bool | None) -> bool:
    if require_persistence is not None:
        return require_persistence
    from django.conf import settings

    return bool(settings.QUOTA_REDIS_REQUIRE_PERSISTENCE)
