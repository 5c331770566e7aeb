"""The quota engine: typed Python wrappers around the reserve / settle / release / sweep /
recharge scripts, in a sync flavour (`QuotaEngine`) and an async one (`AsyncQuotaEngine`).

Both share the pure parts (`_Calls`: building KEYS/ARGV, parsing replies) and differ only in how
they talk to Redis. The Redis client is passed in, so the same code runs on a standalone server
and on a Redis Cluster (every key of one tenant shares a hash tag, see `quotas.keys`).

The hot path is one script call for reserve and one for settle (or release). Nothing on the
decision path is counted in Python: every check-and-write happens inside a script.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

from quotas import keys, resp, scripts
from quotas.active import PendingMarks, shard_of
from quotas.windows import (
    UTC_MONTHLY,
    Calendar,
    CycleSchedule,
    RedisClock,
    Window,
    WindowKind,
    calendar_of,
)

UNLIMITED = -1
_MAX_CLOCK_RETRIES = 3

if TYPE_CHECKING:  # at run time the script pool may be missing (hiredis is optional)
    from quotas.script_pool import Sent

log = logging.getLogger(__name__)


class QuotaError(Exception):
    """Base class of the engine's errors."""


class QuotaStoreUnavailable(QuotaError):
    """Redis could not be reached or answered in time. The gateway turns this into HTTP 503:
    no request may pass unmetered (fail closed)."""


class QuotaClockError(QuotaError):
    """The Redis clock kept falling outside the computed window (should never persist)."""


class QuotaEpochLost(QuotaError):
    """The tenant's epoch marker is missing: Redis lost the tenant's data (a restart without
    persistence, a failover, a flush), or it was never initialised. Its counters would read 0,
    so nothing is admitted until they are rebuilt from the ledger (see `rebuild`)."""

    def __init__(self, tenant: str) -> None:
        super().__init__(f"the quota counters of tenant {tenant} must be rebuilt (epoch missing)")
        self.tenant = tenant


class DuplicateRequestId(QuotaError):
    """A hold with this request id has already ended (its tombstone remains); request ids must
    be unique. (Reserving an id whose hold is still open returns that hold: see `reserve`.)"""


_UNREACHABLE = (ConnectionError, TimeoutError, ClusterDownError, BusyLoadingError, OSError)


def _unavailable(exc: Exception) -> QuotaStoreUnavailable:
    """What a Redis failure means to a caller: the store cannot meter now."""
    if isinstance(exc, _UNREACHABLE):
        return QuotaStoreUnavailable(f"quota store unreachable: {exc}")
    # OOM, READONLY after a failover, BUSY, or a script error.
    return QuotaStoreUnavailable(f"quota store refused the operation: {exc}")


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    try:
        yield
    except (*_UNREACHABLE, ResponseError) as exc:
        raise _unavailable(exc) from exc


# For the other modules that talk to the quota Redis (quotas/answers.py): the same mapping.
store_errors = _store_errors


# -- requests and results -----------------------------------------------------------------------


class Phase(StrEnum):
    """How far a hold's call got; the sweep charges accordingly (lua/sweep.lua)."""

    RESERVED = "reserved"  # admitted, not yet known to have reached the upstream: sweep charges 0
    FORWARDED = "forwarded"  # a non-streamed call in flight upstream: the whole hold
    STREAMING = "streaming"  # a stream: the input plus the last checkpoint of output delivered


class Unit(StrEnum):
    TOKENS = "tokens"  # the counter holds the request's tokens (amount, may shrink)
    MICROS = "micros"  # the counter holds the request's worst-case cost in micro-dollars
    # Allotment chains (lua/lib/tiers.lua, quotas/limits.py allotment_chain): a project's or
    # key's allotment tier (limit = its allotment), and the tenant's shared pool that ends a
    # chain (limit = the tenant's quota minus the allotments). Tokens, taken in that order.
    ALLOTMENT = "allotment"
    POOL = "pool"

    @property
    def tiered(self) -> bool:
        return self is Unit.ALLOTMENT or self is Unit.POOL


_UNIT_CODES = {Unit.TOKENS: 0, Unit.MICROS: 1, Unit.ALLOTMENT: 2, Unit.POOL: 3}


def _require_int(what: str, value: object, minimum: int) -> None:
    # bool is an int subclass: True as a limit is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ScopeLimit:
    """One counter a request is checked against: a scope, a window kind and its limit, and (from
    the definitions in quotas/limits.py) what people call it and why a refusal by it counts."""

    scope: str
    window: WindowKind
    limit: int  # per window; UNLIMITED (-1) tracks usage without refusing; 0 refuses all
    unit: Unit = Unit.TOKENS
    # Descriptive only (not part of the counter's identity): the name a person reads and the
    # refused-today reason code (quotas.limits.REFUSAL_REASONS) of a refusal by this counter.
    label: str = field(default="", compare=False)
    reason: str = field(default="", compare=False)
    # Whether a caller under the queue policy may wait for this counter to have room. False for
    # counters waiting cannot help in reasonable time (the burn-rate breaker's pace counters):
    # their refusals answer at once, with their own reason, and never join a queue.
    queueable: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        keys.validate_scope(self.scope)
        _require_int("limit", self.limit, UNLIMITED)


@dataclass(frozen=True)
class RateLimit:
    """A token bucket of requests: `capacity` requests per `period_ms`, refilled continuously."""

    scope: str
    capacity: int
    period_ms: int

    def __post_init__(self) -> None:
        keys.validate_scope(self.scope)
        _require_int("rate capacity", self.capacity, 1)
        _require_int("rate period (ms)", self.period_ms, 1)


@dataclass(frozen=True)
class ConcurrencyLimit:
    """At most `cap` requests of a scope in flight at once (0 refuses every request)."""

    scope: str
    cap: int

    def __post_init__(self) -> None:
        keys.validate_scope(self.scope)
        _require_int("concurrency cap", self.cap, 0)


@dataclass(frozen=True)
class QueueTicket:
    """What a call under the queue policy brings to reserve (lua/reserve.lua, "Queue"): the gate
    (behind any live waiter ahead of it) and, on a refusal that waiting can help, its place in the
    refusing resource's queue."""

    priority: int  # the plan's queue priority, higher first; |priority| < 2^20
    deadline_ms: int  # on the Redis clock: the caller gives up then, its entry is dead after it
    lease_ms: int  # a head must call again within this, or it is taken for dead
    max_waiters: int  # the tenant's bound on waiters
    order: int | None = None  # its place, from the first queued reply; None before it has one

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or abs(self.priority) >= QUEUE_PRIORITY_BOUND:
            raise ValueError(f"queue priority must be an integer below 2^20 in magnitude, "
                             f"got {self.priority!r}")
        _require_int("deadline_ms", self.deadline_ms, 0)
        _require_int("lease_ms", self.lease_ms, 1)
        _require_int("max_waiters", self.max_waiters, 1)


# Priorities beyond this are clamped by callers (an order is -priority * 2^32 + arrival, exact in
# a Lua double below 2^53).
QUEUE_PRIORITY_BOUND = 2**20


@dataclass(frozen=True)
class ReserveRequest:
    tenant: str
    request_id: str
    amount: int
    limits: tuple[ScopeLimit, ...]
    # Smallest acceptable hold; below `amount` lets the engine shrink the hold to the headroom.
    min_amount: int | None = None
    dry_run: bool = False
    # The tenant's windows (its time zone and cycle: quotas/cycles.py schedule_for).
    schedule: CycleSchedule = UTC_MONTHLY
    rates: tuple[RateLimit, ...] = ()
    concurrency: ConcurrencyLimit | None = None
    meta: str = ""  # stored with the hold and copied into its usage event (e.g. JSON)
    # Worst-case cost in micro-dollars, held in full by the MICROS counters (spend budgets).
    money_amount: int = 0
    # Stored in the hold so the sweep can charge a dead call what is known: its estimated input,
    # priced like the ledger prices it (micro-dollars per million tokens).
    input_tokens: int = 0
    price_in: int = 0
    price_out: int = 0
    # Refuse (QuotaEpochLost) when the tenant's epoch marker is missing. The gateway turns it on;
    # off by default for tools and tests that use a bare Redis.
    check_epoch: bool = False
    # The queue policy: gate and queue in the same script call (None: reserve as always).
    queue: QueueTicket | None = None

    def __post_init__(self) -> None:
        keys.validate_request_id(self.request_id)
        if self.queue is not None and self.dry_run:
            raise ValueError("a dry run cannot wait in the queue")
        if not self.limits:
            raise ValueError("a reservation needs at least one scope")
        _require_int("amount", self.amount, 1)
        if self.min_amount is not None:
            _require_int("min_amount", self.min_amount, 1)
            if self.min_amount > self.amount:
                raise ValueError("min_amount must be between 1 and amount")
        _require_int("money_amount", self.money_amount, 0)
        _require_int("input_tokens", self.input_tokens, 0)
        _require_int("price_in", self.price_in, 0)
        _require_int("price_out", self.price_out, 0)
        seen = {(s.scope, s.window, s.unit) for s in self.limits}
        if len(seen) != len(self.limits):
            raise ValueError("each (scope, window, unit) may appear once")


