"""Tokens issued before scopes, expiry and `issued_by` (0005 left them `full`, never expiring,
tied to nobody) get what a token issued today gets:

- every live tenant token without an expiry expires 90 days after this migration (the default
  lifetime, tenants.services.management_tokens.DEFAULT_LIFETIME, frozen here as a migration
  must be);
- `issued_by` is taken from `created_by`, the audit actor recorded at issue: "user:<username>"
  names the console user, "token:<id>" the token that issued it (followed to its own creator, as
  a token issued by a token carries its parent's issuer today), "cli" an operator (stays empty);
- a token whose recorded user no longer may change its tenant (removed, demoted to member,
  deactivated) is revoked, as it would have been had it been tied to them when that happened
  (tenants.membership); the audit trail says so. A user name that names nobody (renamed or
  deleted) leaves `issued_by` empty: the expiry still ends the token.

Operator tokens (no tenant) are left as they are.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import migrations
from django.utils import timezone

LIFETIME = timedelta(days=90)
ACTOR = "migration:tenants.0006"
ADMIN_ROLES = ("owner", "admin")
_MAX_CHAIN = 20  # far beyond any real chain of tokens issuing tokens; stops a cycle


def _creator_username(token: Any, by_public_id: dict[str, Any]) -> str | None:
    """The user name at the start of the token's chain of issuers, if it is a user."""
    seen: set[str] = set()
    created_by = token.created_by or ""
    while created_by.startswith("token:") and len(seen) < _MAX_CHAIN:
        parent_id = created_by.removeprefix("token:")
        parent = by_public_id.get(parent_id)
        if parent is None or parent_id in seen:
            return None
        seen.add(parent_id)
        created_by = parent.created_by or ""
    return created_by.removeprefix("user:") if created_by.startswith("user:") else None


def _may_change(user: Any, tenant_id: int, membership: Any) -> bool:
    if not user.is_active:
        return False
    if user.is_staff:  # operators are not members (tenants.services.management_tokens)
        return True
    return membership.objects.filter(user=user, tenant_id=tenant_id,
                                     role__in=ADMIN_ROLES).exists()


def upgrade_tokens(apps: Any, schema_editor: Any) -> None:
    token_model = apps.get_model("tenants", "ManagementToken")
    membership = apps.get_model("tenants", "Membership")
    audit = apps.get_model("tenants", "AuditEvent")
    user_model = apps.get_model(settings.AUTH_USER_MODEL)
    now = timezone.now()
    by_public_id = {t.public_id: t for t in token_model.objects.all()}
    live = token_model.objects.filter(tenant__isnull=False, revoked_at__isnull=True)
    for token in live.order_by("pk"):
        changes: dict[str, Any] = {}
        if token.expires_at is None:
            changes["expires_at"] = now + LIFETIME
        username = None if token.issued_by_id else _creator_username(token, by_public_id)
        user = user_model.objects.filter(username=username).first() if username else None
        if user is not None:
            if _may_change(user, token.tenant_id, membership):
                changes["issued_by"] = user
            else:
                changes["revoked_at"] = now
                audit.objects.create(
                    tenant_id=token.tenant_id, actor=ACTOR, action="token.revoked",
                    target=token.public_id,
                    data={"name": token.name, "reason": f"its issuer {username} may no longer "
                          "change the tenant"})
        for field, value in changes.items():
            setattr(token, field, value)
        if changes:
            token.save(update_fields=list(changes))


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0005_management_token_scope_issuer"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        # Backwards: nothing to undo (an expiry, an issuer and a revocation are valid 0005 data).
        migrations.RunPython(upgrade_tokens, migrations.RunPython.noop),
    ]
