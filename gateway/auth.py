"""API key authentication for /v1 from an in-process cache.

The hot path makes no database query: a key is looked up once (one query), kept as an immutable
`KeyContext`, and re-checked on every request in memory (HMAC digest in constant time, secret and
key expiry). Changes reach the cache through Redis pub/sub (tenants/invalidation.py,
gateway/listener.py), backed by a version counter the listener checks once a second; while the
subscription is down or the version cannot be read the cache is bypassed. A lookup that was in
flight when an invalidation arrived is not kept (`generation`).

Unauthenticated load is bounded: unknown keys are remembered briefly in a store of their own
(so a flood of random keys evicts no real key), known keys are evicted least recently used
first, and database lookups of keys not known are limited per client address (a token bucket
per address, in process): beyond it, 429 without a query.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from django.conf import settings

from gateway.client_address import rate_limit_key
from gateway.errors import rate_limited
from quotas import keys as quota_keys
from quotas.cycles import schedule_for
from quotas.engine import ConcurrencyLimit, RateLimit, ScopeLimit
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from quotas.windows import UTC_MONTHLY, CycleSchedule
from tenants.api_key_format import digests_match, parse_key
from tenants.key_usability import key_usability
from tenants.models import ApiKey, Project
from tenants.selectors import (
    NO_ALLOTMENTS,
    AllotmentSums,
    EffectiveLimits,
    allotments_of,
    allowed_models_for_key,
    effective_limits,
    secret_by_prefix,
)

_MAX_MODELS_PER_KEY = 256


@dataclass(frozen=True)
class KeyContext:
    """Everything the hot path needs to know about the caller, frozen at lookup time."""

    digest: str
    valid_until: float | None  # epoch seconds: the earlier of secret and key expiry
    api_key: ApiKey
    project: Project
    tenant_id: int
    tenant_tag: str
    limits: EffectiveLimits
    allowed_models: frozenset[str] | None  # None: every model
    # The tenant's allotment sums, read with the key (quotas.limits.allotment_chain).
    allotments: AllotmentSums = NO_ALLOTMENTS
    # The tenant's windows (its day and cycle in its time zone, and a pending change):
    # quotas.cycles.schedule_for at lookup. A change of cycle publishes the tenant's
    # invalidation, which drops this context on every gateway.
    schedule: CycleSchedule = UTC_MONTHLY
    _scopes: dict[str, tuple[ScopeLimit, ...]] = field(default_factory=dict, compare=False)

    def allows(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def admits(self, plaintext: str, now: float) -> bool:
        """Whether `plaintext` is this context's secret (constant-time digest comparison) and
        `now` (epoch seconds) is before the deadline tenants.key_usability gave it."""
        if not digests_match(plaintext, self.digest):
            return False
        return self.valid_until is None or now < self.valid_until

    def scopes(self, model: str) -> tuple[ScopeLimit, ...]:
        """The quota counters of a call of `model` (quotas.limits.request_counters), memoised
        per model. The project's tenant was loaded with the key (load_key_context)."""
        cached = self._scopes.get(model)
        if cached is None:
            if len(self._scopes) >= _MAX_MODELS_PER_KEY:
                self._scopes.clear()  # bounded: clients may send any model name
            cached = request_limits(self.project.tenant, self.limits, self.project, self.api_key,
                                    model, self.allotments)
            self._scopes[model] = cached
        return cached

    @cached_property
    def rates(self) -> tuple[RateLimit, ...]:
        rates = []
        if self.limits.requests_per_second > 0:
            rates.append(RateLimit(quota_keys.tenant_scope(), self.limits.requests_per_second, 1000))
        rpm = self.api_key.requests_per_minute
        if rpm:
            rates.append(RateLimit(quota_keys.api_key_scope(self.api_key.pk), rpm, 60_000))
        return tuple(rates)

    def request_rate_blocked(self) -> bool:
        """A plan or key rate of 0 admits nothing (a bucket cannot have zero capacity)."""
        return self.limits.requests_per_second == 0 or self.api_key.requests_per_minute == 0

    @cached_property
    def concurrency(self) -> ConcurrencyLimit | None:
        cap = self.api_key.max_concurrency
        if cap is None:
            return None
        return ConcurrencyLimit(quota_keys.api_key_scope(self.api_key.pk), cap)


