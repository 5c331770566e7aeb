"""Background jobs of the quota engine (scheduled in config/settings.py CELERY_BEAT_SCHEDULE)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from celery import shared_task

from quotas import active
from quotas.keys import tenant_tag
from quotas.runtime import get_engine

log = logging.getLogger(__name__)

# Told how many holds each sweep ended: gateway.apps installs the request metrics' counter
# (tollgate_holds_total{event="swept"}) here, since quotas/ cannot import gateway/.
_swept_observer: Callable[[int], None] | None = None


def set_swept_observer(observer: Callable[[int], None] | None) -> None:
    global _swept_observer
    _swept_observer = observer


@shared_task
def sweep_stale_holds() -> int:
    """End holds older than QUOTA_STALE_HOLD_SECONDS, in bounded batches, charging what each
    hold knew of its call (nothing if never forwarded, the whole hold for a forwarded call,
    input plus the last checkpoint for a stream: lua/sweep.lua).

    The tenants of the index of active tenants only (quotas/active.py; a tenant with an open
    hold stays in it), so an idle tenant costs nothing; on the job's full walk
    (TOLLGATE_ACTIVE_FULL_WALK_SECONDS, or at once when the index was lost) every tenant in
    PostgreSQL is probed for open holds, pipelined, and those with some are marked again (a
    gateway worker killed before its flush). The keyspace is never scanned. Then the index
    forgets the tenants idle for TOLLGATE_ACTIVE_RETENTION_SECONDS. Two workers running this at
    once are harmless: the sweep script ends a hold only while it is open, exactly once, and a
    removal from the index never drops a tenant marked since. Each swept hold leaves a usage
    event, which the ledger drain records with status "swept".
    """
    engine = get_engine()
    client = engine.client
    settings = active.ActiveSettings.from_django()
    run = active.visit(client, active.SWEEP, settings)
    if run.full:
        # Holds only: the drain's own full walk finds (and marks) the streams with events.
        work = active.probe(client, list(run.tenants), events=False)
        active.remark_busy(client, work, settings.shards)
        tenant_ids = [tenant_id for tenant_id, found in work.items() if found.holds]
    else:
        tenant_ids = list(run.tenants)
    swept = 0
    for tenant_id in tenant_ids:
        swept += len(engine.sweep(tenant_tag(tenant_id)).swept)
    forgotten = active.forget_idle(client, run, settings)
    active.walked(client, run, settings)
    if forgotten:
        log.info("%d idle tenants left the index of active tenants", forgotten)
    if swept:
        log.warning("swept %d stale holds (gateway processes that never ended them)", swept)
        if _swept_observer is not None:
            _swept_observer(swept)
    return swept
