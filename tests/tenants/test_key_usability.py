"""The one rule for whether an API key may authenticate (tenants.key_usability), on unsaved rows:
it never queries, so the gateway's auth path, the services and the listings can all ask it."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tenants.key_usability import key_usability
from tenants.models import ApiKey, ApiKeySecret, Tenant

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
LATER = NOW + timedelta(hours=1)


def rows(
    *, key_expires: datetime | None = None, key_revoked: datetime | None = None,
    secret_expires: datetime | None = None, secret_revoked: datetime | None = None,
    status: str = Tenant.Status.ACTIVE,
) -> tuple[ApiKey, ApiKeySecret, Tenant]:
    api_key = ApiKey(expires_at=key_expires, revoked_at=key_revoked)
    secret = ApiKeySecret(expires_at=secret_expires, revoked_at=secret_revoked)
    return api_key, secret, Tenant(status=status)


def test_a_fresh_key_is_usable_for_ever() -> None:
    api_key, secret, tenant = rows()
    usability = key_usability(api_key, secret, tenant=tenant)
    assert usability.until is None and not usability.refused
    assert usability.usable_at(NOW) and usability.usable_at(NOW + timedelta(days=3650))
    assert usability.status(NOW) == "active"


@pytest.mark.parametrize("which", ["key", "secret"])
def test_revoking_the_key_or_its_secret_refuses_it_whatever_the_time(which: str) -> None:
    api_key, secret, tenant = rows(**{f"{which}_revoked": NOW})
    usability = key_usability(api_key, secret, tenant=tenant)
    assert usability.revoked and usability.refused
    assert not usability.usable_at(NOW - timedelta(days=1))
    assert usability.status(NOW) == "revoked"


def test_a_suspended_tenant_refuses_its_keys_only_when_the_tenant_is_asked() -> None:
    api_key, secret, tenant = rows(status=Tenant.Status.SUSPENDED)
    assert key_usability(api_key, secret, tenant=tenant).refused
    # Listings and the services look at the key itself: it is still an active key.
    assert not key_usability(api_key, secret).refused
    assert key_usability(api_key).status(NOW) == "active"


def test_the_earlier_of_key_and_secret_expiry_ends_it() -> None:
    # The secret's expiry is a rotation's grace period; the key's own expiry can come first.
    api_key, secret, tenant = rows(key_expires=LATER, secret_expires=NOW)
    assert key_usability(api_key, secret, tenant=tenant).until == NOW
    api_key, secret, tenant = rows(key_expires=NOW, secret_expires=LATER)
    usability = key_usability(api_key, secret, tenant=tenant)
    assert usability.until == NOW
    assert usability.usable_at(NOW - timedelta(microseconds=1))
    assert not usability.usable_at(NOW)  # the deadline itself is too late
    assert usability.status(NOW) == "expired" and not usability.refused


def test_the_key_alone_ignores_its_secrets_grace() -> None:
    api_key, _, _ = rows(key_expires=LATER)
    usability = key_usability(api_key)
    assert usability.until == LATER and usability.usable_at(NOW)
    assert usability.status(LATER) == "expired"