@dataclass(frozen=True)
class CounterState:
    scope: str
    window: Window
    key: str
    limit: int
    remaining: int  # after this call; UNLIMITED for unlimited counters (or unknown)
    unit: Unit = Unit.TOKENS
    # The ScopeLimit's label and refusal reason, filled in on the refused counter
    # (Reservation.refused), the one that is reported; empty on the others.
    label: str = field(default="", compare=False)
    reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class Hold:
    """What settle / release need: the tenant, the request id and the keys held in."""

    tenant: str
    request_id: str
    amount: int
    counter_keys: tuple[str, ...]
    gauge_key: str = ""  # the concurrency gauge the request occupies, if any
    money_amount: int = 0  # micro-dollars held in the spend-budget counters
    # What a settle needs if Redis lost the record (lua/settle.lua "fallback"): the unit of each
    # counter (0 tokens, 1 micro-dollars), the reserve's meta and its Redis time.
    units: tuple[int, ...] = ()
    meta: str = ""
    created_ms: int = 0


class Outcome(StrEnum):
    ADMITTED = "admitted"
    QUOTA = "quota"  # a token quota had no room: OpenAI's `insufficient_quota`
    RATE = "rate"  # a request-rate bucket was empty: `rate_limit_exceeded`
    CONCURRENCY = "concurrency"  # too many requests in flight: `rate_limit_exceeded`
    QUEUED = "queued"  # (queue policy) waiting in the queue of `queue_key`
    QUEUE_FULL = "queue_full"  # (queue policy) the tenant has its bound of waiters already


class QueueResource(StrEnum):
    """Which kind of resource a queued call waits for (lua/reserve.lua's `kind`)."""

    COUNTER = "counter"
    BUCKET = "bucket"
    GAUGE = "gauge"


@dataclass(frozen=True)
class Reservation:
    admitted: bool
    request_id: str
    granted: int  # tokens held (0 when refused); < requested when the hold was shrunk
    counters: tuple[CounterState, ...]  # empty when refused before the quota check
    refused: CounterState | None  # the first quota counter that had no room
    server_time_ms: int
    hold: Hold | None  # None when refused or in a dry run
    outcome: Outcome = Outcome.ADMITTED
    rate_remaining: tuple[int, ...] = ()  # whole requests left per rate bucket, in request order
    refused_rate: RateLimit | None = None
    retry_after_ms: int = 0  # for RATE: when the bucket has a request again
    in_flight: int = 0  # for CONCURRENCY: requests of the scope in flight
    # QUEUED: the queue the call waits in, its place, whether it is the head and what for (the
    # refusing counter is in `refused`, the bucket in `refused_rate`; RATE's retry_after_ms).
    queue_key: str = ""
    queue_order: int | None = None
    queue_head: bool = False
    queue_resource: QueueResource | None = None
    waiters: int = 0  # QUEUED / QUEUE_FULL: the tenant's waiters then
    # Milliseconds this call waited in the queue before it was admitted (queue policy; 0 when
    # it did not wait). Set by quotas/waiting.py, not by the script.
    queue_wait_ms: int = 0

    def __getattr__(self, name: str) -> Any:
        # Only for a field missing from the instance: the counters of an admitted reservation
        # the engine made (_admitted), made on first read. Nothing on a call's way upstream
        # reads them (the rate-limit headers do, while the upstream answers): about 8 us of a
        # call's critical path at ten counters.
        if name == "counters":
            make = self.__dict__.get("_make_counters")
            if make is not None:
                counters = self.__dict__["counters"] = make()
                return counters
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def remaining(self) -> int:
        """Tokens left in the tightest limited token scope, UNLIMITED when none is limited."""
        limited = [c.remaining for c in self.counters
                   if c.limit != UNLIMITED and c.unit in (Unit.TOKENS, Unit.POOL)]
        return min(limited) if limited else UNLIMITED


@dataclass(frozen=True, slots=True)
class PackedSettle:
    """A hold's settle command (lua/settle.lua's EVALSHA with its keys and arguments), packed but
    for the three figures only the call's end knows: the gateway makes it while the upstream
    answers, so that after the answer the settle is three bulk strings and a write
    (docs/benchmarks.md, "Issue 16 item 3: the quota calls in fewer steps")."""

    hold: Hold
    # What made it (an engine's _Calls): its script digest and tombstone, checked by the settle.
    source: object
    head: bytes  # the command's length, EVALSHA, the digest, the keys, the request id
    tombstone: bytes  # the tombstone's seconds, between actual and the event
    tail: bytes  # the fallback and the wake channel

    def command(self, actual: int, event: str, actual_money: int) -> bytes:
        return b"".join((self.head, resp.bulks((actual,)), self.tombstone,
                         resp.bulks((event, actual_money)), self.tail))


@dataclass(frozen=True)
class SentReserve:
    """A reserve's script call already written to Redis (AsyncQuotaEngine.send_reserve), its
    reply still to come (reserve(request, sent)). Its script connection stays taken until then."""

    call: _ReserveCall  # its request: call.request
    sent: Sent


@dataclass(frozen=True)
class SettleResult:
    request_id: str
    outcome: str  # settled | released | swept | unknown | keys_mismatch
    held: int
    charged: int

    @property
    def applied(self) -> bool:
        return self.outcome == "settled" and (self.held > 0 or self.charged > 0)

    @property
    def corrected(self) -> bool:
        """This settle arrived after the sweep and corrected its charge (by `charged`)."""
        return self.outcome == "corrected" and self.held > 0


@dataclass(frozen=True)
class ReleaseResult:
    request_id: str
    outcome: str  # released | corrected | settled | keys_mismatch; unknown (by id only)
    released: int  # tokens freed from pending, or (corrected) taken back from used
    held: int = 0  # the hold's tokens when this call ended or corrected it; 0 for a no-op

    @property
    def applied(self) -> bool:
        return self.outcome == "released" and self.released > 0

    @property
    def corrected(self) -> bool:
        """This release arrived after the sweep and took its charge back."""
        return self.outcome == "corrected" and self.held > 0


@dataclass(frozen=True)
class SweptHold:
    request_id: str
    amount: int  # tokens that were held
    charged: int = 0  # tokens the sweep charged (what the hold knew of its call)
    basis: str = Phase.RESERVED.value  # the hold's phase, which decided the charge


@dataclass(frozen=True)
class SweepResult:
    tenant: str
    swept: tuple[SweptHold, ...]
    dropped: int
    fresh: int


@dataclass(frozen=True)
class RechargeResult:
    scope: str
    window: Window
    credit: int
    remaining: int


@dataclass(frozen=True)
class CapacityResult:
    taken: bool
    retry_after_ms: int = 0  # when refused or queued
    requests_left: int = UNLIMITED
    tokens_left: int = UNLIMITED
    # Refused because callers wait for this key's capacity (it is theirs first).
    behind_waiters: bool = False
    # Queued (CapacityWait with a waiter id): waiting in the key's queue, its place and head.
    queued: bool = False
    queue_key: str = ""
    queue_order: int = 0
    queue_head: bool = False


@dataclass(frozen=True)
class CapacityWait:
    """A caller's part in an upstream key's queue (lua/provider_take.lua, "Queue"). With an
    empty waiter id it only passes the gate: it takes nothing while callers wait ahead of it."""

    waiter_id: str = ""  # the request id of a caller that waits (its plan queues), else ""
    priority: int = 0  # its plan's queue priority, higher first; |priority| < 2^20
    deadline_ms: int = 0  # Redis clock: it gives up then
    lease_ms: int = 1  # a head must come back within this
    order: int | None = None  # its place, from its first queued reply

    def __post_init__(self) -> None:
        if self.waiter_id:
            keys.validate_request_id(self.waiter_id)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or abs(self.priority) >= QUEUE_PRIORITY_BOUND:
            raise ValueError(f"queue priority must be an integer below 2^20 in magnitude, "
                             f"got {self.priority!r}")
        _require_int("lease_ms", self.lease_ms, 1)


def _capacity_args(rpm: int | None, tpm: int | None, tokens: int) -> list[int]:
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
    for value in (rpm, tpm):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"a capacity must be None or an integer >= 1, got {value!r}")
    return [rpm or UNLIMITED, tpm or UNLIMITED, tokens]


def _capacity_call(provider_key_id: int, rpm: int | None, tpm: int | None, tokens: int,
                   wait: CapacityWait | None) -> tuple[list[str], list[Any]]:
    call_keys: list[str] = [keys.provider_capacity_key(provider_key_id)]
    args: list[Any] = _capacity_args(rpm, tpm, tokens)
    if wait is not None:
        call_keys += [keys.provider_waiters_key(provider_key_id),
                      keys.provider_queue_key(provider_key_id),
                      keys.provider_seq_key(provider_key_id)]
        args += [wait.waiter_id, "" if wait.order is None else wait.order, wait.priority,
                 wait.deadline_ms, wait.lease_ms, keys.QUEUE_WAKE_CHANNEL]
    return call_keys, args


