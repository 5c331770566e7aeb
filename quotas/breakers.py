"""Typed wrappers around the circuit-breaker scripts (lua/breaker_record.lua,
lua/breaker_probe.lua), sync (`BreakerStore`) and async (`AsyncBreakerStore`), and the reads the
admin and /metrics make of the breakers' state.

Beside quotas/engine.py rather than in it: the breakers are a provider key's, not a tenant's
quota, and the engine's hot-path code is not touched by them. The gateway's side (when to
record, probing, skipping open keys) is gateway/circuit.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from quotas import keys, scripts
from quotas.engine import _store_errors

# Whose breaker: the provider key's own (transport failures), or one model's on it (5xx).
KEY_LEVEL = ""


@dataclass(frozen=True)
class BreakerRules:
    """The thresholds every script call carries (settings TOLLGATE_BREAKER_*)."""

    window_ms: int
    min_calls: int
    error_percent: int
    cooldown_ms: int
    probes: int
    lease_ms: int  # a probe slot without a result is handed out again after this long

    def __post_init__(self) -> None:
        for name in ("window_ms", "min_calls", "error_percent", "cooldown_ms", "probes",
                     "lease_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.error_percent > 100:
            raise ValueError(f"error_percent must be 1-100, got {self.error_percent}")


@dataclass(frozen=True)
class Outcomes:
    """What one record call tells one breaker: successes, failures, and whether they are the
    result of a probe holding one of its slots. A probe with neither a success nor a failure
    (SLOT_BACK) is no result: it hands its slot back (the call never tested the upstream)."""

    ok: int = 0
    failed: int = 0
    probe: bool = False

    def __post_init__(self) -> None:
        for value in (self.ok, self.failed):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"outcome counts must be integers >= 0, got {value!r}")


# A probe slot given up without a result (lua/breaker_record.lua: taken - 1).
SLOT_BACK = Outcomes(probe=True)


@dataclass(frozen=True)
class BreakerState:
    """One breaker after a record (or as read): `transition` is what this call changed."""

    model: str  # KEY_LEVEL for the key's own breaker
    transition: str  # "" | "opened" | "closed"
    state: str  # "closed" | "open" | "half_open"
    until_ms: int  # open: when it may half-open (Redis clock); else 0
    calls: int
    errors: int


@dataclass(frozen=True)
class RecordResult:
    now_ms: int  # the Redis clock when the script ran
    key: BreakerState
    model: BreakerState


@dataclass(frozen=True)
class ProbeResult:
    granted: bool
    transition: str  # "half_opened" when this call turned the breaker half-open
    state: str
    wait_ms: int  # when refused: until a slot may free up
    now_ms: int


@dataclass(frozen=True)
class BreakerSnapshot:
    """A breaker as the admin and /metrics show it."""

    model: str  # KEY_LEVEL for the key's own breaker
    state: str
    calls: int
    errors: int
    until_ms: int
    opened: int  # transitions so far
    half_opened: int
    closed: int


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _record_call(provider_key_id: int, model: str, key_outcomes: Outcomes,
                 model_outcomes: Outcomes, rules: BreakerRules) -> tuple[list[str], list[Any]]:
    call_keys = [keys.provider_breaker_key(provider_key_id),
                 keys.provider_model_breaker_key(provider_key_id, model),
                 keys.provider_breaker_models_key(provider_key_id)]
    args: list[Any] = [model]
    for outcome in (key_outcomes, model_outcomes):
        args += [outcome.ok, outcome.failed, int(outcome.probe)]
    args += [rules.window_ms, rules.min_calls, rules.error_percent, rules.cooldown_ms,
             rules.probes]
    return call_keys, args


def _breaker(model: str, part: Sequence[Any]) -> BreakerState:
    return BreakerState(model, _str(part[0]), _str(part[1]), int(part[2]), int(part[3]),
                        int(part[4]))


def _record_result(model: str, reply: Sequence[Any]) -> RecordResult:
    return RecordResult(int(reply[0]), _breaker(KEY_LEVEL, reply[1:6]), _breaker(model, reply[6:11]))


def _probe_key(provider_key_id: int, model: str) -> str:
    if model == KEY_LEVEL:
        return keys.provider_breaker_key(provider_key_id)
    return keys.provider_model_breaker_key(provider_key_id, model)


def _probe_result(reply: Sequence[Any]) -> ProbeResult:
    return ProbeResult(int(reply[0]) == 1, _str(reply[1]), _str(reply[2]), int(reply[3]),
                       int(reply[4]))


_SNAPSHOT_FIELDS = ("state", "calls", "errors", "until", "opened", "half_opened", "closed")


def _snapshot(model: str, fields: Sequence[Any]) -> BreakerSnapshot:
    def number(value: Any) -> int:
        return int(value) if value is not None else 0

    state = _str(fields[0]) if fields[0] is not None else "closed"
    return BreakerSnapshot(model, state, number(fields[1]), number(fields[2]),
                           number(fields[3]) if state == "open" else 0,
                           number(fields[4]), number(fields[5]), number(fields[6]))


class BreakerStore:
    """The breaker scripts and reads over a sync `redis.Redis` or `redis.RedisCluster`."""

    def __init__(self, client: redis.Redis | redis.RedisCluster) -> None:
        self.client = client
        self._record = client.register_script(scripts.BREAKER_RECORD.text)
        self._probe = client.register_script(scripts.BREAKER_PROBE.text)

    def record(self, provider_key_id: int, model: str, key_outcomes: Outcomes,
               model_outcomes: Outcomes, rules: BreakerRules) -> RecordResult:
        call_keys, args = _record_call(provider_key_id, model, key_outcomes, model_outcomes,
                                       rules)
        with _store_errors():
            return _record_result(model, self._record(keys=call_keys, args=args))

    def probe(self, provider_key_id: int, model: str, rules: BreakerRules) -> ProbeResult:
        """Take a probe slot of the key's breaker (model KEY_LEVEL) or of one model's."""
        with _store_errors():
            reply = self._probe(keys=[_probe_key(provider_key_id, model)],
                                args=[rules.probes, rules.lease_ms])
        return _probe_result(reply)

    def snapshots(self, provider_key_id: int) -> list[BreakerSnapshot]:
        """Every breaker of one provider key, the key's own first: two round trips."""
        with _store_errors():
            models = sorted(_str(m) for m in self.client.smembers(
                keys.provider_breaker_models_key(provider_key_id)))
            pipe = self.client.pipeline(transaction=False)
            for model in (KEY_LEVEL, *models):
                pipe.hmget(_probe_key(provider_key_id, model), _SNAPSHOT_FIELDS)
            replies = pipe.execute()
        return [_snapshot(model, fields) for model, fields in zip((KEY_LEVEL, *models), replies,
                                                                   strict=True)]


class AsyncBreakerStore:
    """The same over `redis.asyncio.Redis` or `redis.asyncio.RedisCluster` (the gateway's)."""

    def __init__(self, client: redis.asyncio.Redis | redis.asyncio.RedisCluster) -> None:
        self.client = client
        self._record = client.register_script(scripts.BREAKER_RECORD.text)
        self._probe = client.register_script(scripts.BREAKER_PROBE.text)

    async def record(self, provider_key_id: int, model: str, key_outcomes: Outcomes,
                     model_outcomes: Outcomes, rules: BreakerRules) -> RecordResult:
        call_keys, args = _record_call(provider_key_id, model, key_outcomes, model_outcomes,
                                       rules)
        with _store_errors():
            return _record_result(model, await self._record(keys=call_keys, args=args))

    async def probe(self, provider_key_id: int, model: str, rules: BreakerRules) -> ProbeResult:
        with _store_errors():
            reply = await self._probe(keys=[_probe_key(provider_key_id, model)],
                                      args=[rules.probes, rules.lease_ms])
        return _probe_result(reply)
