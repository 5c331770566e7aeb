"""Count the requests the gateway refuses, per tenant, day (the tenant's) and reason, for the console's
"refused today and why" (read by quotas.status.refused_today).

Only the refusal path pays for it (one pipelined HINCRBY + EXPIRE, in the tenant's hash slot);
admitted requests never touch this. Counting is best effort: a failure is logged and the
client still gets its refusal, never a 500.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from quotas import keys
from quotas.limits import REFUSAL_REASONS
from quotas.status import REFUSED_TTL_SECONDS, day_id
from quotas.windows import UTC_MONTHLY, CycleSchedule

log = logging.getLogger(__name__)

# A refusal answers at once even when Redis is slow: counting gives up after this long.
_COUNT_TIMEOUT_S = 0.5


async def count_refusal(client: Any, tenant_tag: str, reason: str,
                        now_s: float | None = None,
                        schedule: CycleSchedule = UTC_MONTHLY) -> None:
    """HINCRBY the tenant's refused-today hash for `reason` (never raises). `now_s` is the
    gateway's estimate of the Redis clock (one clock, DESIGN.md invariant 6), so a host whose
    clock is off still counts into the day the quota counters are in; `schedule` is the
    tenant's (its day in its time zone: KeyContext.schedule)."""
    if reason not in REFUSAL_REASONS:
        log.warning("not counting a refusal with unknown reason %r", reason)
        return
    key = keys.refused_key(tenant_tag, day_id(schedule, now_s))
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hincrby(key, reason, 1)
        pipe.expire(key, REFUSED_TTL_SECONDS)
        async with asyncio.timeout(_COUNT_TIMEOUT_S):
            await pipe.execute()
    except Exception as exc:  # noqa: BLE001 - a missed count must never fail the response
        log.warning("could not count a %s refusal of tenant %s: %s: %s", reason, tenant_tag,
                    type(exc).__name__, exc)
