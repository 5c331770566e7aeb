"""Upstream provider keys: the services that change them, and the in-process pool the hot path
picks upstreams from.

The pool holds decrypted secrets in memory only. It skips two kinds of resting keys, both held
per process and broadcast between processes by other components: cooldowns (a 429 or a refused
key, gateway/listener.py calls ProviderPool.cool_down) and open circuit breakers (a key's, or one
model's on a key: gateway/circuit.py calls open_breaker / close_breaker, whose shared state lives
in Redis).

Every key speaks one API, its kind (ProviderKind: "openai", OpenAI-compatible; "anthropic", the
Messages API): the pool offers a call only the keys of its endpoint's kind (candidates(), serves()
and breaker_wait() take `kind`, "openai" by default).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from django.db import transaction

from gateway.crypto import (
    SecretDecryptionError,
    decrypt_secret,
    encrypt_secret,
    reencrypt,
)
from gateway.models import ProviderKey, ProviderKind
from gateway.prices import Price
from quotas.breakers import KEY_LEVEL
from tenants.invalidation import publish
from tenants.models import Tenant
from tenants.services.audit import record_audit_event

logger = logging.getLogger(__name__)

# The model name of a provider key's own breaker (transport failures), as in quotas.breakers.
KEY_BREAKER = KEY_LEVEL

# Below this length the last four characters would give away too much of the secret.
MIN_LENGTH_TO_SHOW_LAST4 = 12


def _normalize_secret(plaintext: str) -> str:
    # Secrets pasted into a form or exported from a shell often carry a trailing newline.
    secret = plaintext.strip()
    if not secret:
        raise ValueError("The provider secret must not be empty.")
    return secret


def apply_provider_secret(provider_key: ProviderKey, plaintext: str) -> None:
    """Set the encrypted secret and its last four characters on an unsaved or saved instance."""
    secret = _normalize_secret(plaintext)
    provider_key.secret_encrypted = encrypt_secret(secret)
    provider_key.secret_last4 = secret[-4:] if len(secret) >= MIN_LENGTH_TO_SHOW_LAST4 else ""


def set_provider_secret(
    provider_key: ProviderKey, plaintext: str, *, actor: str = "system"
) -> None:
    """Replace a saved key's secret, and record who did it (never the secret)."""
    apply_provider_secret(provider_key, plaintext)
    with transaction.atomic():
        provider_key.save(update_fields=["secret_encrypted", "secret_last4", "updated_at"])
        publish("providers", provider_key.pk)  # out of every pool until it reloads it
        record_audit_event(
            actor=actor,
            action="provider_key.secret_set",
            target=provider_key.public_id,
            tenant=provider_key.tenant,
            data={"last4": provider_key.secret_last4},
        )


def normalize_base_url(base_url: str) -> str:
    # Upstream paths are joined as base_url + "/chat/completions".
    return base_url.strip().rstrip("/")


def create_provider_key(
    name: str,
    *,
    base_url: str,
    secret: str,
    models: Sequence[str] = (),
    rpm_capacity: int | None = None,
    tpm_capacity: int | None = None,
    priority: int = 0,
    tenant: Tenant | None = None,
    enabled: bool = True,
    default_price: Price | None = None,
    kind: str = ProviderKind.OPENAI.value,
    actor: str = "system",
) -> ProviderKey:
    """Validate and save a provider key with its secret encrypted; audited.

    `default_price`: what calls of models with no price of their own cost when this key serves
    them (gateway/prices.py); None: such models are refused. `kind`: the API the key speaks
    (ProviderKind); it serves only calls of that API's endpoints."""
    provider_key = ProviderKey(
        name=name,
        kind=kind,
        base_url=normalize_base_url(base_url),
        models=list(models),
        rpm_capacity=rpm_capacity,
        tpm_capacity=tpm_capacity,
        priority=priority,
        tenant=tenant,
        enabled=enabled,
        default_input_price_micros_per_mtok=(
            default_price.input_micros_per_mtok if default_price else None),
        default_output_price_micros_per_mtok=(
            default_price.output_micros_per_mtok if default_price else None),
    )
    apply_provider_secret(provider_key, secret)
    provider_key.full_clean()
    with transaction.atomic():
        provider_key.save()
        publish("providers")  # every gateway process reloads its pool
        record_audit_event(
            actor=actor,
            action="provider_key.create",
            target=provider_key.public_id,
            tenant=tenant,
            data={
                "name": name,
                "kind": provider_key.kind,
                "base_url": provider_key.base_url,
                "models": provider_key.models,
                "last4": provider_key.secret_last4,
                "default_price": ([default_price.input_micros_per_mtok,
                                   default_price.output_micros_per_mtok]
                                  if default_price else None),
            },
        )
    return provider_key