def _capacity_result(reply: Sequence[Any], provider_key_id: int = 0) -> CapacityResult:
    code = int(reply[0])
    if code == 1:
        return CapacityResult(True, 0, int(reply[1]), int(reply[2]))
    if code == -6:
        return CapacityResult(False, int(reply[2]), queued=True,
                              queue_key=keys.provider_queue_key(provider_key_id),
                              queue_order=int(reply[3]), queue_head=int(reply[1]) == 1)
    return CapacityResult(False, int(reply[1]), behind_waiters=int(reply[2]) == 3)


def _capacity_leave_call(provider_key_id: int, waiter_id: str,
                         lease_ms: int) -> tuple[list[str], list[Any]]:
    keys.validate_request_id(waiter_id)
    _require_int("lease_ms", lease_ms, 1)
    # One queue per provider key: no membership hash (2 keys).
    return ([keys.provider_waiters_key(provider_key_id), keys.provider_queue_key(provider_key_id)],
            [waiter_id, lease_ms, keys.QUEUE_WAKE_CHANNEL])


@dataclass(frozen=True)
class CounterSnapshot:
    key: str
    limit: int | None  # None when the counter does not exist (nothing reserved yet)
    used: int
    pending: int
    credit: int
    over: int
    ttl_s: int  # -2 missing, -1 no TTL (must never happen), else seconds left


@dataclass(frozen=True)
class EngineSettings:
    counter_grace_s: int = 2 * 86400  # day and month counters outlive their window this long
    minute_grace_s: int = 120  # minute (TPM) counters: only in-flight holds need them after
    tombstone_s: int = 3600
    stale_hold_s: int = 600
    sweep_batch: int = 200
    active_shards: int = 16  # shards of the index of active tenants (quotas/active.py)
    # How long a tenant stays in that index after its last mark with nothing to do.
    active_retention_s: int = 900

    @classmethod
    def from_django(cls) -> EngineSettings:
        from django.conf import settings

        return cls(
            counter_grace_s=settings.QUOTA_COUNTER_GRACE_SECONDS,
            tombstone_s=settings.QUOTA_TOMBSTONE_SECONDS,
            stale_hold_s=settings.QUOTA_STALE_HOLD_SECONDS,
            sweep_batch=settings.QUOTA_SWEEP_BATCH,
            active_shards=settings.TOLLGATE_ACTIVE_SHARDS,
            active_retention_s=settings.TOLLGATE_ACTIVE_RETENTION_SECONDS,
        )


# -- the pure part: KEYS/ARGV and replies -------------------------------------------------------


@dataclass(frozen=True)
class _ReserveCall:
    request: ReserveRequest
    counters: tuple[tuple[ScopeLimit, Window, str], ...]
    keys: list[str]
    args: list[Any]
    # The counters' parts of the reply (their CounterState fields but `remaining`, their keys
    # and unit codes), from the request's shape (_Windowed).
    states: tuple[dict[str, Any], ...] = ()
    counter_keys: tuple[str, ...] = ()
    units: tuple[int, ...] = ()
    # The whole EVALSHA command, packed: what hiredis.pack_command makes of ("EVALSHA", the
    # script's digest, len(keys), *keys, *args); empty where the engine does not send it so.
    command: bytes = field(default=b"", repr=False)


def _counter_key(tenant: str, limit: ScopeLimit, window: Window) -> str:
    # Money counters live beside the token counters of the same scope, under their own name.
    if limit.unit is Unit.MICROS:
        return keys.spend_counter_key(tenant, limit.scope, window.id)
    if limit.unit is Unit.ALLOTMENT:
        return keys.allotment_key(tenant, limit.scope, window.id)
    if limit.unit is Unit.POOL:
        return keys.pool_key(tenant, window.id)
    return keys.counter_key(tenant, limit.scope, window.id)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unit_code(unit: Unit) -> int:
    return _UNIT_CODES[unit]


def _pool_seed(limits: tuple[ScopeLimit, ...], limit: ScopeLimit) -> int:
    """For a pool: the 1-based index of its scope's token counter of the same window, whose
    used + pending a new pool starts from (lua/reserve.lua); 0 otherwise or when absent."""
    if limit.unit is not Unit.POOL:
        return 0
    for index, other in enumerate(limits, 1):
        if (other.unit is Unit.TOKENS and other.scope == limit.scope
                and other.window is limit.window):
            return index
    return 0


def _fallback(hold: Hold) -> str:
    """What settle / release need when Redis lost the hold record (see lua/settle.lua). Numbers
    travel as strings: cjson would turn a 13-digit millisecond time into a float."""
    units = hold.units or tuple(0 for _ in hold.counter_keys)
    parts = _fallback_parts(units, hold.meta)
    if parts is None:
        return json.dumps({"units": list(units), "amount": str(hold.amount),
                           "created": str(hold.created_ms), "meta": hold.meta},
                          separators=(",", ":"))
    # The digits of two integers need no JSON escaping.
    return f"{parts[0]}{hold.amount}{parts[1]}{hold.created_ms}{parts[2]}"


_HOLE = "\0"  # a NUL: no meta the gateway makes holds one


@functools.lru_cache(maxsize=4096)
def _fallback_parts(units: tuple[int, ...], meta: str) -> tuple[str, str, str] | None:
    """_fallback's JSON around its amount and creation time, the same for every hold of a
    shape (a JSON encoding per settle was ~0.5 % of a gateway call's CPU); None if the meta
    holds the marker that cuts it."""
    if _HOLE in meta:
        return None
    text = json.dumps({"units": list(units), "amount": _HOLE, "created": _HOLE, "meta": meta},
                      separators=(",", ":"))
    # The NUL is escaped as \u0000 in the JSON: cut there (the quotes around it are kept).
    parts = text.split(json.dumps(_HOLE)[1:-1])
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


@dataclass(frozen=True)
class RebuildCounter:
    """One current-window counter restored from the ledger after Redis lost data."""

    scope: str
    window: Window
    used: int  # tokens, or micro-dollars for a MICROS counter
    limit: int = UNLIMITED  # stored for readers; reserve always uses the limit it is given
    unit: Unit = Unit.TOKENS

    def __post_init__(self) -> None:
        keys.validate_scope(self.scope)
        _require_int("used", self.used, 0)
        _require_int("limit", self.limit, UNLIMITED)


def _progress_args(phase: Phase, output_tokens: int, upstream: int | None) -> list[Any]:
    if phase not in (Phase.FORWARDED, Phase.STREAMING):
        raise ValueError(f"progress records forwarded or streaming, not {phase!r}")
    _require_int("output_tokens", output_tokens, 0)
    if upstream is not None:
        _require_int("upstream", upstream, 1)
    return [phase.value, output_tokens, "" if upstream is None else upstream]


def _unmetered_fields(request_id: str, actual: int, created_ms: int, ended_ms: int, meta: str,
                      event: str) -> dict[str, Any]:
    keys.validate_request_id(request_id)
    _require_int("actual", actual, 0)
    return {"request_id": request_id, "outcome": "unmetered", "held": 0, "actual": actual,
            "money": 0, "created": created_ms, "ended": ended_ms, "meta": meta, "event": event}


# Request shapes remembered per engine (see _Shape); beyond this many, start afresh.
_SHAPES_MAX = 4096


_new = object.__new__


def _counter_state(fields: dict[str, Any], remaining: int) -> CounterState:
    """The CounterState of `fields` (all but `remaining`) and `remaining`, made without the frozen
    dataclass's __init__, which sets each of its nine fields through object.__setattr__: about
    4 us a counter on the bench machine, a dozen counters per gateway call. The same object
    (CounterState has no __post_init__ to skip)."""
    state = _new(CounterState)
    attrs = state.__dict__
    attrs.update(fields)
    attrs["remaining"] = remaining
    return state


def _counter_states(fields: Sequence[dict[str, Any]], remaining: Sequence[Any],
                    ) -> tuple[CounterState, ...]:
    return tuple(_counter_state(f, int(left)) for f, left in zip(fields, remaining, strict=True))


# Every field of an admitted Reservation but those _admitted sets: the class's defaults (a field
# with a default_factory would need its own value per reservation: none has one).
_ADMITTED_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Reservation)
                      if f.default is not dataclasses.MISSING}
assert all(f.default_factory is dataclasses.MISSING for f in dataclasses.fields(Reservation))


