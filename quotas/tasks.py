"""Background jobs of the quota engine (scheduled in config/settings.py CELERY_BEAT_SCHEDULE)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from celery import shared_task

from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from tenants.models import Tenant

log = logging.getLogger(__name__)

# Told how many holds each sweep ended: gateway.apps installs the request metrics' counter
# (tollgate_holds_total{event="swept"}) here, since quotas/ cannot import gateway/.
_swept_observer: Callable[[int], None] | None = None


def set_swept_observer(observer: Callable[[int], None] | None) -> None:
    global _swept_observer
    _swept_observer = observer


@shared_task
def sweep_stale_holds() -> int:
    """End holds older than QUOTA_STALE_HOLD_SECONDS for every tenant, in bounded batches,
    charging what each hold knew of its call (nothing if never forwarded, the whole hold for a
    forwarded call, input plus the last checkpoint for a stream: lua/sweep.lua).

    Tenants come from PostgreSQL, so the keyspace is never scanned. Two workers running this at
    once are harmless: the sweep script ends a hold only while it is open, exactly once. Each
    swept hold leaves a usage event, which the ledger drain records with status "swept".
    """
    engine = get_engine()
    swept = 0
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
        swept += len(engine.sweep(tenant_tag(tenant_id)).swept)
    if swept:
        log.warning("swept %d stale holds (gateway processes that never ended them)", swept)
        if _swept_observer is not None:
            _swept_observer(swept)
    return swept
