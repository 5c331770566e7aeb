"""API keys: issuing one (its plaintext exists once, in the IssuedKey returned), rotating its
secret, revoking it, changing its sub-limits, allotments and models, and recording when keys
were used.

Whether a key may authenticate is decided by tenants.key_usability, the same rule the gateway
applies; these services refuse to rotate or change a key it says is revoked or expired.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants import invalidation
from tenants.api_key_format import generate_key, mask_plaintext
from tenants.exceptions import ApiKeyNotFound, KeyExpired, KeyRevoked
from tenants.key_usability import key_usability
from tenants.models import ApiKey, ApiKeySecret, Project
from tenants.services._base import Entity, check_field_names, clean, record_change, update
from tenants.allotments import ALLOTMENT_FIELDS
from tenants.services.allotments import (
    allotments_changed,
    check_allotments,
    lock_tenant,
    own_limit_errors,
    touches_allotments,
)
from tenants.services.limits import check_key_limits

KEY_EDIT_FIELDS: tuple[str, ...] = (
    "name",
    "tokens_per_day",
    "tokens_per_month",
    "requests_per_minute",
    "max_concurrency",
    "allowed_models",
    "pace_share_percent",
    "pace_spend_micros",
    "allotment_tokens_per_day",
    "allotment_tokens_per_month",
)


@dataclass(frozen=True)
class IssuedKey:
    """A key as returned once at issue or rotation: the only place the plaintext ever exists."""

    api_key: ApiKey
    plaintext: str = field(repr=False)  # kept out of logs and tracebacks

    @property
    def masked(self) -> str:
        return mask_plaintext(self.plaintext)


def _lock_api_key(api_key: ApiKey) -> ApiKey:
    try:
        return (
            ApiKey.objects.select_for_update(of=("self",))
            .select_related("project__tenant")
            .get(pk=api_key.pk)
        )
    except ApiKey.DoesNotExist:
        raise ApiKeyNotFound(api_key.public_id) from None


def _lock_unrevoked_key(api_key: ApiKey) -> ApiKey:
    locked = _lock_api_key(api_key)
    if key_usability(locked).revoked:
        raise ValidationError("This key is revoked; it cannot be changed.")
    return locked


def _one_key(api_key: ApiKey) -> tuple[invalidation.Kind, int]:
    return ("api_key", api_key.pk)  # gateways cache keys by secret


API_KEY: Entity[ApiKey] = Entity(
    lock=_lock_api_key,
    tenant=lambda api_key: api_key.project.tenant,
    target=lambda api_key: api_key.public_id,
    invalidation=_one_key,
)


def _new_secret(api_key: ApiKey) -> tuple[str, ApiKeySecret]:
    plaintext, prefix, digest, last4 = generate_key()
    secret = ApiKeySecret.objects.create(api_key=api_key, prefix=prefix, digest=digest, last4=last4)
    return plaintext, secret


def _tenant_wide(api_key: ApiKey) -> tuple[invalidation.Kind, int]:
    # An allotment of a key changes its tenant's shared pool (or its project's reserve), which
    # every key of the tenant is admitted against: all of them must be dropped, not this one.
    return ("tenant", api_key.project.tenant_id)


def _check_within_project(api_key: ApiKey) -> None:
    check_key_limits(
        api_key.project, tokens_per_day=api_key.tokens_per_day,
        tokens_per_month=api_key.tokens_per_month,
        requests_per_minute=api_key.requests_per_minute, allowed_models=api_key.allowed_models,
    )
    # Row-local: lowering the key's own limit below its allotment is refused too.
    errors = own_limit_errors(api_key)
    if errors:
        raise ValidationError(errors)


def issue_key(
    project: Project,
    *,
    actor: str,
    name: str = "",
    tokens_per_day: int | None = None,
    tokens_per_month: int | None = None,
    requests_per_minute: int | None = None,
    max_concurrency: int | None = None,
    allowed_models: list[str] | None = None,
    expires_at: datetime | None = None,
    pace_share_percent: int | None = None,
    pace_spend_micros: int | None = None,
    allotment_tokens_per_day: int | None = None,
    allotment_tokens_per_month: int | None = None,
    within_limits: bool = False,
) -> IssuedKey:
    """With within_limits=True (the console and the API), sub-limits beyond the project's or the
    tenant's and models outside the plan are refused with a ValidationError naming the field.
    Allotments are always checked (tenants/services/allotments.py), under the tenant's lock."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    if within_limits:
        check_key_limits(
            project, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month,
            requests_per_minute=requests_per_minute, allowed_models=allowed_models or [],
        )
    allotting = allotment_tokens_per_day is not None or allotment_tokens_per_month is not None
    with transaction.atomic():
        locked_tenant = lock_tenant(project.tenant_id) if allotting else None
        api_key = ApiKey(
            project=project,
            name=name,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
            requests_per_minute=requests_per_minute,
            max_concurrency=max_concurrency,
            allowed_models=list(allowed_models or []),
            expires_at=expires_at,
            pace_share_percent=pace_share_percent,
            pace_spend_micros=pace_spend_micros,
            allotment_tokens_per_day=allotment_tokens_per_day,
            allotment_tokens_per_month=allotment_tokens_per_month,
            created_by=actor,
        )
        clean(api_key)
        if locked_tenant is not None:
            check_allotments(locked_tenant, api_key)
        api_key.save(force_insert=True)
        plaintext, secret = _new_secret(api_key)
        record_change(
            API_KEY, api_key, actor=actor, action="key.issued", publish=False,
            data={
                "project": project.public_id,
                "name": name,
                "masked": secret.masked,
                "tokens_per_day": tokens_per_day,
                "tokens_per_month": tokens_per_month,
                "requests_per_minute": requests_per_minute,
                "max_concurrency": max_concurrency,
                "allowed_models": api_key.allowed_models,
                "expires_at": expires_at.isoformat() if expires_at else None,
                **({"pace_share_percent": pace_share_percent} if pace_share_percent else {}),
                **({"pace_spend_micros": pace_spend_micros} if pace_spend_micros else {}),
                **({"allotment_tokens_per_day": allotment_tokens_per_day}
                   if allotment_tokens_per_day is not None else {}),
                **({"allotment_tokens_per_month": allotment_tokens_per_month}
                   if allotment_tokens_per_month is not None else {}),
            },
        )
        if locked_tenant is not None:
            # Its allotment shrinks the shared pool the tenant's other keys draw on.
            invalidation.publish(*_tenant_wide(api_key))
    return IssuedKey(api_key=api_key, plaintext=plaintext)


