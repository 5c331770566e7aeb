"""What every console page shares: the tenant from the URL, resolved for the logged-in user
through tenants.access (a tenant they cannot see is a 404), the page frame's context, lookups of
the tenant's projects and keys (another tenant's are a 404), the live quota counters (None when
Redis is down: pages then say so) and the page that shows a new secret once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

from quotas.engine import QuotaStoreUnavailable
from quotas.status import QuotaStatus, quota_status
from tenants import selectors
from tenants.access import ADMIN_ROLES, NotAllowed, Principal, principal_for, visible_tenant
from tenants.models import ApiKey, Project, Tenant

# The console's navigation, in order: (url name, label). Every page takes the tenant's public id.
NAV: list[tuple[str, str]] = [
    ("console-dashboard", "Dashboard"),
    ("console-projects", "Projects & keys"),
    ("console-keys", "API keys"),
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
            continue  # a page not wired into config/console/urls.py
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


def actor(request: HttpRequest) -> str:
    """Who the audit trail names for this request (user:<name>)."""
    return principal_for(request).actor


def require_manage(request: HttpRequest, tenant: Tenant) -> None:
    """403 for a member (read-only role) trying to change something."""
    if not principal_for(request).can_manage(tenant):
        raise PermissionDenied("Your role in this tenant does not allow changes.")


def tenant_project(tenant: Tenant, public_id: str) -> Project:
    project = selectors.tenant_projects(tenant).filter(public_id=public_id).first()
    if project is None:
        raise Http404("No such project.")
    return project


def tenant_key(tenant: Tenant, public_id: str) -> ApiKey:
    api_key = selectors.tenant_keys(tenant).filter(public_id=public_id).first()
    if api_key is None:
        raise Http404("No such API key.")
    return api_key


def live_status(tenant: Tenant, *, keys: Iterable[ApiKey] | None = None
                ) -> QuotaStatus | None:
    """The live counters, or None when the quota store is down (pages then say so). `keys`:
    only these keys' counters (quotas.status.quota_status); a page that shows no key's passes
    none, since a tenant may have thousands."""
    try:
        return quota_status(tenant, keys=keys)
    except QuotaStoreUnavailable:
        return None


def no_store(response: HttpResponse) -> HttpResponse:
    # A page with a plaintext secret must not stay in a browser or proxy cache.
    response["Cache-Control"] = "no-store"
    return response


SECRET_TEMPLATE = "console/key_secret.html"


def secret_page(
    request: HttpRequest, tenant: Tenant, *, title: str, plaintext: str, api_key: ApiKey | None,
    note: str = "", back_url: str = "", nav: str = "console-projects", what: str = "key",
) -> HttpResponse:
    """A new key's or token's plaintext, rendered once into the response of the POST that made
    it (never stored in the session), and not cached."""
    context = {"title": title, "plaintext": plaintext, "api_key": api_key, "note": note,
               "back_url": back_url, "what": what}
    return no_store(render_page(request, tenant, SECRET_TEMPLATE, context, nav=nav))
