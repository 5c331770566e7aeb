"""The burn-rate breaker: a scope (tenant, project, API key) that spends far above its pace is
closed for a cool-down, once, with a record that alerts, the console and a resume act on.

How it is checked. A pace rule is an ordinary quota counter (quotas/limits.py `pace_counters`)
on a short fixed window (quotas/windows.py, a pace period of e.g. 600 s): at most a share of the
scope's daily token limit, or a spend in micro-dollars, per period. The reserve script checks it
with the other counters, so the hot path costs nothing more than one more counter in the same
script call. Fixed periods: a client may spend up to twice the share across one period boundary
(the end of one period and the start of the next); the rule bounds every aligned period, not
every sliding one.

Tripping. When reserve refuses a call on a pace counter, the gateway (gateway/runtime.py) runs
lua/pace_trip.lua once for that refusal: it records the trip in the tenant's trips hash
(quotas.keys.pace_trips_key) and writes a huge negative credit into the scope's pace counters of
every period that overlaps the cool-down, so every call touching the scope is refused until the
last of those periods ends (the cool-down rounded up to whole periods). Idempotent: of many
refusals racing, one trips it; the others see the active trip. The next period has no credit:
the breaker half-opens by itself (one period's share), and trips again if the runaway goes on.

After. billing/alerts.py reads the trips and fires `breaker.tripped` (webhook and owner email)
once per trip; the console lists the active trips with a Resume button (`resume_trip`, audited
`pace.resumed`, lua/pace_resume.lua), which gives the scope a fresh period's share from now.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio

from quotas import keys, scripts
from quotas.engine import QuotaStoreUnavailable, ScopeLimit, Unit, _store_errors
from quotas.windows import Window, pace_windows

if TYPE_CHECKING:  # annotations only: the Redis side imports without the models
    from tenants.models import Tenant

log = logging.getLogger(__name__)

# Written as the credit of a closed counter: no limit plus any credit a resume might have left
# comes near it, so `used + pending + amount <= limit + credit` is false for every call.
CLOSED_CREDIT = -(10**15)
# A trip record stays this long after its cool-down ends, for the alert detectors (they run
# every minute) and the console's "recently tripped".
TRIP_KEEP_S = 86400
# A counter the trip creates for a period still to come needs to live only through its period
# (reserve sets its own expiry when it first holds in it).
_CREATED_GRACE_S = 120


@dataclass(frozen=True)
class PaceLimit(ScopeLimit):
    """A pace counter: a ScopeLimit on a pace window (refusal reason spend_rate_exceeded), with
    what a trip needs to know. Never queueable: waiting out a cool-down is not a queue."""

    queueable: bool = field(default=False, compare=False)
    cooldown_s: int = field(default=1800, compare=False)
    owner: str = field(default="", compare=False)  # "project:<public id>" etc., for people
    rule: str = field(default="", compare=False)  # e.g. "25% of 1,000,000 tokens per 600 s"


@dataclass(frozen=True)
class Trip:
    """A trip record (lua/pace_trip.lua) of one scope."""

    scope: str
    tripped_ms: int
    until_ms: int
    owner: str = ""
    label: str = ""
    rules: tuple[str, ...] = ()
    counter_keys: tuple[str, ...] = ()
    resumed_ms: int | None = None
    resumed_by: str = ""

    def active(self, now_ms: int) -> bool:
        return self.resumed_ms is None and now_ms < self.until_ms

    @property
    def kind(self) -> str:
        """tenant / project / key."""
        return self.scope.split(":", 1)[0]


@dataclass(frozen=True)
class TripResult:
    first: bool  # this call tripped the breaker (False: a trip was already active)
    tripped_ms: int
    until_ms: int


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_trip(scope: str, raw: str | bytes) -> Trip:
    record = json.loads(_str(raw))
    info = json.loads(record.get("info") or "{}")
    resumed = record.get("resumed")
    return Trip(scope=scope, tripped_ms=int(record["tripped"]), until_ms=int(record["until"]),
                owner=info.get("owner", ""), label=info.get("label", ""),
                rules=tuple(info.get("rules", ())), counter_keys=tuple(record.get("keys", ())),
                resumed_ms=int(resumed) if resumed else None, resumed_by=record.get("by", ""))


def _counter_key(tenant: str, limit: ScopeLimit, window: Window) -> str:
    if limit.unit is Unit.MICROS:
        return keys.spend_counter_key(tenant, limit.scope, window.id)
    return keys.counter_key(tenant, limit.scope, window.id)


def trip_call(tenant: str, paced: Sequence[PaceLimit], now_ms: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of lua/pace_trip.lua closing these pace counters (all of one scope) from the
    period containing `now_ms` (the Redis time of the refusal) through the cool-down."""
    scope = paced[0].scope
    if any(p.scope != scope for p in paced):
        raise ValueError("one trip closes the pace counters of one scope")
    cooldown_ms = max(p.cooldown_s for p in paced) * 1000
    call_keys = [keys.pace_trips_key(tenant)]
    counter_args: list[Any] = []
    until_ms = now_ms
    for limit in paced:
        for window in pace_windows(limit.window, now_ms, now_ms + cooldown_ms):
            call_keys.append(_counter_key(tenant, limit, window))
            expire_at = window.end_ms // 1000 + _CREATED_GRACE_S
            counter_args += [window.start_ms, window.end_ms, expire_at]
            until_ms = max(until_ms, window.end_ms)
    info = json.dumps({"owner": paced[0].owner, "label": paced[0].label,
                       "rules": [p.rule for p in paced]}, separators=(",", ":"))
    args = [scope, until_ms, TRIP_KEEP_S, CLOSED_CREDIT, info, len(call_keys) - 1, now_ms,
            *counter_args]
    return call_keys, args


