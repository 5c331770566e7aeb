"""Whether an API key may authenticate a call: the one rule, as a pure function of the rows.

Used by the gateway's auth path (gateway/auth.py: the cached KeyContext keeps the deadline this
computes and compares it on every call), by the services (rotating or editing a revoked or
expired key is refused) and by the listings (a key's status). It reads only the rows it is given,
never queries and never writes, so it costs nothing on the hot path and tests can call it on
unsaved instances.

A key authenticates through one of its secrets when
- neither the key nor that secret is revoked,
- its tenant is active (when the tenant is given: listings and the services leave it out),
- the moment is before the key's expiry and before the secret's: a secret's expiry is the end
  of a rotation's grace period (tenants.services.api_keys.rotate_key).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from tenants.models import ApiKey, ApiKeySecret, Tenant


@dataclass(frozen=True)
class KeyUsability:
    revoked: bool  # the key, or the secret looked at, is revoked
    tenant_inactive: bool  # the tenant given is suspended (False when no tenant was given)
    until: datetime | None  # exclusive: the earlier of the key's and the secret's expiry

    @property
    def refused(self) -> bool:
        """Unusable whatever the time: revoked, or the tenant is not active."""
        return self.revoked or self.tenant_inactive

    def expired_at(self, now: datetime) -> bool:
        return self.until is not None and now >= self.until

    def usable_at(self, now: datetime) -> bool:
        return not self.refused and not self.expired_at(now)

    def status(self, now: datetime) -> str:
        """revoked / expired / active, as the listings show a key (tenants.selectors)."""
        if self.revoked:
            return "revoked"
        if self.expired_at(now):
            return "expired"
        return "active"


def key_usability(
    api_key: ApiKey, secret: ApiKeySecret | None = None, *, tenant: Tenant | None = None
) -> KeyUsability:
    """The key's usability through `secret` (None: the key alone), with `tenant`'s status when
    given (authentication passes the key's tenant; listings and the services about the key
    itself do not)."""
    revoked = api_key.revoked_at is not None or (
        secret is not None and secret.revoked_at is not None
    )
    ends = [
        moment
        for moment in (api_key.expires_at, secret.expires_at if secret is not None else None)
        if moment is not None
    ]
    return KeyUsability(
        revoked=revoked,
        tenant_inactive=tenant is not None and tenant.status != Tenant.Status.ACTIVE,
        until=min(ends) if ends else None,
    )


def in_rotation(api_key: ApiKey, secrets: Iterable[ApiKeySecret], now: datetime) -> bool:
    """Whether the key is usable at `now` through more than one of `secrets`: a rotation's
    previous secret is still in its grace period (tenants.services.api_keys.rotate_key), so
    clients may still be calling with it. The listings' "rotating" filter
    (tenants.selectors.search_keys) selects the same keys in SQL: active, and at least two
    secrets neither revoked nor past their own expiry."""
    if not key_usability(api_key).usable_at(now):
        return False
    usable = sum(1 for secret in secrets if key_usability(api_key, secret).usable_at(now))
    return usable > 1
