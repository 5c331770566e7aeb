"""Who may see and change which tenant: the one place the console and the management API ask.

A caller is a Principal: a console user (session) or a management token. Operators (staff
users, operator tokens) see every tenant. Anyone else sees the tenants they are a member of, with
their membership's role; a tenant token acts as an admin of its own tenant only.

The rule that keeps tenants apart: a tenant the caller cannot see does not exist for them (404,
never 403), and every object below a tenant is looked up through that tenant. A member sees their
tenant but may not change it (403, since they know it exists).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from django.http import Http404

from tenants.models import ManagementToken, Membership, Tenant

ADMIN_ROLES = frozenset({Membership.Role.OWNER, Membership.Role.ADMIN})


class NotAllowed(Exception):
    """The caller sees the tenant but its role does not allow this change (an HTTP 403)."""


@dataclass(frozen=True)
class Principal:
    user: Any = None  # a django.contrib.auth user, for console sessions
    token: ManagementToken | None = None

    @property
    def is_operator(self) -> bool:
        if self.token is not None:
            return self.token.is_operator
        return bool(self.user is not None and self.user.is_active and self.user.is_staff)

    @property
    def actor(self) -> str:
        """How audit events name this caller."""
        if self.token is not None:
            return f"token:{self.token.public_id}"
        return f"user:{self.user.get_username()}"

    def visible_tenants(self) -> QuerySet[Tenant]:
        tenants = Tenant.objects.select_related("plan")
        if self.is_operator:
            return tenants.all()
        if self.token is not None:
            return tenants.filter(pk=self.token.tenant_id)
        if self.user is None or not self.user.is_authenticated:
            return tenants.none()
        return tenants.filter(memberships__user=self.user).distinct()

    def role_in(self, tenant: Tenant) -> str | None:
        """owner / admin / member, None when the tenant is not visible. Operators count as
        owners of every tenant; a tenant token as an admin of its own."""
        return self.roles_in([tenant])[tenant.pk]

    def roles_in(self, tenants: Iterable[Tenant]) -> dict[int, str | None]:
        """role_in() of each of `tenants` (a page of a listing), by tenant pk, in one query at
        most."""
        pks = [tenant.pk for tenant in tenants]
        if self.is_operator:
            return dict.fromkeys(pks, Membership.Role.OWNER)
        if self.token is not None:
            return {pk: Membership.Role.ADMIN if self.token.tenant_id == pk else None
                    for pk in pks}
        if self.user is None or not self.user.is_authenticated:
            return dict.fromkeys(pks)
        roles = dict(Membership.objects.filter(user=self.user, tenant__in=pks)
                     .values_list("tenant_id", "role"))
        return {pk: roles.get(pk) for pk in pks}

    def can_manage(self, tenant: Tenant) -> bool:
        return self.role_in(tenant) in ADMIN_ROLES


def principal_for(request: Any) -> Principal:
    """The Principal of a Django or DRF request (a DRF request authenticated by a management
    token carries the token in `request.auth`)."""
    auth = getattr(request, "auth", None)
    if isinstance(auth, ManagementToken):
        return Principal(token=auth)
    return Principal(user=request.user)


def visible_tenant(principal: Principal, public_id: str, *, manage: bool = False) -> Tenant:
    """The tenant with this public id if the caller sees it, else Http404. With manage=True a
    caller who only reads (a member) gets NotAllowed."""
    tenant = principal.visible_tenants().filter(public_id=public_id).first()
    if tenant is None:
        raise Http404("No such tenant.")
    if manage and not principal.can_manage(tenant):
        raise NotAllowed("Your role in this tenant does not allow changes.")
    return tenant
