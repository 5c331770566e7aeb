"""Rate and quota headers on every /v1 response, in OpenAI's names where they exist.

`x-tollgate-queue-wait-ms` is on every admitted call of a tenant under the queue policy: how long
it waited in the queue (0 when it did not). `x-ratelimit-*-requests` describe the first
request-rate bucket of the call (the tenant's requests per second, else the key's per minute);
`x-ratelimit-*-tokens` describe the tightest limited token counter after this call's hold. Resets
use OpenAI's duration format ("1s", "6m0s", "13h2m5s").

Calls of the Messages API get the same figures in Anthropic's names instead
(`anthropic-ratelimit-requests-*`, `anthropic-ratelimit-tokens-*`, resets as RFC 3339 instants),
so clients written for Anthropic read them where they look.
"""
from __future__ import annotations

from datetime import UTC, datetime

from gateway.auth import KeyContext
from quotas.engine import UNLIMITED, Reservation, Unit
from tenants.models import OverQuotaPolicy

QUEUE_WAIT_HEADER = "x-tollgate-queue-wait-ms"


def duration(ms: int) -> str:
    ms = max(0, ms)
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _instant(ms: int) -> str:
    """An RFC 3339 instant (Anthropic's reset format), to the second."""
    return datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rate_headers(ctx: KeyContext, reservation: Reservation,
                 anthropic: bool = False) -> dict[str, str]:
    headers: dict[str, str] = {}
    if ctx.limits.over_quota_policy == OverQuotaPolicy.QUEUE:
        headers[QUEUE_WAIT_HEADER] = str(reservation.queue_wait_ms)
    now_ms = reservation.server_time_ms
    rates = ctx.rates
    if rates and reservation.rate_remaining:
        rate, left = rates[0], reservation.rate_remaining[0]
        # Time for the bucket to refill from what is left to full.
        refill_ms = (rate.capacity - left) * rate.period_ms // rate.capacity
        if anthropic:
            headers["anthropic-ratelimit-requests-limit"] = str(rate.capacity)
            headers["anthropic-ratelimit-requests-remaining"] = str(left)
            headers["anthropic-ratelimit-requests-reset"] = _instant(now_ms + refill_ms)
        else:
            headers["x-ratelimit-limit-requests"] = str(rate.capacity)
            headers["x-ratelimit-remaining-requests"] = str(left)
            headers["x-ratelimit-reset-requests"] = duration(refill_ms)
    limited = [c for c in reservation.counters
               if c.limit != UNLIMITED and c.unit in (Unit.TOKENS, Unit.POOL)]
    if limited:
        tightest = min(limited, key=lambda c: c.remaining)
        if anthropic:
            headers["anthropic-ratelimit-tokens-limit"] = str(tightest.limit)
            headers["anthropic-ratelimit-tokens-remaining"] = str(max(0, tightest.remaining))
            headers["anthropic-ratelimit-tokens-reset"] = _instant(tightest.window.end_ms)
        else:
            headers["x-ratelimit-limit-tokens"] = str(tightest.limit)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, tightest.remaining))
            headers["x-ratelimit-reset-tokens"] = duration(tightest.window.end_ms - now_ms)
    return headers
