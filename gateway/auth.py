"""API key authentication for /v1 from an in-process cache.

The hot path makes no database query: a key is looked up once (one query), kept as an immutable
`KeyContext`, and re-checked on every request in memory (HMAC digest in constant time, secret and
key expiry). Changes reach the cache through Redis pub/sub (tenants/invalidation.py,
gateway/listener.py); while the subscription is down the cache is bypassed, so a revoked key can
never outlive its revocation by more than the pub/sub latency.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime


from quotas import keys as quota_keys
from quotas.engine import ConcurrencyLimit, RateLimit, ScopeLimit
from quotas.keys import tenant_tag
from quotas.limits import request_limits
from tenants.api_key_format import digests_match, parse_key
from tenants.key_usability import key_usability
from tenants.models import ApiKey, Project
from tenants.selectors import EffectiveLimits, allowed_models_for_key, effective_limits, secret_by_prefix


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
                                    model)
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
    )


_MISSING = object()


Loader = Callable[[str], Awaitable["KeyContext | None"]]


class AuthCache:
    """Prefix -> KeyContext (or None for a prefix known to be unusable), per process.

    Concurrent misses of one prefix share one database query: a burst of requests with a key
    not yet cached must not open a connection each.
    """

    def __init__(self, max_age_s: float, load: Loader, max_entries: int = 100_000) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self.trusted = False  # set by the pub/sub listener while it is subscribed
        self._load = load
        self._entries: dict[str, tuple[float, KeyContext | None]] = {}
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
        context = await self._load(prefix)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # crude bound: a refill costs one query per live key
        self._entries[prefix] = (now, context)
        return context

    def _finished(self, prefix: str, task: asyncio.Task[KeyContext | None]) -> None:
        self._loading.pop(prefix, None)
        if not task.cancelled():
            task.exception()  # retrieved even if every waiter has gone

    async def authenticate(self, plaintext: str) -> KeyContext | None:
        prefix = parse_key(plaintext)
        if prefix is None:
            return None
        now = time.time()
        entry = self._entries.get(prefix, _MISSING) if self.trusted else _MISSING
        if entry is _MISSING or now - entry[0] > self.max_age_s:
            context = await self._lookup(prefix, now)
        else:
            context = entry[1]
        if context is None or not context.admits(plaintext, now):
            return None
        return context

    def forget_key(self, api_key_id: int) -> None:
        self._drop(lambda c: c.api_key.pk == api_key_id)

    def forget_tenant(self, tenant_id: int) -> None:
        self._drop(lambda c: c.tenant_id == tenant_id)

    def clear(self) -> None:
        self._entries.clear()

    def _drop(self, matches) -> None:  # type: ignore[no-untyped-def]
        for prefix, (_, context) in list(self._entries.items()):
            # Unknown prefixes (None) may have been issued since: drop them too.
            if context is None or matches(context):
                self._entries.pop(prefix, None)
