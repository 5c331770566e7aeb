"""Background jobs of the ledger (scheduled in config/settings.py CELERY_BEAT_SCHEDULE)."""
from __future__ import annotations

import logging

from celery import shared_task

from billing.ledger import drain_all
from quotas.runtime import get_engine

log = logging.getLogger(__name__)


@shared_task
def drain_usage() -> int:
    """Move the gateway's usage events into the ledger. Idempotent (unique request ids), and
    safe on several workers: a batch drained twice inserts nothing the second time."""
    result = drain_all(get_engine().client)
    if result.events:
        log.info("recorded %d usage events of %d tenants", result.events, result.tenants)
    return result.events
