"""The Redis side of cache invalidation: publishes tenants/invalidation.py's messages on the
pub/sub channel every gateway process listens to (gateway/listener.py).

Each message is numbered: one script increments the auth version (quotas.keys.auth_version_key)
and publishes {"kind", "id", "v": the new version}, atomically, so a version that moved is a
message that was sent. A gateway that reads a version it has no message for lost the message
and empties its cache (gateway/listener.py).

tenants/ sits below quotas/ and imports nothing from it, so the tenants app only says what
changed; this module, which owns the Redis clients, is plugged in as its transport when the apps
are ready (quotas/apps.py).
"""
from __future__ import annotations

import json

from quotas.client import make_redis
from quotas.keys import INVALIDATION_CHANNEL, auth_version_key

# KEYS[1]: the version; ARGV[1]: the channel, ARGV[2]: the message's JSON without its closing
# brace. Inline, not in lua/: it is no quota operation and no engine registers it.
_PUBLISH_NUMBERED = """
local version = redis.call('INCR', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2] .. ', "v": ' .. version .. '}')
return version
"""


def numbered_message(kind: str, ident: int | None) -> str:
    """The message without its closing brace; the script appends the version."""
    return json.dumps({"kind": kind, "id": ident})[:-1]


def publish_invalidation(kind: str, ident: int | None) -> int:
    """Publish one message, {"kind": ..., "id": ..., "v": ...}, on a connection of its own, and
    return its version. Raises when Redis cannot be reached (tenants.invalidation retries)."""
    client = make_redis()
    try:
        return int(client.eval(_PUBLISH_NUMBERED, 1, auth_version_key(), INVALIDATION_CHANNEL,
                               numbered_message(kind, ident)))
    finally:
        client.close()