def rotate_key(api_key: ApiKey, *, actor: str, grace_seconds: int = 0) -> IssuedKey:
    """Give the key a new secret; its previous secrets die now, or after `grace_seconds`.

    The grace period lets a client deploy the new secret before the old one stops working.
    A secret already due to expire sooner (from an earlier rotation) keeps its earlier deadline.
    """
    if grace_seconds < 0:
        raise ValueError("grace_seconds must be >= 0")
    with transaction.atomic():
        locked = _lock_api_key(api_key)
        now = timezone.now()
        usability = key_usability(locked)
        if usability.revoked:
            raise KeyRevoked(locked.public_id)
        if usability.expired_at(now):
            raise KeyExpired(locked.public_id)
        live = locked.secrets.filter(revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )
        previous = live.count()
        valid_until = now + timedelta(seconds=grace_seconds)
        if grace_seconds == 0:
            live.update(revoked_at=now)
        else:
            live.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=valid_until)).update(
                expires_at=valid_until
            )
        plaintext, secret = _new_secret(locked)
        record_change(
            API_KEY, locked, actor=actor, action="key.rotated",
            data={
                "masked": secret.masked,
                "grace_seconds": grace_seconds,
                "previous_secrets": previous,
                "previous_valid_until": valid_until.isoformat(),
            },
        )
    return IssuedKey(api_key=locked, plaintext=plaintext)


def revoke_key(api_key: ApiKey, *, actor: str) -> bool:
    """Revoke the key and every secret of it. True if this call revoked it, False if it already
    was revoked (then nothing is written)."""
    with transaction.atomic():
        locked = _lock_api_key(api_key)
        if key_usability(locked).revoked:
            api_key.revoked_at = locked.revoked_at
            return False
        now = timezone.now()
        locked.revoked_at = now
        locked.save(update_fields=["revoked_at"])
        secrets_revoked = locked.secrets.filter(revoked_at__isnull=True).update(revoked_at=now)
        # A revoked key's allotment goes back to the shared pool (tenants/allotments.py).
        allotted = any(getattr(locked, name) is not None for name in ALLOTMENT_FIELDS)
        if allotted:
            allotments_changed(locked.project.tenant_id)
        record_change(
            replace(API_KEY, invalidation=_tenant_wide) if allotted else API_KEY, locked,
            actor=actor, action="key.revoked", data={"secrets_revoked": secrets_revoked},
        )
    api_key.revoked_at = now
    return True


def _lock_unrevoked_key_and_tenant(api_key: ApiKey) -> ApiKey:
    # The tenant first, as every writer of allotments does (no lock-order cycle), then the key.
    tenant_id = (ApiKey.objects.filter(pk=api_key.pk)
                 .values_list("project__tenant_id", flat=True).first())
    if tenant_id is None:
        raise ApiKeyNotFound(api_key.public_id)
    lock_tenant(tenant_id)
    return _lock_unrevoked_key(api_key)


def update_key(api_key: ApiKey, *, actor: str, **changes: Any) -> ApiKey:
    """Rename a key or change its sub-limits, allotments and models (None removes a sub-limit
    or an allotment), within its project's and tenant's limits and quota. A revoked key cannot
    be changed."""
    check_field_names(changes, KEY_EDIT_FIELDS, "API key")
    if not touches_allotments(changes):
        return update(
            replace(API_KEY, lock=_lock_unrevoked_key), api_key, changes, actor=actor,
            action="key.updated", check=_check_within_project, refresh=KEY_EDIT_FIELDS,
        )
    pool_changed = False

    def check(locked: ApiKey) -> None:
        nonlocal pool_changed
        _check_within_project(locked)
        pool_changed = check_allotments(locked.project.tenant, locked)

    def drop(locked: ApiKey) -> tuple[invalidation.Kind, int]:
        # Called after check(), when the change is saved.
        return _tenant_wide(locked) if pool_changed else _one_key(locked)

    return update(
        replace(API_KEY, lock=_lock_unrevoked_key_and_tenant, invalidation=drop), api_key,
        changes, actor=actor, action="key.updated", check=check, refresh=KEY_EDIT_FIELDS,
    )


def touch_last_used(api_key_ids: Iterable[int], when: datetime) -> int:
    """Record that keys were used at `when`, in one UPDATE; returns how many rows moved.

    Not audited: this is usage telemetry from the hot path, not a change anyone made. It never
    moves last_used_at backwards, so batches flushed out of order are harmless.
    """
    ids = list(api_key_ids)
    if not ids:
        return 0
    return (
        ApiKey.objects.filter(pk__in=ids)
        .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=when))
        .update(last_used_at=when)
    )
