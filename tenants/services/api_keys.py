"""API keys: issuing one (its plaintext exists once, in the IssuedKey returned), rotating its
secret, revoking it, changing its sub-limits and models, and recording when keys were used.

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

from tenants.api_key_format import generate_key, mask_plaintext
from tenants.exceptions import ApiKeyNotFound, KeyExpired, KeyRevoked
from tenants.key_usability import key_usability
from tenants.models import ApiKey, ApiKeySecret, Project
from tenants.services._base import Entity, check_field_names, clean, record_change, update
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


API_KEY: Entity[ApiKey] = Entity(
    lock=_lock_api_key,
    tenant=lambda api_key: api_key.project.tenant,
    target=lambda api_key: api_key.public_id,
    invalidation=lambda api_key: ("api_key", api_key.pk),  # gateways cache keys by secret
)


def _new_secret(api_key: ApiKey) -> tuple[str, ApiKeySecret]:
    plaintext, prefix, digest, last4 = generate_key()
    secret = ApiKeySecret.objects.create(api_key=api_key, prefix=prefix, digest=digest, last4=last4)
    return plaintext, secret


def _check_within_project(api_key: ApiKey) -> None:
    check_key_limits(
        api_key.project, tokens_per_day=api_key.tokens_per_day,
        tokens_per_month=api_key.tokens_per_month,
        requests_per_minute=api_key.requests_per_minute, allowed_models=api_key.allowed_models,
    )


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
    within_limits: bool = False,
) -> IssuedKey:
    """With within_limits=True (the console and the API), sub-limits beyond the project's or the
    tenant's and models outside the plan are refused with a ValidationError naming the field."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    if within_limits:
        check_key_limits(
            project, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month,
            requests_per_minute=requests_per_minute, allowed_models=allowed_models or [],
        )
    with transaction.atomic():
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
            created_by=actor,
        )
        clean(api_key)
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
            },
        )
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
        record_change(
            API_KEY, locked, actor=actor, action="key.revoked",
            data={"secrets_revoked": secrets_revoked},
        )
    api_key.revoked_at = now
    return True


def update_key(api_key: ApiKey, *, actor: str, **changes: Any) -> ApiKey:
    """Rename a key or change its sub-limits and models (None removes a sub-limit), within its
    project's and tenant's limits. A revoked key cannot be changed."""
    check_field_names(changes, KEY_EDIT_FIELDS, "API key")
    return update(
        replace(API_KEY, lock=_lock_unrevoked_key), api_key, changes, actor=actor,
        action="key.updated", check=_check_within_project, refresh=KEY_EDIT_FIELDS,
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