# What update_provider_key may change; the secret goes through set_provider_secret.
EDITABLE_FIELDS: frozenset[str] = frozenset(
    {"name", "kind", "base_url", "models", "rpm_capacity", "tpm_capacity", "priority", "enabled",
     "tenant", "default_input_price_micros_per_mtok", "default_output_price_micros_per_mtok"}
)


def update_provider_key(
    provider_key: ProviderKey, changed: Iterable[str], *, actor: str = "system"
) -> None:
    """Validate and save the named fields, already set on the instance; audited."""
    fields = sorted(set(changed))
    unknown = set(fields) - EDITABLE_FIELDS
    if unknown:
        raise ValueError(f"Not editable this way: {', '.join(sorted(unknown))}")
    if not fields:
        return
    provider_key.base_url = normalize_base_url(provider_key.base_url)
    provider_key.full_clean()
    with transaction.atomic():
        provider_key.save(update_fields=[*fields, "updated_at"])
        # Out of every pool until it is reloaded with the change (disabled: for good).
        publish("providers", provider_key.pk)
        record_audit_event(
            actor=actor,
            action="provider_key.update",
            target=provider_key.public_id,
            tenant=provider_key.tenant,
            data={"fields": fields},
        )


def delete_provider_key(provider_key: ProviderKey, *, actor: str = "system") -> None:
    """Delete a provider key; audited, and every gateway process reloads its pool (and its
    catalog, which holds the key's default prices). Disabling it keeps its history instead."""
    with transaction.atomic():
        ident, public_id, tenant = provider_key.pk, provider_key.public_id, provider_key.tenant
        provider_key.delete()
        publish("providers", ident)  # dropped from every pool at once, then pools reload
        record_audit_event(actor=actor, action="provider_key.delete", target=public_id,
                           tenant=tenant, data={"name": provider_key.name,
                                                "base_url": provider_key.base_url})


def reencrypt_provider_secrets() -> int:
    """Re-encrypt every provider key's secret under the first configured key; returns how many
    changed.

    The provider half of the rotation step between adding a new first key to
    TOLLGATE_ENCRYPTION_KEYS and removing the old one; the whole step (webhook secrets too) is
    billing.encryption.reencrypt_stored_secrets (`manage.py reencrypt_secrets`). A secret no
    configured key opens raises SecretDecryptionError naming its provider key.
    """
    changed = 0
    with transaction.atomic():
        for provider_key in ProviderKey.objects.select_for_update().only(
                "id", "public_id", "name", "secret_encrypted").order_by("pk"):
            try:
                rotated = reencrypt(provider_key.secret_encrypted)
            except SecretDecryptionError as exc:
                # Named, so the operator knows which one to fix (as a webhook endpoint is).
                raise SecretDecryptionError(
                    f"provider key {provider_key.name} ({provider_key.public_id}): no "
                    "configured key decrypts its secret (calls through it fail); set its secret "
                    "again, or put back the key that encrypted it") from exc
            if rotated != provider_key.secret_encrypted:
                ProviderKey.objects.filter(pk=provider_key.pk).update(secret_encrypted=rotated)
                changed += 1
    return changed


@dataclass(frozen=True)
class Upstream:
    """One provider key as the forwarder needs it."""

    id: int
    public_id: str
    base_url: str
    secret: str = field(repr=False)
    rpm_capacity: int | None
    tpm_capacity: int | None
    priority: int = 0
    models: frozenset[str] = frozenset()  # empty: every model
    tenant_id: int | None = None  # set: dedicated to that tenant
    kind: str = ProviderKind.OPENAI.value  # the API it speaks (ProviderKind)

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    def speaks(self, kind: str) -> bool:
        return self.kind == kind

    def usable_by(self, tenant_id: int | None) -> bool:
        return self.tenant_id is None or self.tenant_id == tenant_id


