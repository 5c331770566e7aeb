"""Tell every gateway process that cached tenancy data changed, through Redis pub/sub.

The gateway caches API keys and tenant limits in process memory (its hot path makes no database
query). A revoked or rotated key, a plan change or new limits must reach every process within a
second: the services below publish after their transaction commits, and each gateway process
drops the affected entries when the message arrives (gateway/listener.py). A process that loses
its subscription stops trusting its cache until it has resubscribed, so a missed message can
never keep a revoked key alive.
"""
from __future__ import annotations

import json
import logging
from typing import Literal

from django.db import transaction

CHANNEL = "tg:invalidate"
log = logging.getLogger(__name__)

Kind = Literal["api_key", "tenant", "plan", "catalog", "providers"]


def _publish_now(kind: Kind, ident: int | None) -> None:
    from quotas.client import make_redis

    try:
        client = make_redis()
        try:
            client.publish(CHANNEL, json.dumps({"kind": kind, "id": ident}))
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - the change is committed; gateways must hear of it somehow
        log.exception(
            "could not publish %s %s invalidation: gateway caches keep it until they resubscribe "
            "or the entry ages out (GATEWAY_AUTH_CACHE_SECONDS)", kind, ident,
        )


def publish(kind: Kind, ident: int | None = None) -> None:
    """Publish once the surrounding transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: _publish_now(kind, ident))
