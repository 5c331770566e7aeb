"""The Redis side of cache invalidation: publishes tenants/invalidation.py's messages on the
pub/sub channel every gateway process listens to (gateway/listener.py).

tenants/ sits below quotas/ and imports nothing from it, so the tenants app only says what
changed; this module, which owns the Redis clients, is plugged in as its transport when the apps
are ready (quotas/apps.py).
"""
from __future__ import annotations

import json

from quotas.client import make_redis
from quotas.keys import INVALIDATION_CHANNEL


def publish_invalidation(kind: str, ident: int | None) -> None:
    """Publish one message, {"kind": ..., "id": ...}, on a connection of its own. Raises when
    Redis cannot be reached (tenants.invalidation logs it)."""
    client = make_redis()
    try:
        client.publish(INVALIDATION_CHANNEL, json.dumps({"kind": kind, "id": ident}))
    finally:
        client.close()