class ProviderPool:
    """The enabled provider keys of this process, and which of them are cooling down."""

    def __init__(self, upstreams: Iterable[Upstream]) -> None:
        self._upstreams: tuple[Upstream, ...] = tuple(upstreams)
        self._by_id = {upstream.id: upstream for upstream in self._upstreams}
        self._cooldown_until: dict[int, float] = {}
        # Open circuit breakers known to this process: (key id, model or KEY_BREAKER) -> when
        # the cool-down ends (time.time()). Past it the key is offered again, and the forwarder
        # takes a probe slot in Redis before using it (gateway/circuit.py).
        self._breaker_until: dict[tuple[int, str], float] = {}
        self._turns: dict[tuple[int, ...], int] = {}  # a group of keys' next turn
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._upstreams)

    def without(self, provider_key_id: int) -> ProviderPool:
        """A pool of the same keys but this one, with the same cooldowns and breakers."""
        pool = ProviderPool(u for u in self._upstreams if u.id != provider_key_id)
        pool.adopt_resting(self)
        return pool

    def adopt_resting(self, other: ProviderPool) -> None:
        """Take over another pool's cooldowns and open breakers (a reloaded pool keeps
        skipping the keys the old one skipped)."""
        for upstream_id, until in other.cooldowns().items():
            self.cool_down(upstream_id, until)
        for (upstream_id, model), until in other.breakers().items():
            self.open_breaker(upstream_id, model, until)

    def get(self, provider_key_id: int) -> Upstream | None:
        return self._by_id.get(provider_key_id)

    def cool_down(self, provider_key_id: int, until: float) -> None:
        """Skip this key until `until` (a time.time() value). A later deadline wins, so
        cooldowns that arrive out of order from other processes never shorten one."""
        with self._lock:
            current = self._cooldown_until.get(provider_key_id, 0.0)
            self._cooldown_until[provider_key_id] = max(current, until)

    def in_cooldown(self, provider_key_id: int, now: float) -> bool:
        return self._cooldown_until.get(provider_key_id, 0.0) > now

    def cooldowns(self) -> dict[int, float]:
        """A copy of the cooldown deadlines, e.g. to carry them into a reloaded pool."""
        with self._lock:
            return dict(self._cooldown_until)

    # -- circuit breakers (gateway/circuit.py) ---------------------------------------------------

    def open_breaker(self, provider_key_id: int, model: str, until: float) -> None:
        """Skip this key (for `model`, or for every model: KEY_BREAKER) until `until`. A later
        deadline wins, as for cooldowns."""
        with self._lock:
            current = self._breaker_until.get((provider_key_id, model), 0.0)
            self._breaker_until[(provider_key_id, model)] = max(current, until)

    def hold_breaker(self, provider_key_id: int, model: str, until: float) -> None:
        """Skip a half-open key until `until` (its probe slots are taken; the probes' end is
        published). Unlike open_breaker it may shorten the wait."""
        with self._lock:
            if (provider_key_id, model) in self._breaker_until:
                self._breaker_until[(provider_key_id, model)] = until

    def close_breaker(self, provider_key_id: int, model: str) -> None:
        with self._lock:
            self._breaker_until.pop((provider_key_id, model), None)

    def breakers(self) -> dict[tuple[int, str], float]:
        """A copy of the breakers known open (or half-open): (key id, model) -> until."""
        with self._lock:
            return dict(self._breaker_until)

    def breakers_due(self, provider_key_id: int, model: str, now: float) -> list[str] | None:
        """None when no breaker of this key applies to `model` (the usual case, a dict lookup or
        two); else the breakers past their cool-down, for which a probe slot must be taken
        before a call: [] means one is still open (candidates() leaves such keys out)."""
        if not self._breaker_until:
            return None
        found: list[str] | None = None
        for name in (KEY_BREAKER, model):
            until = self._breaker_until.get((provider_key_id, name))
            if until is None:
                continue
            if until > now:
                return []
            found = [*(found or []), name]
        return found

    def _breaker_open(self, provider_key_id: int, model: str, now: float) -> bool:
        return self.breakers_due(provider_key_id, model, now) == []

    def breaker_wait(self, model: str, tenant_id: int | None, now: float,
                     kind: str = ProviderKind.OPENAI.value) -> float | None:
        """Seconds until the first breaker blocking a key usable for this call (of `kind`) ends
        its cool-down; None when no such key has an open breaker."""
        waits = [until - now for (key_id, name), until in self.breakers().items()
                 if name in (KEY_BREAKER, model)
                 and (upstream := self._by_id.get(key_id)) is not None
                 and upstream.speaks(kind)
                 and upstream.serves(model) and upstream.usable_by(tenant_id)]
        return min(waits) if waits else None

    def serves(self, model: str, tenant_id: int | None,
               kind: str = ProviderKind.OPENAI.value) -> bool:
        """Whether any key of `kind` usable by this tenant serves the model, cooling down or not.

        For "does this model exist here" checks (request validation, /v1/models). Unlike
        candidates() it does not take a round-robin turn: calling candidates() once to check
        and once to forward would hand every forward the same key of a pair.
        """
        return any(u.speaks(kind) and u.serves(model) and u.usable_by(tenant_id)
                   for u in self._upstreams)

    def _next_turn(self, group: tuple[int, ...], take: bool) -> int:
        with self._lock:
            turn = self._turns.get(group, 0)
            if take:
                self._turns[group] = turn + 1
            return turn

    def candidates(self, model: str | None, tenant_id: int | None, now: float,
                   kind: str = ProviderKind.OPENAI.value, *,
                   take_turn: bool = True) -> list[Upstream]:
        """Keys of `kind` (the API of the call's endpoint) to try for this model and tenant,
        best first. `model` None: a request that names no model (a moderation without one, a
        conversation): every key of `kind` may take it, and only key-level breakers apply.

        Keys dedicated to the tenant come before shared ones, then higher priority first; keys
        of equal rank take turns at the front (round robin, per process). Keys dedicated to
        another tenant, keys in cooldown and keys with an open breaker (the key's or the
        model's, still cooling down) are left out. Each call takes a turn: call it once per
        upstream attempt sequence, and use serves() for existence checks. `take_turn` False:
        the order the next call would get, leaving the turn to it (a look ahead).
        """
        breakers = bool(self._breaker_until)
        ranked: dict[tuple[bool, int], list[Upstream]] = {}
        for upstream in self._upstreams:
            if (not upstream.speaks(kind) or (model is not None and not upstream.serves(model))
                    or not upstream.usable_by(tenant_id)):
                continue
            if self.in_cooldown(upstream.id, now):
                continue
            if breakers and self._breaker_open(upstream.id, model or KEY_BREAKER, now):
                continue
            dedicated = upstream.tenant_id is not None
            ranked.setdefault((dedicated, upstream.priority), []).append(upstream)
        ordered: list[Upstream] = []
        for rank in sorted(ranked, reverse=True):
            group = ranked[rank]
            if len(group) > 1:
                turn = self._next_turn(tuple(upstream.id for upstream in group),
                                       take_turn) % len(group)
                group = group[turn:] + group[:turn]
            ordered.extend(group)
        return ordered


def upstream_from_key(provider_key: ProviderKey) -> Upstream:
    return Upstream(
        id=provider_key.pk,
        public_id=provider_key.public_id,
        base_url=normalize_base_url(provider_key.base_url),
        secret=decrypt_secret(provider_key.secret_encrypted),
        rpm_capacity=provider_key.rpm_capacity,
        tpm_capacity=provider_key.tpm_capacity,
        priority=provider_key.priority,
        models=frozenset(provider_key.models or ()),
        tenant_id=provider_key.tenant_id,
        kind=provider_key.kind,
    )


def load_pool() -> ProviderPool:
    """A pool of every enabled provider key, in one query.

    A key whose secret no configured encryption key opens is left out and logged (by public
    id), so one bad row does not take the gateway down with it.
    """
    upstreams: list[Upstream] = []
    for provider_key in ProviderKey.objects.filter(enabled=True).order_by("id"):
        try:
            upstreams.append(upstream_from_key(provider_key))
        except SecretDecryptionError:
            logger.error(
                "provider key %s left out of the pool: its secret cannot be decrypted with "
                "TOLLGATE_ENCRYPTION_KEYS",
                provider_key.public_id,
            )
    return ProviderPool(upstreams)