def _admitted(call: _ReserveCall, granted: int, now_ms: int, remaining: Sequence[Any],
              rate_remaining: tuple[int, ...]) -> Reservation:
    """An admitted Reservation, as Reservation(...) makes it, without the frozen dataclass's
    __init__ (an object.__setattr__ per field, 18 fields) and with its counters made on first
    read (Reservation.__getattr__); a dry run holds nothing. reserve_reply's hot path: every
    call admitted takes it."""
    req = call.request
    hold = None
    if not req.dry_run:
        gauge = keys.gauge_key(req.tenant, req.concurrency.scope) if req.concurrency else ""
        hold = _new(Hold)
        hold.__dict__.update(tenant=req.tenant, request_id=req.request_id, amount=granted,
                             counter_keys=call.counter_keys, gauge_key=gauge,
                             money_amount=req.money_amount, units=call.units, meta=req.meta,
                             created_ms=now_ms)
    reservation = _new(Reservation)
    attrs = reservation.__dict__
    attrs.update(_ADMITTED_DEFAULTS)
    attrs.update(admitted=True, request_id=req.request_id, granted=granted, refused=None,
                 server_time_ms=now_ms, hold=hold, rate_remaining=rate_remaining)
    attrs["_make_counters"] = functools.partial(_counter_states, call.states, remaining)
    return reservation


class _Windowed:
    """The counters' part of a reserve call in one set of windows (see _Shape)."""

    __slots__ = ("windows", "counters", "keys", "args", "states", "units", "packed_keys",
                 "packed_args")

    def __init__(self, req: ReserveRequest, windows: list[Window], calls: _Calls,
                 shape: _Shape) -> None:
        self.windows = windows
        counters = []
        args: list[int] = []
        for limit, window in zip(req.limits, windows, strict=True):
            counters.append((limit, window, _counter_key(req.tenant, limit, window)))
            args += [limit.limit, window.start_ms, window.end_ms, calls.expire_at(window),
                     _unit_code(limit.unit) + 8 * _pool_seed(req.limits, limit)]
        self.counters = tuple(counters)
        self.keys = tuple(c[2] for c in counters)
        self.args = args
        self.states = tuple({"scope": limit.scope, "window": window, "key": key,
                             "limit": limit.limit, "unit": limit.unit, "label": "", "reason": ""}
                            for limit, window, key in counters)
        self.units = tuple(_unit_code(limit.unit) for limit in req.limits)
        # The command's unchanging stretches, packed (quotas/resp.py): every key but the hold's
        # (the index, the counters, the tail, the queue's), and the counters' and buckets'
        # arguments.
        self.packed_keys = resp.bulks([shape.index_key, *self.keys, *shape.tail_keys,
                                       *shape.queue_keys])
        self.packed_args = resp.bulks([*args, *shape.rate_args])


class _Shape:
    """What a reserve call's KEYS and ARGV take from its request's counters, buckets, gauge, epoch
    and queue: the same for every call of one key's context and model, so built once and reused
    (with the counters' keys and window arguments, rebuilt when a window moves on). Building
    them was about 100 us of the gateway's ~2.5 ms of CPU per call on the bench machine (34
    keys: a regular expression check of the tenant per key, 90 arguments). The gateway's
    requests share their tuples (the key's context memoises them), so a shape is found by the
    identity of its request's tuples."""

    __slots__ = ("limits", "rates", "concurrency", "index_key", "tail_keys", "rate_args",
                 "queue_keys", "queue_flags", "packed_queue_flags", "windowed")

    def __init__(self, req: ReserveRequest) -> None:
        tenant = req.tenant
        self.limits = req.limits
        self.rates = req.rates
        self.concurrency = req.concurrency
        self.index_key = keys.hold_index_key(tenant)
        tail = [keys.rate_key(tenant, rate.scope, rate.period_ms) for rate in req.rates]
        if req.concurrency is not None:
            tail.append(keys.gauge_key(tenant, req.concurrency.scope))
        if req.check_epoch:
            tail.append(keys.epoch_key(tenant))
        self.tail_keys = tail
        self.rate_args = [n for rate in req.rates for n in (rate.capacity, rate.period_ms)]
        self.queue_keys = _queue_keys(req) if req.queue is not None else []
        self.queue_flags = [1 if limit.queueable else 0 for limit in req.limits]
        self.packed_queue_flags = resp.bulks(self.queue_flags)
        # The counters' part in the windows last used: replaced whole, so a reader on another
        # thread never mixes two windows' parts.
        self.windowed: _Windowed | None = None

    def matches(self, req: ReserveRequest) -> bool:
        return (req.limits is self.limits and req.rates is self.rates
                and req.concurrency is self.concurrency)


