"""Tell every gateway process that cached tenancy data changed.

The gateway caches API keys and tenant limits in process memory (its hot path makes no database
query). A revoked or rotated key, a plan change or new limits must reach every process within a
second: the services below publish after their transaction commits, and each gateway process
drops the affected entries when the message arrives (gateway/listener.py). A process that loses
its subscription stops trusting its cache until it has resubscribed, so a missed message can
never keep a revoked key alive.

This module only says what changed. The message travels through a transport set when the apps
are ready: quotas/invalidation.py, which publishes on Redis pub/sub (tenants/ sits below quotas/
and imports nothing from it).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from django.db import transaction

log = logging.getLogger(__name__)

Kind = Literal["api_key", "tenant", "plan", "catalog", "providers"]
Transport = Callable[[str, int | None], None]

_transport: Transport | None = None


def set_transport(transport: Transport) -> None:
    """Install the function that sends a (kind, id) message to every gateway process
    (quotas.apps.QuotasConfig.ready installs Redis pub/sub)."""
    global _transport
    _transport = transport


def _publish_now(kind: Kind, ident: int | None) -> None:
    try:
        if _transport is None:
            raise RuntimeError("no invalidation transport is set (is the quotas app installed?)")
        _transport(kind, ident)
    except Exception:  # noqa: BLE001 - the change is committed; gateways must hear of it somehow
        log.exception(
            "could not publish %s %s invalidation: gateway caches keep it until they resubscribe "
            "or the entry ages out (GATEWAY_AUTH_CACHE_SECONDS)", kind, ident,
        )


def publish(kind: Kind, ident: int | None = None) -> None:
    """Publish once the surrounding transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: _publish_now(kind, ident))
