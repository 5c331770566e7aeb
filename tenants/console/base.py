"""What every console page shares: the tenant from the URL, resolved for the logged-in user
through tenants.access (a tenant they cannot see is a 404), and the page frame's context."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

from tenants.access import ADMIN_ROLES, NotAllowed, Principal, principal_for, visible_tenant
from tenants.models import Tenant

# The console's navigation, in order: (url name, label). Every page takes the tenant's public id.
NAV: list[tuple[str, str]] = [
    ("console-dashboard", "Dashboard"),
    ("console-projects", "Projects & keys"),
    ("console-limits", "Limits & plan"),
    ("console-webhooks", "Webhooks"),
    ("console-reports", "Reports"),
    ("console-audit", "Audit log"),
    ("console-tokens", "API tokens"),
    ("console-members", "Members"),
]

SESSION_TENANT = "console_tenant"

TenantView = Callable[..., HttpResponse]


def tenant_page(*, manage: bool = False) -> Callable[[TenantView], TenantView]:
    """Decorate a view `(request, tenant, **kwargs)` routed with `<tenant_id>`. With manage=True
    a member (read-only role) gets 403 for it; someone outside the tenant always gets 404."""

    def decorate(view: TenantView) -> TenantView:
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, tenant_id: str, **kwargs: Any) -> HttpResponse:
            try:
                tenant = visible_tenant(principal_for(request), tenant_id, manage=manage)
            except NotAllowed as exc:
                raise PermissionDenied(str(exc)) from None
            request.session[SESSION_TENANT] = tenant.public_id
            return view(request, tenant, **kwargs)

        return wrapper

    return decorate


def _nav(tenant: Tenant, current: str) -> list[dict[str, Any]]:
    items = []
    for name, label in NAV:
        try:
            url = reverse(name, args=[tenant.public_id])
        except NoReverseMatch:
            continue  # a page not wired into tenants/console/urls.py
        items.append({"url": url, "label": label, "current": name == current})
    return items


def render_page(
    request: HttpRequest, tenant: Tenant, template: str, context: dict[str, Any] | None = None,
    *, nav: str = "", status: int = 200,
) -> HttpResponse:
    """Render a tenant page inside the console frame (templates/console/base.html)."""
    principal: Principal = principal_for(request)
    role = principal.role_in(tenant)
    frame = {
        "tenant": tenant,
        "tenants": principal.visible_tenants().order_by("name"),
        "role": role,
        "can_manage": role in ADMIN_ROLES,
        "nav": _nav(tenant, nav),
    }
    return render(request, template, {**frame, **(context or {})}, status=status)