@dataclass
class _Calls:
    settings: EngineSettings
    clock: RedisClock
    # "EVALSHA" and the reserve script's digest, packed: the head of every reserve's command.
    reserve_head: bytes = b""
    _shapes: dict[tuple[Any, ...], _Shape] = field(default_factory=dict, repr=False)

    def calendar(self, schedule: CycleSchedule) -> Calendar:
        return calendar_of(schedule)

    def _shape(self, req: ReserveRequest) -> _Shape:
        ident = (req.tenant, id(req.limits), id(req.rates), id(req.concurrency), req.check_epoch,
                 req.queue is not None)
        shape = self._shapes.get(ident)
        if shape is None or not shape.matches(req):
            if len(self._shapes) >= _SHAPES_MAX:
                self._shapes.clear()
            shape = self._shapes[ident] = _Shape(req)
        return shape

    def _windowed(self, req: ReserveRequest, shape: _Shape, windows: list[Window]) -> _Windowed:
        """The counters' part of a reserve call in these windows (the shape's, unless a window
        moved on: a Calendar returns the same Window object while it lasts)."""
        windowed = shape.windowed
        if windowed is None or windowed.windows != windows:  # identical objects: no __eq__
            windowed = shape.windowed = _Windowed(req, windows, self, shape)
        return windowed

    def expire_at(self, window: Window) -> int:
        # Minute and pace-period counters matter only while their window runs (and to the holds
        # still open in it), so they go soon after; day and month ones are read for days after.
        short = window.kind is WindowKind.MINUTE or window.kind.pace_seconds is not None
        grace = self.settings.minute_grace_s if short else self.settings.counter_grace_s
        return window.end_ms // 1000 + grace

    def reserve(self, req: ReserveRequest) -> _ReserveCall:
        now_ms = self.clock.now_ms()
        cal = self.calendar(req.schedule)
        shape = self._shape(req)
        windowed = self._windowed(req, shape,
                                  [cal.window(limit.window, now_ms) for limit in req.limits])
        cap = req.concurrency.cap if req.concurrency is not None else -1
        head: list[Any] = [
            req.request_id,
            req.amount,
            req.min_amount if req.min_amount is not None else req.amount,
            1 if req.dry_run else 0,
            len(req.limits),
            len(req.rates),
            cap,
            self.settings.stale_hold_s * 1000,
            req.meta,
            req.money_amount,
            req.input_tokens,
            req.price_in,
            req.price_out,
            1 if req.check_epoch else 0,
        ]
        hold_key = keys.hold_key(req.tenant, req.request_id)
        call_keys = [hold_key, shape.index_key, *windowed.keys, *shape.tail_keys,
                     *shape.queue_keys]
        args = [*head, *windowed.args, *shape.rate_args]
        if req.queue is not None:
            queue_args = _queue_args(req, shape.queue_flags)
            args += queue_args
        command = b""
        if self.reserve_head:  # an engine that sends it packed (AsyncQuotaEngine)
            parts = [self.reserve_head, resp.bulks((len(call_keys), hold_key)),
                     windowed.packed_keys, resp.bulks(head), windowed.packed_args]
            if req.queue is not None:
                # The queue's own six, then its flags (one per counter: the shape's, packed).
                parts += (resp.bulks(queue_args[:_QUEUE_OWN_ARGS]), shape.packed_queue_flags)
            # EVALSHA, its digest, the number of keys, the keys and the arguments.
            command = resp.packed(3 + len(call_keys) + len(args), parts)
        return _ReserveCall(req, windowed.counters, call_keys, args, windowed.states,
                            windowed.keys, windowed.units, command)

    def reserve_reply(self, call: _ReserveCall, reply: Sequence[Any]) -> Reservation | None:
        """The Reservation, or None when the window did not match the Redis clock (retry)."""
        code, detail, now_ms = int(reply[0]), int(reply[1]), int(reply[2])
        self.clock.observe(now_ms)
        if code == -1:
            return None
        req = call.request
        if code == -2:
            return _DUPLICATE
        if code == -5:
            raise QuotaEpochLost(req.tenant)
        if code == -6:
            return _queued(call, reply)
        if code == -7:
            return Reservation(admitted=False, request_id=req.request_id, granted=0, counters=(),
                               refused=None, server_time_ms=now_ms, hold=None,
                               outcome=Outcome.QUEUE_FULL, waiters=detail)
        if code in (-3, -4):
            rate = code == -3
            return Reservation(
                admitted=False, request_id=req.request_id, granted=0, counters=(), refused=None,
                server_time_ms=now_ms, hold=None,
                outcome=Outcome.RATE if rate else Outcome.CONCURRENCY,
                refused_rate=req.rates[detail - 1] if rate else None,
                retry_after_ms=int(reply[3]) if rate else 0,
                in_flight=0 if rate else detail,
            )
        n = len(call.counters)
        if len(reply) < 3 + n:
            raise ValueError(f"a reserve reply of {len(reply)} items for {n} counters")
        if code == 1:
            return _admitted(call, detail, now_ms, reply[3:3 + n],
                             tuple(int(x) for x in reply[3 + n:]))
        # Refused by a counter (code 0): `detail` is its index.
        states = _counter_states(call.states, reply[3:3 + n])
        return Reservation(
            admitted=False,
            request_id=req.request_id,
            granted=0,
            counters=states,
            refused=_refused(call, states, detail - 1),
            server_time_ms=now_ms,
            hold=None,
            outcome=Outcome.QUOTA,
            rate_remaining=tuple(int(x) for x in reply[3 + n:]),
        )

    def end_keys(self, hold: Hold) -> list[str]:
        call_keys = [
            keys.hold_key(hold.tenant, hold.request_id),
            keys.hold_index_key(hold.tenant),
            keys.usage_stream_key(hold.tenant),
            *hold.counter_keys,
        ]
        if hold.gauge_key:
            call_keys.append(hold.gauge_key)
        # Last: the waiters key, so the script announces freed capacity when callers wait.
        call_keys.append(keys.queue_waiters_key(hold.tenant))
        return call_keys

    def settle_args(self, hold: Hold, actual: int, event: str, actual_money: int) -> list[Any]:
        if not isinstance(actual, int) or actual < 0:
            raise ValueError(f"actual tokens must be an integer >= 0, got {actual!r}")
        if not isinstance(actual_money, int) or actual_money < 0:
            raise ValueError(f"actual_money must be an integer >= 0, got {actual_money!r}")
        return [hold.request_id, actual, self.settings.tombstone_s, event, actual_money,
                _fallback(hold), keys.QUEUE_WAKE_CHANNEL]

    def packed_settle(self, hold: Hold, sha: str) -> PackedSettle:
        """EVALSHA `sha` of settle_args(hold, ...) with end_keys(hold), packed around the three
        figures only the call's end knows (actual tokens, the event, actual money)."""
        call_keys = self.end_keys(hold)
        count = 3 + len(call_keys) + 7  # EVALSHA, digest, number of keys; settle_args' seven
        head = resp.packed(count, [resp.bulks(("EVALSHA", sha, len(call_keys), *call_keys,
                                                hold.request_id))])
        return PackedSettle(hold, self, head, resp.bulks((self.settings.tombstone_s,)),
                            resp.bulks((_fallback(hold), keys.QUEUE_WAKE_CHANNEL)))

    def release_args(self, hold: Hold, event: str) -> list[Any]:
        return [hold.request_id, self.settings.tombstone_s, event, _fallback(hold),
                keys.QUEUE_WAKE_CHANNEL]

    def hold_from_record(self, tenant: str, request_id: str, record: Sequence[Any]) -> Hold | None:
        state, amount, counter_keys, gauge, money, units, meta, created = record
        if state is None or _str(state) != "open":
            return None
        return Hold(tenant, request_id, int(amount), tuple(json.loads(_str(counter_keys))),
                    _str(gauge) if gauge else "", int(money or 0),
                    tuple(json.loads(_str(units))) if units else (),
                    _str(meta) if meta else "", int(created or 0))

    def recovered(self, call: _ReserveCall, record: Sequence[Any]) -> Reservation:
        """The reservation a repeated reserve call already made.

        A reserve whose reply was lost (a socket timeout after Redis ran the script) is sent
        again by the client's retry; the second call finds the first one's hold. If it is open
        and made in the same counters, that is this request's reservation; otherwise the id was
        reused, which is an error.
        """
        req = call.request
        hold = self.hold_from_record(req.tenant, req.request_id, record)
        if hold is None or hold.counter_keys != tuple(c[2] for c in call.counters):
            raise DuplicateRequestId(f"request id {req.request_id!r} was used before")
        states = tuple(CounterState(scope=limit.scope, window=window, key=key, limit=limit.limit,
                                    remaining=UNLIMITED, unit=limit.unit)
                       for limit, window, key in call.counters)
        return Reservation(admitted=True, request_id=req.request_id, granted=hold.amount,
                           counters=states, refused=None, server_time_ms=self.clock.now_ms(),
                           hold=hold)

    def sweep_call(
        self, tenant: str, ids: Sequence[str], records: Sequence[Any], stale_s: int
    ) -> tuple[list[str], list[Any]]:
        touched: dict[str, None] = {}
        for counter_keys, gauge in records:
            if counter_keys is not None:
                for k in json.loads(_str(counter_keys)):
                    touched[k] = None
            if gauge:
                touched[_str(gauge)] = None
        hold_keys = [keys.hold_key(tenant, rid) for rid in ids]
        call_keys = [keys.hold_index_key(tenant), keys.usage_stream_key(tenant), *hold_keys,
                     *touched, keys.queue_waiters_key(tenant)]
        args: list[Any] = [stale_s * 1000, len(ids), self.settings.tombstone_s, *ids,
                           keys.QUEUE_WAKE_CHANNEL]
        return call_keys, args

    def leave_call(self, tenant: str, request_id: str, queue_key: str,
                   lease_ms: int) -> tuple[list[str], list[Any]]:
        keys.validate_request_id(request_id)
        _require_int("lease_ms", lease_ms, 1)
        return ([keys.queue_waiters_key(tenant), queue_key, keys.queue_member_key(tenant)],
                [request_id, lease_ms, keys.QUEUE_WAKE_CHANNEL])

    def sweep_reply(self, tenant: str, reply: Sequence[Any]) -> SweepResult:
        swept_n, dropped, fresh, now_ms = (int(x) for x in reply[:4])
        self.clock.observe(now_ms)
        rest = reply[4:]
        swept = tuple(
            SweptHold(_str(rest[i]), int(rest[i + 1]), int(rest[i + 2]), _str(rest[i + 3]))
            for i in range(0, 4 * swept_n, 4)
        )
        return SweepResult(tenant=tenant, swept=swept, dropped=dropped, fresh=fresh)

    def recharge_call(
        self, tenant: str, limit: ScopeLimit, tokens: int, schedule: CycleSchedule
    ) -> tuple[Window, str, list[Any]]:
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
        window = self.calendar(schedule).window(limit.window, self.clock.now_ms())
        key = _counter_key(tenant, limit, window)
        return window, key, [tokens, limit.limit, window.start_ms, window.end_ms,
                             self.expire_at(window)]

    def rebuild_call(self, tenant: str, counters: Sequence[RebuildCounter],
                     epoch: str) -> tuple[list[str], list[Any]]:
        call_keys = [keys.epoch_key(tenant)]
        args: list[Any] = [len(counters), epoch]
        for c in counters:
            call_keys.append(_counter_key(tenant, ScopeLimit(c.scope, c.window.kind, c.limit,
                                                             c.unit), c.window))
            args += [c.used, c.limit, self.expire_at(c.window), _unit_code(c.unit)]
        return call_keys, args

    def counter_key_now(self, tenant: str, scope: str, kind: WindowKind, schedule: CycleSchedule,
                        unit: Unit = Unit.TOKENS) -> str:
        window = self.calendar(schedule).window(kind, self.clock.now_ms())
        return _counter_key(tenant, ScopeLimit(scope, kind, UNLIMITED, unit), window)


def _counter_queue_key(tenant: str, limit: ScopeLimit) -> str:
    role = "al" if limit.unit is Unit.ALLOTMENT else "pool" if limit.unit is Unit.POOL else "q"
    resource = keys.counter_resource(limit.scope, limit.window.value, limit.unit is Unit.MICROS,
                                     role)
    return keys.queue_key(tenant, resource)


def _queue_keys(req: ReserveRequest) -> list[str]:
    """lua/reserve.lua's queue keys: the tenant's waiters, membership and arrivals, then the
    queue of every resource of the call in KEYS order (counters, buckets, the gauge)."""
    tenant = req.tenant
    out = [keys.queue_waiters_key(tenant), keys.queue_member_key(tenant),
           keys.queue_seq_key(tenant)]
    out += [_counter_queue_key(tenant, limit) for limit in req.limits]
    out += [keys.queue_key(tenant, keys.rate_resource(rate.scope, rate.period_ms))
            for rate in req.rates]
    if req.concurrency is not None:
        out.append(keys.queue_key(tenant, keys.gauge_resource(req.concurrency.scope)))
    return out


# _queue_args' own arguments, before the counters' flags.
_QUEUE_OWN_ARGS = 6


def _queue_args(req: ReserveRequest, queue_flags: list[int]) -> list[Any]:
    """lua/reserve.lua's queue arguments; `queue_flags`: whether each counter is queueable."""
    ticket = req.queue
    assert ticket is not None
    return [
        "" if ticket.order is None else ticket.order,
        ticket.priority,
        ticket.deadline_ms,
        ticket.lease_ms,
        ticket.max_waiters,
        keys.QUEUE_WAKE_CHANNEL,
        *queue_flags,
    ]


