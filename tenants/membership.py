"""Who belongs to a tenant's console: invitations, accepting them, roles and removal.

An invitation is a link carrying a random secret; only its digest is stored (the same keyed
HMAC as API keys, tenants.api_key_format.digest_key), so the link is shown to the inviter once
and mailed once, and a copy of the database cannot rebuild it. A link works once, until it
expires or is revoked. Audit events name the invitation by its public id and never carry the
link.

Role rules, on top of tenants.access (owners and admins may change, members only read):
- only an owner may make someone an owner, or demote or remove an owner, so an admin cannot
  raise themselves above their role or lock the owners out;
- a tenant always keeps at least one owner.

Management tokens a member issued carry that member's rights: they are revoked, in the same
transaction, when the member is removed or demoted to a role that may not change the tenant
(owner <-> admin keeps them: both may do everything a token may).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import transaction
from django.utils import timezone

from tenants.access import ADMIN_ROLES
from tenants.api_key_format import digest_key
from tenants.exceptions import TenantsError
from tenants.ids import random_base62
from tenants.models import Invitation, Membership, Tenant
from tenants.services.audit import record_audit_event
from tenants.services.management_tokens import revoke_member_tokens

logger = logging.getLogger(__name__)

INVITATION_SECRET_LENGTH = 40
# Roles an invitation may carry: ownership is handed over by an owner changing a member's role,
# never by a link that could be forwarded.
INVITABLE_ROLES: tuple[str, ...] = (Membership.Role.ADMIN, Membership.Role.MEMBER)
_RANK = {Membership.Role.MEMBER: 0, Membership.Role.ADMIN: 1, Membership.Role.OWNER: 2}


class InvitationUnusable(TenantsError):
    """The link is unknown, expired, revoked or used already; the message says which."""


class InvitationClosed(TenantsError):
    """Revoking an invitation that was accepted or revoked already."""


class LastOwner(TenantsError):
    def __init__(self) -> None:
        super().__init__("A tenant needs at least one owner: make someone else an owner first.")


class RoleNotAllowed(TenantsError):
    """The caller's role may not make this change (an HTTP 403)."""


class InvitationStatus:
    PENDING = "pending"
    ACCEPTED = "accepted"
    REVOKED = "revoked"
    EXPIRED = "expired"


def invitation_status(invitation: Invitation) -> str:
    if invitation.accepted_at is not None:
        return InvitationStatus.ACCEPTED
    if invitation.revoked_at is not None:
        return InvitationStatus.REVOKED
    if invitation.expires_at <= timezone.now():
        return InvitationStatus.EXPIRED
    return InvitationStatus.PENDING


_UNUSABLE_MESSAGES = {
    InvitationStatus.ACCEPTED: "This invitation has been used already.",
    InvitationStatus.REVOKED: "This invitation was revoked.",
    InvitationStatus.EXPIRED: "This invitation has expired. Ask for a new one.",
}
UNKNOWN_LINK_MESSAGE = "This invitation link is not valid. Check that you copied all of it."


@dataclass(frozen=True)
class IssuedInvitation:
    invitation: Invitation
    accept_url: str  # carries the secret: show it once, never store or log it
    email_sent: bool


def tenant_invitations(tenant: Tenant) -> Any:
    """Every invitation of the tenant (pending, accepted, revoked, expired), newest first."""
    return Invitation.objects.filter(tenant=tenant).order_by("-created_at", "-id")


def pending_invitations(tenant: Tenant) -> Any:
    return Invitation.objects.filter(
        tenant=tenant, accepted_at=None, revoked_at=None, expires_at__gt=timezone.now()
    ).order_by("-created_at", "-id")


def members_of(tenant: Tenant) -> Any:
    return (
        Membership.objects.filter(tenant=tenant)
        .select_related("user")
        .order_by("user__username")
    )


def _invitation_email(tenant: Tenant, invitation: Invitation, accept_url: str) -> tuple[str, str]:
    ttl_days = max(1, round(settings.INVITATION_TTL_SECONDS / 86400))
    subject = f"You are invited to {tenant.name} on Tollgate"
    body = (
        f"{invitation.invited_by.removeprefix('user:')} invited you to join {tenant.name} "
        f"as {invitation.get_role_display().lower()} in the Tollgate console.\n\n"
        f"Accept the invitation: {accept_url}\n\n"
        f"The link works once and expires in about {ttl_days} day(s). "
        "If you did not expect it, ignore this email.\n"
    )
    return subject, body


