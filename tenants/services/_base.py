"""What every service of the package does the same way: validate a row, insert one with a unique
slug, and change one (lock, diff, save, audit, publish) through `update`.

An `Entity` says how the services change one kind of row: how to lock it, whose audit trail
records the change and under which name, and what the gateways cache of it. Every change goes
through `record_change`: one AuditEvent, and (after commit) one invalidation message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Generic, TypeVar

from django.db import IntegrityError, models, transaction
from django.db.models import QuerySet

from tenants import invalidation
from tenants.exceptions import SlugTaken
from tenants.models import Tenant
from tenants.services.audit import record_audit_event

M = TypeVar("M", bound=models.Model)
Diff = dict[str, dict[str, Any]]  # field -> {"from": old, "to": new}


@dataclass(frozen=True)
class Entity(Generic[M]):
    """How the services change one kind of row."""

    lock: Callable[[M], M]  # the row again, FOR UPDATE, with what tenant() and target() read
    tenant: Callable[[M], Tenant | None]  # whose audit trail records the change
    target: Callable[[M], str]  # how the audit trail names the row
    # What every gateway process must drop from its cache when the row changes.
    invalidation: Callable[[M], tuple[invalidation.Kind, int]] | None = None


def check_field_names(changes: Mapping[str, Any], allowed: Iterable[str], what: str) -> None:
    allowed = tuple(allowed)
    unknown = sorted(set(changes) - set(allowed))
    if unknown:
        raise ValueError(
            f"Unknown {what} field(s): {', '.join(unknown)}; known: {', '.join(allowed)}"
        )


def clean(instance: models.Model, *, exclude: Iterable[str] = ()) -> None:
    # Field validators and the model's clean(); uniqueness is left to the database so that a
    # concurrent insert of the same slug is caught too (see insert_with_slug).
    instance.full_clean(
        exclude=list(exclude), validate_unique=False, validate_constraints=False
    )


def insert_with_slug(
    instance: models.Model, *, taken: QuerySet[Any], kind: str, slug: str
) -> None:
    try:
        # A savepoint, so the caller's transaction stays usable after a unique violation.
        with transaction.atomic():
            instance.save(force_insert=True)
    except IntegrityError:
        if taken.exists():
            raise SlugTaken(kind, slug) from None
        raise


def record_change(
    entity: Entity[M],
    row: M,
    *,
    actor: str,
    action: str,
    data: dict[str, Any],
    publish: bool = True,
) -> None:
    """One audit event for a change to `row`; with `publish`, tell every gateway process to drop
    what it cached of the row once the transaction commits."""
    record_audit_event(
        tenant=entity.tenant(row), actor=actor, action=action, target=entity.target(row), data=data
    )
    if publish and entity.invalidation is not None:
        invalidation.publish(*entity.invalidation(row))


def _json_safe(value: Any) -> Any:
    return str(value) if isinstance(value, Decimal) else value


def changes_data(diff: Diff) -> dict[str, Any]:
    """The audit data of an edit: {"changes": {field: {"from": old, "to": new}}}."""
    return {
        "changes": {
            name: {side: _json_safe(value) for side, value in change.items()}
            for name, change in diff.items()
        }
    }


def from_to(name: str, show: Callable[[Any], Any] = _json_safe) -> Callable[[Diff], dict[str, Any]]:
    """The audit data of a one-field change: {"from": old, "to": new}."""
    return lambda diff: {side: show(value) for side, value in diff[name].items()}


def _relation_fields(instance: models.Model) -> list[str]:
    return [f.name for f in instance._meta.concrete_fields if f.is_relation]


def _auto_now_fields(instance: models.Model) -> list[str]:
    return [f.name for f in instance._meta.concrete_fields if getattr(f, "auto_now", False)]


def update(
    entity: Entity[M],
    instance: M,
    changes: Mapping[str, Any],
    *,
    actor: str,
    action: str,
    check: Callable[[M], None] | None = None,
    data: Callable[[Diff], dict[str, Any]] = changes_data,
    publish: bool = True,
    refresh: Iterable[str] | None = None,
) -> M:
    """Change fields of one row, in one transaction: lock it, apply `changes`, validate (field
    validators and the model's clean(), then `check` on the changed row), and when a value
    differs save those fields only, record one audit event (`data` of the diff) and publish
    one invalidation. A call that changes nothing writes nothing.

    Related rows in `changes` (a tenant's plan) were looked up by the caller and are not
    validated again; the database refuses a dangling one. `instance` gets the saved values of
    `refresh` (default: the changed names) and is returned.
    """
    with transaction.atomic():
        locked = entity.lock(instance)
        before = {name: getattr(locked, name) for name in changes}
        for name, value in changes.items():
            setattr(locked, name, value)
        clean(locked, exclude=_relation_fields(locked))
        if check is not None:
            check(locked)
        diff = {
            name: {"from": before[name], "to": getattr(locked, name)}
            for name in changes
            if getattr(locked, name) != before[name]
        }
        if diff:
            locked.save(update_fields=[*diff, *_auto_now_fields(locked)])
            record_change(
                entity, locked, actor=actor, action=action, data=data(diff), publish=publish
            )
    for name in changes if refresh is None else refresh:
        setattr(instance, name, getattr(locked, name))
    return instance