_QUEUE_KINDS = {1: QueueResource.COUNTER, 2: QueueResource.BUCKET, 3: QueueResource.GAUGE}


def _queued(call: _ReserveCall, reply: Sequence[Any]) -> Reservation:
    """A QUEUED reservation: { -6, head, now_ms, retry_after_ms, order, kind, index, waiters }."""
    req = call.request
    head, now_ms, retry_after, order, kind, index, waiters = (int(x) for x in reply[1:8])
    resource = _QUEUE_KINDS[kind]
    refused = refused_rate = None
    if resource is QueueResource.COUNTER:
        limit, window, key = call.counters[index - 1]
        refused = CounterState(scope=limit.scope, window=window, key=key, limit=limit.limit,
                               remaining=0, unit=limit.unit, label=limit.label,
                               reason=limit.reason)
    elif resource is QueueResource.BUCKET:
        refused_rate = req.rates[index - 1]
    queue_keys = _queue_keys(req)[3:]
    position = {QueueResource.COUNTER: index - 1,
                QueueResource.BUCKET: len(req.limits) + index - 1,
                QueueResource.GAUGE: len(req.limits) + len(req.rates)}[resource]
    return Reservation(
        admitted=False, request_id=req.request_id, granted=0, counters=(), refused=refused,
        server_time_ms=now_ms, hold=None, outcome=Outcome.QUEUED, refused_rate=refused_rate,
        retry_after_ms=retry_after, queue_key=queue_keys[position], queue_order=order,
        queue_head=head == 1, queue_resource=resource, waiters=waiters)


def _refused(call: _ReserveCall, states: tuple[CounterState, ...], index: int) -> CounterState:
    """The refused counter's state with its definition's label and reason (only a refusal pays
    for them)."""
    limit = call.counters[index][0]
    return dataclasses.replace(states[index], label=limit.label, reason=limit.reason)


def _snapshot(key: str, fields: Sequence[Any], ttl: int) -> CounterSnapshot:
    limit, used, pending, credit, over = fields
    return CounterSnapshot(
        key=key,
        limit=int(limit) if limit is not None else None,
        used=int(used or 0),
        pending=int(pending or 0),
        credit=int(credit or 0),
        over=int(over or 0),
        ttl_s=int(ttl),
    )


_COUNTER_FIELDS = ("limit", "used", "pending", "credit", "over")
_HOLD_FIELDS = ("state", "amount", "keys", "gauge", "money", "units", "meta", "created")
_DUPLICATE = object()  # reserve_reply: a hold with this id exists


# -- sync ---------------------------------------------------------------------------------------


