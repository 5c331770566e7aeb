"""Management API tokens: issuing one (its plaintext exists once, in the IssuedToken returned),
revoking it, and finding the live token a bearer plaintext stands for.

What a token may do is narrowed twice: its scope (read < keys < full, ManagementToken.Scope,
checked by the API per view) and its life: a token expires DEFAULT_LIFETIME after issue unless
the issuer picks another date or explicitly none. A token issued by a console user (or by a token
that one issued) carries `issued_by`, so it dies with that user's admin rights in the tenant
(revoke_member_tokens, called by tenants.membership) or with the user.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Final, Literal

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants.api_key_format import digests_match
from tenants.management_tokens import generate_token, masked_token, parse_token
from tenants.access import ADMIN_ROLES
from tenants.models import SCOPE_ORDER, ManagementToken, Membership, Tenant
from tenants.services._base import Entity, clean, record_change

# A token nobody remembers to revoke should still stop working: 90 days unless chosen otherwise.
DEFAULT_LIFETIME: Final = timedelta(days=90)


class _Default(Enum):
    LIFETIME = "default lifetime"


# `expires_at=DEFAULT_EXPIRY` (the default): DEFAULT_LIFETIME from now; None: never expires.
DEFAULT_EXPIRY: Final[Literal[_Default.LIFETIME]] = _Default.LIFETIME

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


def _expiry(
    expires_at: datetime | None | _Default, parent: ManagementToken | None, now: datetime
) -> datetime | None:
    """The expiry to store: the default lifetime, the caller's date or none; never after the
    expiry of the token that issues this one (a token cannot outlive its issuer)."""
    chosen = now + DEFAULT_LIFETIME if expires_at is DEFAULT_EXPIRY else expires_at
    if chosen is not None and chosen <= now:
        raise ValidationError({"expires_at": ["Must be in the future."]})
    ceiling = parent.expires_at if parent is not None else None
    if ceiling is None:
        return chosen
    if expires_at is DEFAULT_EXPIRY:
        return min(chosen, ceiling)  # type: ignore[type-var]
    if chosen is None or chosen > ceiling:
        raise ValidationError({"expires_at": [
            f"A token cannot outlive the token that issues it (it expires {ceiling.isoformat()})."
        ]})
    return chosen


def _lock_issuer_rights(tenant: Tenant, user: Any) -> None:
    """The issuing user may still change the tenant, and stays so until this transaction ends:
    their membership row is locked, the row tenants.membership locks to remove or demote them,
    so a removal either commits first (and this issue is refused) or waits and revokes the new
    token with the others. Operators (staff) are not members."""
    if user.is_staff and user.is_active:
        return
    role = (Membership.objects.select_for_update().filter(tenant=tenant, user=user)
            .values_list("role", flat=True).first())
    if role not in ADMIN_ROLES or not user.is_active:
        raise ValidationError({"non_field_errors": [
            "The issuing user may no longer change this tenant."]})


def issue_management_token(
    tenant: Tenant | None, *, name: str, actor: str,
    scope: str = ManagementToken.Scope.FULL,
    expires_at: datetime | None | _Default = DEFAULT_EXPIRY,
    issued_by: Any = None, parent: ManagementToken | None = None,
) -> IssuedToken:
    """A bearer token for /api/: scoped to `tenant` (as its admin, narrowed by `scope`), or an
    operator token that sees every tenant when `tenant` is None.

    `issued_by` is the console user issuing it (None from the CLI); `parent` the token issuing
    it through the API, whose user, scope and expiry bound the new one's.
    """
    if not name.strip():
        raise ValueError("A management token needs a name (what it is for).")
    if scope not in SCOPE_ORDER:
        raise ValidationError({"scope": [f"Choose one of: {', '.join(SCOPE_ORDER)}."]})
    if parent is not None:
        if not parent.allows(scope):
            raise ValidationError({"scope": [
                f"A '{parent.scope}' token cannot issue a '{scope}' token."]})
        issued_by = parent.issued_by
    now = timezone.now()
    expiry = _expiry(expires_at, parent, now)
    plaintext, prefix, digest, last4 = generate_token()
    with transaction.atomic():
        if tenant is not None and issued_by is not None:
            _lock_issuer_rights(tenant, issued_by)
        token = ManagementToken(
            tenant=tenant, name=name.strip(), prefix=prefix, digest=digest, last4=last4,
            created_by=actor, expires_at=expiry, scope=scope, issued_by=issued_by,
        )
        clean(token)
        token.save(force_insert=True)
        record_change(
            MANAGEMENT_TOKEN, token, actor=actor, action="token.issued",
            data={"name": token.name, "masked": masked_token(prefix, last4),
                  "operator": tenant is None, "scope": scope,
                  "expires_at": expiry.isoformat() if expiry else None},
        )
    return IssuedToken(token=token, plaintext=plaintext)


def revoke_management_token(token: ManagementToken, *, actor: str,
                            reason: str | None = None) -> bool:
    """True if this call revoked the token, False if it already was revoked."""
    with transaction.atomic():
        now = timezone.now()
        changed = ManagementToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if changed:
            token.revoked_at = now
            data = {"name": token.name, **({"reason": reason} if reason else {})}
            record_change(MANAGEMENT_TOKEN, token, actor=actor, action="token.revoked",
                          data=data)
    return bool(changed)


def revoke_member_tokens(tenant: Tenant, user: Any, *, actor: str, reason: str) -> int:
    """Revoke every live token of `tenant` that carries `user`'s rights (issued by them, or by
    a token of theirs); the number revoked. Run inside the caller's transaction, so a member
    removal and the revocation of their tokens commit together."""
    live = ManagementToken.objects.select_related("tenant").filter(
        tenant=tenant, issued_by=user, revoked_at__isnull=True)
    return sum(revoke_management_token(token, actor=actor, reason=reason) for token in live)


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
        ManagementToken.objects.select_related("tenant", "issued_by")
        .filter(prefix=prefix, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if token is None or not digests_match(plaintext, token.digest):
        return None
    if token.issued_by is not None and not token.issued_by.is_active:
        return None  # a deactivated user's tokens stop with their logins
    if token.last_used_at is None or now - token.last_used_at > _TOUCH_EVERY:
        ManagementToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
