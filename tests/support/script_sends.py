"""What goes to Redis packed ahead (quotas/resp.py): the commands the engine hands the script
connections as they are, apart from those ScriptPool.call packs with hiredis."""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import pytest

from quotas.script_pool import ScriptPool


def packed_sends(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The commands sent packed ahead from now on: through ScriptPool.call_packed, not through
    ScriptPool.call (which packs its arguments with hiredis, then goes through call_packed), and
    those ScriptPool.send_now wrote (the gateway's settle, written before its answer is made)."""
    sent: list[bytes] = []
    real_call, real_packed, real_now = ScriptPool.call, ScriptPool.call_packed, ScriptPool.send_now
    # Per task: another task's call in flight (a checkpoint, a mark) must not hide this one's.
    through_call: ContextVar[bool] = ContextVar("through_call", default=False)

    async def call(self: ScriptPool, args: Any) -> Any:
        token = through_call.set(True)
        try:
            return await real_call(self, args)
        finally:
            through_call.reset(token)

    async def call_packed(self: ScriptPool, command: bytes) -> Any:
        if not through_call.get():
            sent.append(command)
        return await real_packed(self, command)

    def send_now(self: ScriptPool, command: bytes) -> Any:
        written = real_now(self, command)
        if written is not None:
            sent.append(command)
        return written

    monkeypatch.setattr(ScriptPool, "call", call)
    monkeypatch.setattr(ScriptPool, "send_now", send_now)
    monkeypatch.setattr(ScriptPool, "call_packed", call_packed)
    return sent
