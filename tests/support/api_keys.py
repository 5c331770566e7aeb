"""Whether the gateway would accept a plaintext API key: its own auth path without the cache
(gateway.auth.load_key_context, then KeyContext.admits), so tests ask the one rule
(tenants.key_usability) the way a /v1 call does."""
from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from gateway.auth import load_key_context
from tenants.api_key_format import parse_key
from tenants.models import ApiKey


def authenticated_key(plaintext: str, *, now: datetime | None = None) -> ApiKey | None:
    """The key a call presenting `plaintext` at `now` (default: now) would be admitted as, with
    its project, tenant and plan loaded (one query); None if it would get a 401."""
    prefix = parse_key(plaintext)
    context = load_key_context(prefix) if prefix is not None else None
    moment = (now or timezone.now()).timestamp()
    if context is None or not context.admits(plaintext, moment):
        return None
    return context.api_key
