"""The Lua scripts in `lua/`, one per atomic operation, read once at import.

Each engine registers them on its own Redis client with redis-py's `register_script`, which calls
EVALSHA and reloads the script on NOSCRIPT (after a restart or failover, or on a cluster node that
has not seen it yet). The file headers document KEYS, ARGV and the return tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

# The `lua` package ships the scripts as package data (pyproject.toml), so they are found the same
# way in a checkout and in an installed copy.
LUA_DIR = resources.files("lua")


@dataclass(frozen=True)
class LuaSource:
    name: str
    text: str


# Shared functions a script pastes in with a line `--#include <name>` (lua/lib/<name>.lua):
# Redis runs one self-contained script per call, so the allotment arithmetic that four
# operations apply (reserve, settle, release, sweep) is written once and included.
_INCLUDE = "--#include "


def _read(name: str) -> LuaSource:
    text = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith(_INCLUDE):
            lib = line[len(_INCLUDE):].strip()
            lines.append((LUA_DIR / "lib" / f"{lib}.lua").read_text(encoding="utf-8"))
        else:
            lines.append(line)
    return LuaSource(name=name, text="".join(lines))


RESERVE = _read("reserve")
SETTLE = _read("settle")
RELEASE = _read("release")
SWEEP = _read("sweep")
RECHARGE = _read("recharge")
PROVIDER_TAKE = _read("provider_take")
PROGRESS = _read("progress")
REBUILD = _read("rebuild")
BREAKER_RECORD = _read("breaker_record")
BREAKER_PROBE = _read("breaker_probe")
# The burn-rate breaker (quotas/pace.py), off the hot path: only after a pace refusal, and a
# person's resume.
PACE_TRIP = _read("pace_trip")
PACE_RESUME = _read("pace_resume")

# The waiting queue (quotas/waiting.py): a waiter that gives up (timeout, client gone) leaves.
QUEUE_LEAVE = _read("queue_leave")

# Off the hot path: after a change of allotments, the tiers take the new ones at once
# (quotas/allotments.py apply_allotments).
ALLOTMENTS_SET = _read("allotments_set")

# The index of active tenants (quotas/active.py): a gateway's batched marks, the sweep job's
# removal of idle tenants (only those not marked since).
ACTIVE_MARK = _read("active_mark")
ACTIVE_FORGET = _read("active_forget")

ALL = (RESERVE, SETTLE, RELEASE, SWEEP, RECHARGE, PROVIDER_TAKE, PROGRESS, REBUILD,
       BREAKER_RECORD, BREAKER_PROBE, PACE_TRIP, PACE_RESUME, QUEUE_LEAVE, ALLOTMENTS_SET,
       ACTIVE_MARK, ACTIVE_FORGET)
