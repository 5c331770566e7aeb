"""The audit trail: one AuditEvent per change anyone made. Every service records through here
(tenants, billing, gateway and quotas alike)."""

from __future__ import annotations

from typing import Any

from tenants.models import AuditEvent, Tenant


def record_audit_event(
    *,
    actor: str,
    action: str,
    target: str,
    tenant: Tenant | None = None,
    data: dict[str, Any] | None = None,
) -> AuditEvent:
    """Append to the audit trail. `data` must never contain a secret or a plaintext key."""
    if not actor.strip():
        raise ValueError("An audit event needs an actor (e.g. 'cli', 'user:alice', 'system').")
    return AuditEvent.objects.create(
        tenant=tenant, actor=actor, action=action, target=target, data=data or {}
    )