def invite_member(
    tenant: Tenant, email: str, *, role: str = Membership.Role.ADMIN, actor: str,
    accept_url: Callable[[str], str],
) -> IssuedInvitation:
    """Invite `email` to the tenant with `role` (admin or member) and mail them the link.

    `accept_url(secret)` builds the absolute link (the caller knows the host it is served on).
    Raises ValidationError (field messages) for a bad email or role; a mail failure is logged
    and reported as email_sent=False, since the inviter can still share the returned link.
    """
    email = (email or "").strip()
    errors: dict[str, list[str]] = {}
    try:
        validate_email(email)
    except ValidationError as exc:
        errors["email"] = list(exc.messages)
    if role not in INVITABLE_ROLES:
        errors["role"] = [f"Choose one of: {', '.join(INVITABLE_ROLES)}."]
    if errors:
        raise ValidationError(errors)
    secret = random_base62(INVITATION_SECRET_LENGTH)
    with transaction.atomic():
        invitation = Invitation.objects.create(
            tenant=tenant, email=email, role=role, digest=digest_key(secret), invited_by=actor,
            expires_at=timezone.now() + timedelta(seconds=settings.INVITATION_TTL_SECONDS),
        )
        record_audit_event(
            actor=actor, action="invitation.create", target=invitation.public_id, tenant=tenant,
            data={"email": email, "role": role, "expires_at": invitation.expires_at.isoformat()},
        )
    url = accept_url(secret)
    subject, body = _invitation_email(tenant, invitation, url)
    try:
        send_mail(subject, body, None, [email])
        sent = True
    except Exception:  # noqa: BLE001 - any transport failure; the link is still shown
        # Without the traceback's locals or the message: the body holds the link.
        logger.warning("Invitation %s: the email could not be sent", invitation.public_id)
        sent = False
    return IssuedInvitation(invitation=invitation, accept_url=url, email_sent=sent)


def invitation_for_secret(secret: str) -> Invitation:
    """The invitation a link's secret opens, if it can still be accepted; else
    InvitationUnusable with a message for the visitor."""
    invitation = (
        Invitation.objects.select_related("tenant").filter(digest=digest_key(secret)).first()
        if secret else None
    )
    if invitation is None:
        raise InvitationUnusable(UNKNOWN_LINK_MESSAGE)
    status = invitation_status(invitation)
    if status != InvitationStatus.PENDING:
        raise InvitationUnusable(_UNUSABLE_MESSAGES[status])
    return invitation


def _lock_pending(secret: str) -> Invitation:
    # Locked so that two clicks on the same link cannot both succeed.
    invitation = invitation_for_secret(secret)
    invitation = Invitation.objects.select_for_update().select_related("tenant").get(
        pk=invitation.pk
    )
    status = invitation_status(invitation)
    if status != InvitationStatus.PENDING:
        raise InvitationUnusable(_UNUSABLE_MESSAGES[status])
    return invitation


def _join(invitation: Invitation, user: Any) -> Membership:
    membership = Membership.objects.filter(user=user, tenant=invitation.tenant).first()
    actor = f"user:{user.get_username()}"
    if membership is None:
        membership = Membership.objects.create(
            user=user, tenant=invitation.tenant, role=invitation.role
        )
        record_audit_event(
            actor=actor, action="member.add", target=user.get_username(),
            tenant=invitation.tenant, data={"role": membership.role,
                                            "invitation": invitation.public_id},
        )
    elif _RANK[invitation.role] > _RANK[membership.role]:
        # Never a demotion: an invitation can only add rights the inviter chose to give.
        before = membership.role
        membership.role = invitation.role
        membership.save(update_fields=["role"])
        record_audit_event(
            actor=actor, action="member.role", target=user.get_username(),
            tenant=invitation.tenant, data={"role": {"from": before, "to": membership.role},
                                            "invitation": invitation.public_id},
        )
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    record_audit_event(
        actor=actor, action="invitation.accept", target=invitation.public_id,
        tenant=invitation.tenant, data={"role": membership.role},
    )
    return membership


def accept_invitation(secret: str, user: Any) -> Membership:
    """A logged-in user accepts: they join the tenant with the invitation's role (or keep a
    higher role they already have)."""
    with transaction.atomic():
        return _join(_lock_pending(secret), user)


