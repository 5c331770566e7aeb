"""Management API tokens: issuing one (its plaintext exists once, in the IssuedToken returned),
revoking it, and finding the live token a bearer plaintext stands for."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants.api_key_format import digests_match
from tenants.management_tokens import generate_token, masked_token, parse_token
from tenants.models import ManagementToken, Tenant
from tenants.services._base import Entity, clean, record_change

MANAGEMENT_TOKEN: Entity[ManagementToken] = Entity(
    lock=lambda token: ManagementToken.objects.select_for_update().get(pk=token.pk),
    tenant=lambda token: token.tenant,  # None for an operator token
    target=lambda token: token.public_id,
    # Tokens are looked up on every /api/ request, never cached: nothing to publish.
)


@dataclass(frozen=True)
class IssuedToken:
    """A management token as returned once at issue: the only place its plaintext exists."""

    token: ManagementToken
    plaintext: str = field(repr=False)


def issue_management_token(
    tenant: Tenant | None, *, name: str, actor: str, expires_at: datetime | None = None
) -> IssuedToken:
    """A bearer token for /api/: scoped to `tenant` (as its admin), or an operator token that
    sees every tenant when `tenant` is None."""
    if not name.strip():
        raise ValueError("A management token needs a name (what it is for).")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    plaintext, prefix, digest, last4 = generate_token()
    with transaction.atomic():
        token = ManagementToken(
            tenant=tenant, name=name.strip(), prefix=prefix, digest=digest, last4=last4,
            created_by=actor, expires_at=expires_at,
        )
        clean(token)
        token.save(force_insert=True)
        record_change(
            MANAGEMENT_TOKEN, token, actor=actor, action="token.issued",
            data={"name": token.name, "masked": masked_token(prefix, last4),
                  "operator": tenant is None,
                  "expires_at": expires_at.isoformat() if expires_at else None},
        )
    return IssuedToken(token=token, plaintext=plaintext)


def revoke_management_token(token: ManagementToken, *, actor: str) -> bool:
    """True if this call revoked the token, False if it already was revoked."""
    with transaction.atomic():
        now = timezone.now()
        changed = ManagementToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if changed:
            token.revoked_at = now
            record_change(MANAGEMENT_TOKEN, token, actor=actor, action="token.revoked",
                          data={"name": token.name})
    return bool(changed)


# last_used_at is for humans ("used 3 minutes ago"); one write a minute per token is plenty.
_TOUCH_EVERY = timedelta(minutes=1)


def authenticate_management_token(plaintext: str) -> ManagementToken | None:
    """The unrevoked, unexpired token whose digest matches `plaintext` (its tenant loaded), or
    None. Records its use (last_used_at) at most once a minute."""
    prefix = parse_token(plaintext)
    if prefix is None:
        return None
    now = timezone.now()
    token = (
        ManagementToken.objects.select_related("tenant")
        .filter(prefix=prefix, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if token is None or not digests_match(plaintext, token.digest):
        return None
    if token.last_used_at is None or now - token.last_used_at > _TOUCH_EVERY:
        ManagementToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
