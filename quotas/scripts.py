"""The Lua scripts in `lua/`, one per atomic operation, read once at import.

Each engine registers them on its own Redis client with redis-py's `register_script`, which calls
EVALSHA and reloads the script on NOSCRIPT (after a restart or failover, or on a cluster node that
has not seen it yet). The file headers document KEYS, ARGV and the return tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"


@dataclass(frozen=True)
class LuaSource:
    name: str
    text: str


def _read(name: str) -> LuaSource:
    return LuaSource(name=name, text=(LUA_DIR / f"{name}.lua").read_text())


RESERVE = _read("reserve")
SETTLE = _read("settle")
RELEASE = _read("release")
SWEEP = _read("sweep")
RECHARGE = _read("recharge")
PROVIDER_TAKE = _read("provider_take")
PROGRESS = _read("progress")
REBUILD = _read("rebuild")

ALL = (RESERVE, SETTLE, RELEASE, SWEEP, RECHARGE, PROVIDER_TAKE, PROGRESS, REBUILD)