class QuotaEngine:
    """Synchronous engine over a `redis.Redis` or `redis.cluster.RedisCluster` client.

    Every reserve, settle, release and fail-open usage event marks its tenant in the index of
    active tenants at once, after the script (quotas/active.py: one more round trip; the
    gateway's async engine batches them instead). `mark_active=False` skips it (a benchmark of
    the scripts alone)."""

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        settings: EngineSettings | None = None,
        clock: RedisClock | None = None,
        *,
        mark_active: bool = True,
    ) -> None:
        self.client = client
        self.settings = settings or EngineSettings()
        self.clock = clock or RedisClock()
        self.mark_active = mark_active
        self._scripts = {s.name: client.register_script(s.text) for s in scripts.ALL}
        self._calls = _Calls(self.settings, self.clock)

    def _run(self, name: str, call_keys: list[str], args: list[Any]) -> Any:
        with _store_errors():
            return self._scripts[name](keys=call_keys, args=args)

    def _mark(self, tenant: str) -> None:
        """Mark the tenant active (lua/active_mark.lua). After the operation it follows: the
        operation's own failure raises first. A mark that fails is logged, not raised: the
        operation is done, and the jobs' full walk finds the tenant (quotas/active.py)."""
        if not self.mark_active:
            return
        shard = shard_of(tenant, self.settings.active_shards)
        try:
            self._scripts["active_mark"](keys=[keys.active_shard_key(shard)], args=[tenant])
        except (*_UNREACHABLE, ResponseError):
            log.warning("could not mark tenant %s active; the jobs' full walk will find it",
                        tenant, exc_info=True)

    def reserve(self, request: ReserveRequest) -> Reservation:
        """Reserve, or refuse. Idempotent per request id while the hold is open: a repeated call
        returns the hold the first one made (see _Calls.recovered)."""
        reservation = self._reserve(request)
        self._mark(request.tenant)
        return reservation

    def _reserve(self, request: ReserveRequest) -> Reservation:
        for _ in range(_MAX_CLOCK_RETRIES):
            call = self._calls.reserve(request)
            result = self._calls.reserve_reply(call, self._run("reserve", call.keys, call.args))
            if result is _DUPLICATE:
                with _store_errors():
                    record = self.client.hmget(call.keys[0], _HOLD_FIELDS)
                return self._calls.recovered(call, record)
            if result is not None:
                return result
        raise QuotaClockError("the Redis clock kept moving out of the computed window")

    def settle(self, hold: Hold, actual: int, event: str = "", actual_money: int = 0) -> SettleResult:
        args = self._calls.settle_args(hold, actual, event, actual_money)
        outcome, held, charged = self._run("settle", self._calls.end_keys(hold), args)
        self._mark(hold.tenant)
        return SettleResult(hold.request_id, _str(outcome), int(held), int(charged))

    def release(self, hold: Hold, event: str = "") -> ReleaseResult:
        args = self._calls.release_args(hold, event)
        outcome, released, held = self._run("release", self._calls.end_keys(hold), args)
        self._mark(hold.tenant)
        return ReleaseResult(hold.request_id, _str(outcome), int(released), int(held))

    def progress(self, hold: Hold, phase: Phase, output_tokens: int = 0,
                 upstream: int | None = None) -> str:
        """Record how far the hold's call got (lua/progress.lua); the hold's state is returned
        ("open" when recorded; otherwise the call had already ended and nothing changed)."""
        reply = self._run("progress", [keys.hold_key(hold.tenant, hold.request_id)],
                          _progress_args(phase, output_tokens, upstream))
        return _str(reply[0])

    def append_unmetered(self, tenant: str, request_id: str, *, actual: int, created_ms: int,
                         ended_ms: int, meta: str = "", event: str = "") -> None:
        """The usage event of a call forwarded without a hold (fail-open while Redis was down),
        appended once Redis answers again, so the ledger still gets its row."""
        fields = _unmetered_fields(request_id, actual, created_ms, ended_ms, meta, event)
        with _store_errors():
            self.client.xadd(keys.usage_stream_key(tenant), fields)
        self._mark(tenant)

    def current_window(self, kind: WindowKind, schedule: CycleSchedule = UTC_MONTHLY) -> Window:
        """The window of `kind` that contains the Redis clock's now."""
        with _store_errors():
            seconds, micros = self.client.time()  # one clock: Redis' (DESIGN.md invariant 6)
        self.clock.observe(int(seconds) * 1000 + int(micros) // 1000)
        return self._calls.calendar(schedule).window(kind, self.clock.now_ms())

    def has_epoch(self, tenant: str) -> bool:
        with _store_errors():
            return bool(self.client.exists(keys.epoch_key(tenant)))

    def rebuild(self, tenant: str, counters: Sequence[RebuildCounter], epoch: str = "") -> int:
        """Restore current-window counters (used = max(existing, figure)) and set the tenant's
        epoch marker, atomically (lua/rebuild.lua). Returns how many counters it raised."""
        call_keys, args = self._calls.rebuild_call(tenant, counters, epoch or "rebuilt")
        raised, now_ms = self._run("rebuild", call_keys, args)
        self.clock.observe(int(now_ms))
        return int(raised)

    def set_allotments(self, tenant: str, window: Window,
                       tiers: Sequence[tuple[str, int, int]], drop_pool: bool) -> int:
        """Give the tenant's tiers of `window` their allotments now (lua/allotments_set.lua):
        `tiers` are (scope, allotment, parent) with keys before projects, parent 0 for the pool
        or the 1-based index of a later tier. Returns the tokens moved into the pool."""
        call_keys = [keys.pool_key(tenant, window.id),
                     *(keys.allotment_key(tenant, scope, window.id) for scope, _, _ in tiers)]
        args: list[Any] = [len(tiers), 1 if drop_pool else 0]
        for _, allotment, parent in tiers:
            args += [allotment, parent]
        (moved,) = self._run("allotments_set", call_keys, args)
        return int(moved)

    def set_epoch(self, tenant: str, epoch: str = "") -> None:
        """Mark the tenant's data as present (a new tenant, or after a rebuild)."""
        self.rebuild(tenant, (), epoch)

    def open_hold(self, tenant: str, request_id: str) -> Hold | None:
        """The open hold of a request, read back from Redis (for settling by id off the hot path)."""
        keys.validate_request_id(request_id)
        with _store_errors():
            record = self.client.hmget(keys.hold_key(tenant, request_id), _HOLD_FIELDS)
        return self._calls.hold_from_record(tenant, request_id, record)

    def settle_by_id(self, tenant: str, request_id: str, actual: int) -> SettleResult:
        hold = self.open_hold(tenant, request_id)
        if hold is None:
            return SettleResult(request_id, self._ended_state(tenant, request_id), 0, 0)
        return self.settle(hold, actual)

    def release_by_id(self, tenant: str, request_id: str) -> ReleaseResult:
        hold = self.open_hold(tenant, request_id)
        if hold is None:
            return ReleaseResult(request_id, self._ended_state(tenant, request_id), 0)
        return self.release(hold)

    def _ended_state(self, tenant: str, request_id: str) -> str:
        with _store_errors():
            state = self.client.hget(keys.hold_key(tenant, request_id), "state")
        return _str(state) if state is not None else "unknown"

    def sweep(self, tenant: str, *, stale_s: int | None = None, max_batches: int = 10) -> SweepResult:
        """Release the tenant's holds older than `stale_s` (default: the stale threshold)."""
        stale = self.settings.stale_hold_s if stale_s is None else stale_s
        swept: list[SweptHold] = []
        dropped = fresh = 0
        index = keys.hold_index_key(tenant)
        for _ in range(max_batches):
            cutoff = self.clock.now_ms() - stale * 1000
            with _store_errors():
                ids = [_str(i) for i in self.client.zrangebyscore(
                    index, "-inf", cutoff, start=0, num=self.settings.sweep_batch)]
                if not ids:
                    break
                pipe = self.client.pipeline(transaction=False)
                for rid in ids:
                    pipe.hmget(keys.hold_key(tenant, rid), ("keys", "gauge"))
                records = pipe.execute()
            call_keys, args = self._calls.sweep_call(tenant, ids, records, stale)
            batch = self._calls.sweep_reply(tenant, self._run("sweep", call_keys, args))
            swept += batch.swept
            dropped += batch.dropped
            fresh += batch.fresh
            if len(ids) < self.settings.sweep_batch or batch.fresh == len(ids):
                break
        return SweepResult(tenant, tuple(swept), dropped, fresh)

    def recharge(
        self, tenant: str, limit: ScopeLimit, tokens: int, *, schedule: CycleSchedule = UTC_MONTHLY,
        pool: bool = False,
    ) -> RechargeResult:
        """Add credit to a counter of the current window; `pool`: a tenant counter whose
        tenant has allotments in that window credits its shared pool too (lua/recharge.lua)."""
        for _ in range(_MAX_CLOCK_RETRIES):
            window, key, args = self._calls.recharge_call(tenant, limit, tokens, schedule)
            call_keys = [key, keys.pool_key(tenant, window.id)] if pool else [key]
            code, credit, remaining, now_ms = (int(x) for x in self._run("recharge", call_keys,
                                                                          args))
            self.clock.observe(now_ms)
            if code == 1:
                return RechargeResult(limit.scope, window, credit, remaining)
        raise QuotaClockError("the Redis clock kept moving out of the computed window")

    def take_capacity(self, provider_key_id: int, rpm: int | None, tpm: int | None,
                      tokens: int, wait: CapacityWait | None = None) -> CapacityResult:
        """Take one request and `tokens` from an upstream key's RPM / TPM buckets; with `wait`,
        behind the key's waiters (and, with a waiter id, queued among them when refused)."""
        call_keys, args = _capacity_call(provider_key_id, rpm, tpm, tokens, wait)
        return _capacity_result(self._run("provider_take", call_keys, args), provider_key_id)

    def leave_capacity_queue(self, provider_key_id: int, waiter_id: str, lease_ms: int) -> bool:
        call_keys, args = _capacity_leave_call(provider_key_id, waiter_id, lease_ms)
        removed, _ = self._run("queue_leave", call_keys, args)
        return int(removed) == 1

    def leave_queue(self, tenant: str, request_id: str, queue_key: str, lease_ms: int) -> bool:
        """Take a waiter out of its queue (timed out, client gone); True if it was there."""
        call_keys, args = self._calls.leave_call(tenant, request_id, queue_key, lease_ms)
        removed, _ = self._run("queue_leave", call_keys, args)
        return int(removed) == 1

    def counter(
        self, tenant: str, scope: str, kind: WindowKind = WindowKind.DAY, *, schedule: CycleSchedule = UTC_MONTHLY,
        unit: Unit = Unit.TOKENS,
    ) -> CounterSnapshot:
        """The current window's counter of one scope (for dashboards and tests)."""
        return self.counter_at(self._calls.counter_key_now(tenant, scope, kind, schedule, unit))

    def counter_at(self, key: str) -> CounterSnapshot:
        with _store_errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(key, _COUNTER_FIELDS)
            pipe.ttl(key)
            fields, ttl = pipe.execute()
        return _snapshot(key, fields, ttl)

    def counters(
        self, tenant: str, scopes: Sequence[tuple[str, WindowKind]], *, schedule: CycleSchedule = UTC_MONTHLY,
    ) -> list[CounterSnapshot]:
        """The current window's counters of many scopes, in one round trip (dashboards)."""
        counter_keys = [self._calls.counter_key_now(tenant, scope, kind, schedule, Unit.TOKENS)
                        for scope, kind in scopes]
        with _store_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in counter_keys:
                pipe.hmget(key, _COUNTER_FIELDS)
                pipe.ttl(key)
            replies = pipe.execute()
        return [_snapshot(key, replies[2 * i], replies[2 * i + 1])
                for i, key in enumerate(counter_keys)]

    def open_hold_ids(self, tenant: str) -> list[str]:
        with _store_errors():
            return [_str(i) for i in self.client.zrange(keys.hold_index_key(tenant), 0, -1)]


# -- async --------------------------------------------------------------------------------------


# After a failed mark before a reserve, how long reserves skip it (they mark in memory only).
_MARK_NOW_PAUSE_S = 5


class AsyncQuotaEngine:
    """The same engine over `redis.asyncio.Redis` or `redis.asyncio.RedisCluster`.

    Its reserve, settle, release and fail-open usage events mark their tenant in memory, before
    the script call (a call cancelled while its script runs is marked too); `flush_active`
    writes the marks to the index of active tenants (quotas/active.py), which a gateway worker
    does every GATEWAY_ACTIVE_FLUSH_SECONDS: no round trip on the hot path. Except a tenant's
    first reserve in this worker for half the index's retention: its mark is written before
    the reserve (one more round trip), so a worker killed before its next flush leaves no hold
    of a tenant the index does not know (the sweep's run would skip it until its hourly full
    walk, its quota held meanwhile)."""

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.RedisCluster,
        settings: EngineSettings | None = None,
        clock: RedisClock | None = None,
    ) -> None:
        self.client = client
        self.settings = settings or EngineSettings()
        self.clock = clock or RedisClock()
        self.marks = PendingMarks(confirm_s=self.settings.active_retention_s / 2)
        self._mark_now_paused_until = 0.0  # monotonic; see _mark_now
        self._scripts = {s.name: client.register_script(s.text) for s in scripts.ALL}
        self._calls = _Calls(self.settings, self.clock,
                             resp.bulks(("EVALSHA", self._scripts["reserve"].sha)))

    async def flush_active(self) -> int:
        """Write the tenants marked since the last flush to the index, one script call per
        shard; on failure they stay marked for the next flush (and raise)."""
        with _store_errors():
            return await self.marks.flush(self.client, self.settings.active_shards)

    async def _run(self, name: str, call_keys: list[str], args: list[Any]) -> Any:
        # _store_errors, inline: the hot path's two calls skip making a context manager each.
        # EVALSHA straight from the client: redis-py's script object copies the keys and
        # arguments into a new tuple and imports its Pipeline class on every call; it runs
        # only when the server does not know the script yet (NOSCRIPT: it loads the script
        # and sends it again, as before).
        script = self._scripts[name]
        try:
            try:
                return await self.client.evalsha(script.sha, len(call_keys), *call_keys, *args)
            except NoScriptError:
                return await script(keys=call_keys, args=args)
        except (*_UNREACHABLE, ResponseError) as exc:
            raise _unavailable(exc) from exc

    @property
    def _script_pool(self) -> Any:
        # quotas/client.py's script connections when the client has them (None on a cluster,
        # or a client of redis-py's own).
        script_pool = getattr(self.client, "script_pool", None)
        return script_pool() if script_pool is not None else None

    async def _run_reserve(self, call: _ReserveCall) -> Any:
        return await self._run_packed("reserve", call.command, lambda: call.keys, call.args)

    async def _run_packed(self, name: str, command: bytes, call_keys: Callable[[], list[str]],
                          args: list[Any], sent: Sent | None = None) -> Any:
        """_run(name, call_keys(), args) with `command`, the same EVALSHA packed ahead, when it
        goes on the script connections (quotas/client.py script_pool: a plain Redis); a server
        without the script loads it and runs it, as EVALSHA does. `sent`: that command already
        written (ScriptPool.send_now), its reply awaited here."""
        pool = self._script_pool
        if pool is None:
            return await self._run(name, call_keys(), args)
        try:
            try:
                if sent is not None:
                    return await pool.reply(sent)
                return await pool.call_packed(command)
            except NoScriptError:
                return await self._scripts[name](keys=call_keys(), args=args)
        except (*_UNREACHABLE, ResponseError) as exc:
            raise _unavailable(exc) from exc

    async def _mark_now(self, tenant: str) -> None:
        """The tenant's mark written to its index shard now (lua/active_mark.lua), confirmed
        for PendingMarks.confirm_s. The index only guides the background jobs, so a failure
        never fails the call: on a cluster the shard may live on another master than the
        tenant's slot, down while the tenant's own is fine. It is logged, the tenant stays
        pending for the flush, and no mark is tried at once again for _MARK_NOW_PAUSE_S (each
        would wait for the same dead node on the call's path)."""
        if time.monotonic() < self._mark_now_paused_until:
            return
        sent = time.monotonic()
        shard = shard_of(tenant, self.settings.active_shards)
        try:
            await self._run("active_mark", [keys.active_shard_key(shard)], [tenant])
        except QuotaStoreUnavailable:
            self._mark_now_paused_until = time.monotonic() + _MARK_NOW_PAUSE_S
            log.warning("could not mark tenant %s active before its reserve; left to the flush, "
                        "no mark before a reserve for %d s", tenant, _MARK_NOW_PAUSE_S,
                        exc_info=True)
            return
        self.marks.confirm((tenant,), sent)

    async def reserve(self, request: ReserveRequest, sent: SentReserve | None = None,
                      ) -> Reservation:
        """`sent`: this request's script call already written (send_reserve(request)), whose
        reply this waits for; the same Reservation as without it."""
        if sent is not None:
            return await self._reserve(request, sent)
        self.marks.add(request.tenant)
        if self.marks.unconfirmed(request.tenant):
            await self._mark_now(request.tenant)
        return await self._reserve(request, None)

    def send_reserve(self, request: ReserveRequest) -> SentReserve | None:
        """reserve(request)'s script call written to Redis now, on a free script connection;
        reserve(request, sent) waits for its Reservation. The gateway starts the call's own
        task between the two, while Redis runs the script. None when it cannot be sent so (the
        tenant's activity mark must be written first, no free script connection, a cluster):
        reserve(request) then. The caller must hand a SentReserve to reserve (in a task made
        before it awaits anything): its connection stays taken until then."""
        tenant = request.tenant
        if self.marks.unconfirmed(tenant):
            return None
        pool = self._script_pool
        if pool is None or not pool.free:
            return None  # checked before the packing: reserve() would pack it again
        call = self._calls.reserve(request)
        if not call.command:
            return None
        sent = pool.send_now(call.command)
        if sent is None:
            return None
        self.marks.add(tenant)
        return SentReserve(call, sent)

    async def _reserve(self, request: ReserveRequest, sent: SentReserve | None) -> Reservation:
        for _ in range(_MAX_CLOCK_RETRIES):
            if sent is not None:
                call = sent.call
                reply = await self._run_packed("reserve", call.command, lambda: call.keys,
                                               call.args, sent=sent.sent)
                sent = None  # a retry (the clock moved on) computes its windows again
            else:
                call = self._calls.reserve(request)
                reply = await self._run_reserve(call)
            result = self._calls.reserve_reply(call, reply)
            if result is _DUPLICATE:
                with _store_errors():
                    record = await self.client.hmget(call.keys[0], _HOLD_FIELDS)
                return self._calls.recovered(call, record)
            if result is not None:
                return result
        raise QuotaClockError("the Redis clock kept moving out of the computed window")

    async def settle(self, hold: Hold, actual: int, event: str = "", actual_money: int = 0,
                     packed: PackedSettle | None = None, sent: Sent | None = None,
                     ) -> SettleResult:
        """`packed`: this hold's settle packed ahead (packed_settle), sent as it is on the
        script connections; the same script call as without it. `sent`: this very settle
        already written (send_settle with the same figures), whose reply this waits for."""
        args = self._calls.settle_args(hold, actual, event, actual_money)
        if sent is not None:
            outcome, held, charged = await self._run_packed(
                "settle", sent.command, lambda: self._calls.end_keys(hold), args, sent=sent)
        elif (packed is not None and packed.hold is hold and packed.source is self._calls
                and type(event) is str):
            self.marks.add(hold.tenant)
            outcome, held, charged = await self._run_packed(
                "settle", packed.command(actual, event, actual_money),
                lambda: self._calls.end_keys(hold), args)
        else:
            self.marks.add(hold.tenant)
            outcome, held, charged = await self._run("settle", self._calls.end_keys(hold), args)
        return SettleResult(hold.request_id, _str(outcome), int(held), int(charged))

    def send_settle(self, hold: Hold, actual: int, event: str, actual_money: int,
                    packed: PackedSettle | None) -> Sent | None:
        """settle(hold, actual, event, actual_money, packed)'s command written to Redis now, on
        a free script connection; settle(..., sent=) waits for its result. The gateway makes
        its answer between the two, while Redis runs the script. None when it cannot be sent
        so (no packed command of this engine's, no free script connection): settle() alone
        then. The caller must hand what it returns to settle (in a task made before it awaits
        anything): its connection stays taken until then."""
        self._calls.settle_args(hold, actual, event, actual_money)  # refused as settle() would
        if (packed is None or packed.hold is not hold or packed.source is not self._calls
                or type(event) is not str):
            return None
        pool = self._script_pool
        if pool is None:
            return None
        sent = pool.send_now(packed.command(actual, event, actual_money))
        if sent is not None:
            self.marks.add(hold.tenant)
        return sent

    def packed_settle(self, hold: Hold) -> PackedSettle | None:
        """`hold`'s settle command packed but for the figures only its end knows (settle's
        `packed`): for the gateway to make while its call waits for the upstream. None where
        the scripts do not go on the script connections."""
        if self._script_pool is None:
            return None
        return self._calls.packed_settle(hold, self._scripts["settle"].sha)

    async def release(self, hold: Hold, event: str = "") -> ReleaseResult:
        args = self._calls.release_args(hold, event)
        self.marks.add(hold.tenant)
        outcome, released, held = await self._run("release", self._calls.end_keys(hold), args)
        return ReleaseResult(hold.request_id, _str(outcome), int(released), int(held))

    async def progress(self, hold: Hold, phase: Phase, output_tokens: int = 0,
                       upstream: int | None = None) -> str:
        """See QuotaEngine.progress: one round trip, off the short-call hot path."""
        reply = await self._run("progress", [keys.hold_key(hold.tenant, hold.request_id)],
                                _progress_args(phase, output_tokens, upstream))
        return _str(reply[0])

    async def append_unmetered(self, tenant: str, request_id: str, *, actual: int,
                               created_ms: int, ended_ms: int, meta: str = "",
                               event: str = "") -> None:
        """See QuotaEngine.append_unmetered."""
        fields = _unmetered_fields(request_id, actual, created_ms, ended_ms, meta, event)
        self.marks.add(tenant)
        with _store_errors():
            await self.client.xadd(keys.usage_stream_key(tenant), fields)

    async def take_capacity(self, provider_key_id: int, rpm: int | None, tpm: int | None,
                            tokens: int, wait: CapacityWait | None = None) -> CapacityResult:
        """See QuotaEngine.take_capacity."""
        call_keys, args = _capacity_call(provider_key_id, rpm, tpm, tokens, wait)
        return _capacity_result(await self._run("provider_take", call_keys, args),
                                provider_key_id)

    async def leave_capacity_queue(self, provider_key_id: int, waiter_id: str,
                                   lease_ms: int) -> bool:
        """Take a waiter out of an upstream key's queue (timed out, client gone)."""
        call_keys, args = _capacity_leave_call(provider_key_id, waiter_id, lease_ms)
        removed, _ = await self._run("queue_leave", call_keys, args)
        return int(removed) == 1

    async def leave_queue(self, tenant: str, request_id: str, queue_key: str,
                          lease_ms: int) -> bool:
        """See QuotaEngine.leave_queue."""
        call_keys, args = self._calls.leave_call(tenant, request_id, queue_key, lease_ms)
        removed, _ = await self._run("queue_leave", call_keys, args)
        return int(removed) == 1

    async def counter(
        self, tenant: str, scope: str, kind: WindowKind = WindowKind.DAY, *, schedule: CycleSchedule = UTC_MONTHLY
    ) -> CounterSnapshot:
        key = self._calls.counter_key_now(tenant, scope, kind, schedule)
        with _store_errors():
            fields = await self.client.hmget(key, _COUNTER_FIELDS)
            ttl = await self.client.ttl(key)
        return _snapshot(key, fields, ttl)