def _trip_result(reply: Sequence[Any]) -> TripResult:
    return TripResult(int(reply[0]) == 1, int(reply[1]), int(reply[2]))


def paced_of(limits: Sequence[ScopeLimit], scope: str) -> list[PaceLimit]:
    """The pace counters of `scope` among a request's limits."""
    return [s for s in limits if isinstance(s, PaceLimit) and s.scope == scope]


class PaceBreaker:
    """The breaker's Redis side over a sync client (console, services, alerts, tests)."""

    def __init__(self, client: redis.Redis | redis.RedisCluster) -> None:
        self.client = client
        self._trip = client.register_script(scripts.PACE_TRIP.text)
        self._resume = client.register_script(scripts.PACE_RESUME.text)

    def trip(self, tenant: str, paced: Sequence[PaceLimit], now_ms: int) -> TripResult:
        call_keys, args = trip_call(tenant, paced, now_ms)
        with _store_errors():
            return _trip_result(self._trip(keys=call_keys, args=args))

    def trips(self, tenant: str) -> list[Trip]:
        """The tenant's latest trip of each scope, active or not, newest first."""
        with _store_errors():
            raw = self.client.hgetall(keys.pace_trips_key(tenant))
        found = [parse_trip(_str(scope), record) for scope, record in raw.items()]
        return sorted(found, key=lambda t: (-t.tripped_ms, t.scope))

    def resume(self, tenant: str, trip: Trip, by: str) -> bool:
        """Lift `trip` if it is still the scope's active trip (False otherwise)."""
        call_keys = [keys.pace_trips_key(tenant), *trip.counter_keys]
        with _store_errors():
            code, _now = self._resume(keys=call_keys, args=[trip.scope, str(trip.tripped_ms), by])
        if int(code) == -1:
            raise QuotaStoreUnavailable(f"pace trip of {trip.scope} changed while resuming")
        return int(code) == 1

    def now_ms(self) -> int:
        with _store_errors():
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000


class AsyncPaceBreaker:
    """The gateway's side: trip on a pace refusal (gateway/runtime.py)."""

    def __init__(self, client: redis.asyncio.Redis | redis.asyncio.RedisCluster) -> None:
        self.client = client
        self._trip = client.register_script(scripts.PACE_TRIP.text)

    async def trip(self, tenant: str, paced: Sequence[PaceLimit], now_ms: int) -> TripResult:
        call_keys, args = trip_call(tenant, paced, now_ms)
        with _store_errors():
            return _trip_result(await self._trip(keys=call_keys, args=args))


# -- the service: the console's list and Resume -------------------------------------------------


def _breaker(client: Any = None) -> PaceBreaker:
    if client is None:
        from quotas.runtime import get_engine

        client = get_engine().client
    return PaceBreaker(client)


def tenant_trips(tenant: Tenant, *, client: Any = None) -> tuple[list[Trip], int]:
    """The tenant's trip records (newest first) and the Redis time they are judged at."""
    breaker = _breaker(client)
    return breaker.trips(keys.tenant_tag(tenant.pk)), breaker.now_ms()


def resume_trip(tenant: Tenant, scope: str, *, actor: str, client: Any = None) -> Trip | None:
    """Lift the active trip of `scope` early, audited `pace.resumed`; None when the scope has no
    active trip (it ended, or someone resumed it first)."""
    from tenants.services.audit import record_audit_event

    breaker = _breaker(client)
    tag = keys.tenant_tag(tenant.pk)
    trip = next((t for t in breaker.trips(tag) if t.scope == scope), None)
    if trip is None or not breaker.resume(tag, trip, actor):
        return None
    record_audit_event(actor=actor, action="pace.resumed", target=trip.owner or scope,
                       tenant=tenant, data={"scope": scope, "label": trip.label,
                                            "rules": list(trip.rules),
                                            "tripped_ms": trip.tripped_ms,
                                            "until_ms": trip.until_ms})
    log.info("pace breaker of %s (tenant %s) resumed by %s", scope, tenant.slug, actor)
    return trip