def accept_invitation_as_new_user(secret: str, *, username: str, password: str) -> Membership:
    """A visitor without an account accepts by choosing a username and password: the account
    and the membership are created together or not at all.

    Raises ValidationError with `username` / `password` messages (Django's password validators),
    InvitationUnusable when the link cannot be used."""
    users = get_user_model()
    with transaction.atomic():
        invitation = _lock_pending(secret)
        user = users(username=(username or "").strip(), email=invitation.email)
        errors: dict[str, list[str]] = {}
        try:
            user.full_clean(exclude=["password"])
        except ValidationError as exc:
            errors.update({k: v for k, v in exc.message_dict.items() if k == "username"})
        try:
            validate_password(password or "", user)
        except ValidationError as exc:
            errors["password"] = list(exc.messages)
        if not password:
            errors["password"] = ["Choose a password."]
        if errors:
            raise ValidationError(errors)
        user.set_password(password)
        user.save()
        return _join(invitation, user)


def revoke_invitation(invitation: Invitation, *, actor: str) -> Invitation:
    with transaction.atomic():
        locked = Invitation.objects.select_for_update().get(pk=invitation.pk)
        if locked.accepted_at is not None or locked.revoked_at is not None:
            raise InvitationClosed(
                f"Invitation {locked.public_id} was {invitation_status(locked)} already."
            )
        locked.revoked_at = timezone.now()
        locked.save(update_fields=["revoked_at"])
        record_audit_event(actor=actor, action="invitation.revoke", target=locked.public_id,
                           tenant=locked.tenant, data={"role": locked.role})
    invitation.revoked_at = locked.revoked_at
    return invitation


def add_member(tenant: Tenant, user: Any, role: str, *, actor: str) -> Membership:
    """Make `user` a member of the tenant with `role`, any role: for operators (Django admin),
    who give a new tenant its first owner; everyone else invites."""
    if role not in Membership.Role.values:
        raise ValidationError({"role": [f"Choose one of: {', '.join(Membership.Role.values)}."]})
    with transaction.atomic():
        membership = Membership.objects.create(user=user, tenant=tenant, role=role)
        record_audit_event(actor=actor, action="member.add", target=user.get_username(),
                           tenant=tenant, data={"role": role})
    return membership


def _locked_memberships(membership: Membership) -> tuple[Membership, int]:
    # Locking every owner row of the tenant serialises concurrent demotions and removals, so
    # two owners demoting each other cannot leave the tenant without one.
    owners = list(
        Membership.objects.select_for_update()
        .filter(tenant_id=membership.tenant_id, role=Membership.Role.OWNER)
        .values_list("pk", flat=True)
    )
    locked = Membership.objects.select_for_update().select_related("user", "tenant").get(
        pk=membership.pk
    )
    return locked, len(owners)


def _check_owner_rule(locked: Membership, by_role: str | None) -> None:
    if locked.role == Membership.Role.OWNER and by_role != Membership.Role.OWNER:
        raise RoleNotAllowed("Only an owner can change or remove an owner.")


def change_member_role(
    membership: Membership, role: str, *, actor: str, by_role: str | None
) -> Membership:
    """Set a member's role; `by_role` is the caller's own role in the tenant."""
    if role not in Membership.Role.values:
        raise ValidationError({"role": [f"Choose one of: {', '.join(Membership.Role.values)}."]})
    with transaction.atomic():
        locked, owners = _locked_memberships(membership)
        if locked.role == role:
            return locked
        _check_owner_rule(locked, by_role)
        if role == Membership.Role.OWNER and by_role != Membership.Role.OWNER:
            raise RoleNotAllowed("Only an owner can make someone an owner.")
        if locked.role == Membership.Role.OWNER and owners <= 1:
            raise LastOwner()
        before = locked.role
        locked.role = role
        locked.save(update_fields=["role"])
        record_audit_event(actor=actor, action="member.role", target=locked.user.get_username(),
                           tenant=locked.tenant, data={"role": {"from": before, "to": role}})
        if role not in ADMIN_ROLES:  # may no longer issue tokens: theirs go
            revoke_member_tokens(locked.tenant, locked.user, actor=actor,
                                 reason=f"issuer demoted to {role}")
    membership.role = role
    return membership


def remove_member(membership: Membership, *, actor: str, by_role: str | None) -> None:
    with transaction.atomic():
        locked, owners = _locked_memberships(membership)
        _check_owner_rule(locked, by_role)
        if locked.role == Membership.Role.OWNER and owners <= 1:
            raise LastOwner()
        username = locked.user.get_username()
        role = locked.role
        locked.delete()
        record_audit_event(actor=actor, action="member.remove", target=username,
                           tenant=locked.tenant, data={"role": role})
        revoke_member_tokens(locked.tenant, locked.user, actor=actor,
                             reason="issuer removed from the tenant")