def _epoch(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment is not None else None


def load_key_context(prefix: str) -> KeyContext | None:
    """One query: the context of the secret with this prefix, or None if it cannot be used
    whatever the time (tenants.key_usability decides; the context keeps its deadline)."""
    secret = secret_by_prefix(prefix)
    if secret is None:
        return None
    api_key = secret.api_key
    tenant = api_key.project.tenant
    usability = key_usability(api_key, secret, tenant=tenant)
    if usability.refused:
        return None
    allowed = allowed_models_for_key(api_key)
    return KeyContext(
        digest=secret.digest,
        valid_until=_epoch(usability.until),
        api_key=api_key,
        project=api_key.project,
        tenant_id=tenant.pk,
        tenant_tag=tenant_tag(tenant.pk),
        limits=effective_limits(tenant),
        allowed_models=frozenset(allowed) if allowed is not None else None,
        allotments=allotments_of(secret),
        schedule=schedule_for(tenant),
    )


_MISSING = object()


Loader = Callable[[str], Awaitable["KeyContext | None"]]


class LookupThrottle:
    """A token bucket per client address for database lookups of keys not cached: `rate` per
    second, up to `burst` at once. At most `max_clients` addresses are tracked (the least
    recently seen forgotten first: a forgotten address starts again with a full bucket, which
    bounds memory, not the rate of any one address)."""

    def __init__(self, rate: float, burst: int, max_clients: int) -> None:
        self.rate = rate
        self.burst = burst
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def take(self, client: str, now: float) -> float:
        """Take one lookup for `client`: 0.0 if allowed, else seconds until one is."""
        tokens, at = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate if self.rate > 0 else 60.0
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


class AuthCache:
    """Prefix -> KeyContext, per process; unusable prefixes in a short-lived store of their own.

    Concurrent misses of one prefix share one database query: a burst of requests with a key
    not yet cached must not open a connection each.
    """

    def __init__(self, max_age_s: float, load: Loader, max_entries: int | None = None, *,
                 negative_ttl_s: float | None = None, max_negative: int | None = None,
                 lookups_per_second: float | None = None, lookup_burst: int | None = None,
                 lookup_max_clients: int | None = None) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries or settings.GATEWAY_AUTH_CACHE_MAX_KEYS
        self.negative_ttl_s = (settings.GATEWAY_AUTH_NEGATIVE_TTL_SECONDS
                               if negative_ttl_s is None else negative_ttl_s)
        self.max_negative = max_negative or settings.GATEWAY_AUTH_NEGATIVE_MAX_KEYS
        self.throttle = LookupThrottle(
            settings.GATEWAY_AUTH_LOOKUPS_PER_SECOND if lookups_per_second is None
            else lookups_per_second,
            lookup_burst or settings.GATEWAY_AUTH_LOOKUP_BURST,
            lookup_max_clients or settings.GATEWAY_AUTH_LOOKUP_MAX_CLIENTS)
        # Until when (epoch seconds) the cache may be used: the pub/sub listener extends it
        # each time it confirms the version (gateway/listener.py); 0: bypassed.
        self.trusted_until = 0.0
        # Bumped by every invalidation: a lookup that saw it move while its query ran is stale.
        self.generation = 0
        self._load = load
        self._entries: OrderedDict[str, tuple[float, KeyContext]] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()  # prefix -> when looked up
        # Prefixes that authenticated here, kept through invalidations (same bound, LRU) until
        # a lookup finds them unusable: their lookups are never throttled, so emptying the
        # cache (a plan change, a lost message) cannot turn into 429s for real clients sharing
        # an address.
        self._known: OrderedDict[str, None] = OrderedDict()
        self._loading: dict[str, asyncio.Task[KeyContext | None]] = {}

    async def _lookup(self, prefix: str, now: float) -> KeyContext | None:
        # The load runs as a task of its own: a caller that is cancelled (its client left) must
        # not cancel it for the other callers waiting on the same key.
        task = self._loading.get(prefix)
        if task is None:
            task = asyncio.ensure_future(self._load_and_keep(prefix, now))
            self._loading[prefix] = task
            task.add_done_callback(lambda done: self._finished(prefix, done))
        return await asyncio.shield(task)

    async def _load_and_keep(self, prefix: str, now: float) -> KeyContext | None:
        generation = self.generation
        context = await self._load(prefix)
        # An invalidation processed while the query ran may be about this key, and the query
        # may have read the row before the change committed: answer this caller, keep nothing.
        if generation == self.generation:
            self._keep(prefix, now, context)
        return context

    def _keep(self, prefix: str, now: float, context: KeyContext | None) -> None:
        if context is None:
            # The key was valid here once and is not now (revoked, expired, suspended while no
            # message reached this worker): its old entry must go, or _cached would find it
            # past its age on every request and never consult the negative answer. It is not
            # known any more either, so its lookups count against its address like any
            # unknown key's (the exemption is for keys that work, not for ones that used to).
            self._entries.pop(prefix, None)
            self._known.pop(prefix, None)
            self._unknown[prefix] = now
            self._unknown.move_to_end(prefix)
            if len(self._unknown) > self.max_negative:
                self._unknown.popitem(last=False)
            return
        self._unknown.pop(prefix, None)
        self._entries[prefix] = (now, context)
        self._entries.move_to_end(prefix)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)  # the least recently used key
        self._known[prefix] = None
        self._known.move_to_end(prefix)
        if len(self._known) > self.max_entries:
            self._known.popitem(last=False)

    def _finished(self, prefix: str, task: asyncio.Task[KeyContext | None]) -> None:
        if self._loading.get(prefix) is task:  # not a newer lookup started after an invalidation
            del self._loading[prefix]
        if not task.cancelled():
            task.exception()  # retrieved even if every waiter has gone

    def _cached(self, prefix: str, now: float) -> KeyContext | None | object:
        """The cached answer for `prefix` (a context, or None for unusable), or _MISSING."""
        entry = self._entries.get(prefix)
        if entry is not None:
            if now - entry[0] <= self.max_age_s:
                self._entries.move_to_end(prefix)
                return entry[1]
            return _MISSING
        seen = self._unknown.get(prefix)
        if seen is not None and now - seen <= self.negative_ttl_s:
            return None
        return _MISSING

    async def authenticate(self, plaintext: str,
                           client: str | Callable[[], str] | None = None) -> KeyContext | None:
        """The context `plaintext` authenticates as, or None. `client`: the caller's address
        (gateway/client_address.py), or a function that tells it (called only on a lookup, so
        a cached key costs no address parsing); a lookup of a key not known valid here (never
        seen valid, or found unusable since) counts against it, and raises 429 (rate_limited,
        no tenant's refusal) beyond GATEWAY_AUTH_LOOKUPS_PER_SECOND."""
        prefix = parse_key(plaintext)
        if prefix is None:
            return None
        now = time.time()
        context = self._cached(prefix, now) if now < self.trusted_until else _MISSING
        if context is _MISSING:
            # Only new lookups of keys never seen valid here are bounded per address: a key
            # that authenticated before costs its client nothing, nor does joining a lookup
            # already in flight (a client's first burst with a new key is one query).
            if (client is not None and prefix not in self._known
                    and prefix not in self._loading):
                address = client() if callable(client) else client
                wait = self.throttle.take(rate_limit_key(address), now)
                if wait > 0:
                    raise rate_limited("Too many API key lookups from your address; retry "
                                       "shortly.", max(1, math.ceil(wait)), refusal=None)
            context = await self._lookup(prefix, now)
        if context is None or not context.admits(plaintext, now):  # type: ignore[union-attr]
            return None
        return context  # type: ignore[return-value]

    @property
    def trusted(self) -> bool:
        return time.time() < self.trusted_until

    def trust_for(self, seconds: float) -> None:
        self.trusted_until = time.time() + seconds

    def distrust(self) -> None:
        self.trusted_until = 0.0

    def forget_key(self, api_key_id: int) -> None:
        self._drop(lambda c: c.api_key.pk == api_key_id)

    def forget_tenant(self, tenant_id: int) -> None:
        self._drop(lambda c: c.tenant_id == tenant_id)

    def clear(self) -> None:
        self._invalidated()
        self._entries.clear()

    def _invalidated(self) -> None:
        # Lookups in flight may have read the old row: they keep nothing, and callers arriving
        # from now on start a lookup of their own. Unknown prefixes may have been issued since.
        self.generation += 1
        self._loading.clear()
        self._unknown.clear()

    def _drop(self, matches) -> None:  # type: ignore[no-untyped-def]
        self._invalidated()
        for prefix, (_, context) in list(self._entries.items()):
            if matches(context):
                self._entries.pop(prefix, None)
