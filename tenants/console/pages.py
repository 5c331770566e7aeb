"""Console pages for projects, API keys, limits, management tokens and the audit log.

Every page takes the tenant's public id from the URL (tenants.console.base.tenant_page: 404 for
a tenant the user cannot see); objects are looked up through that tenant, so another tenant's
project or key is a 404 too. Members read; a POST from them is a 403. Views parse a form, call
one service and render; a plaintext key or token is rendered once, straight into the response of
the POST that created it, and never stored in the session.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from quotas.engine import QuotaStoreUnavailable
from quotas.status import QuotaStatus, quota_status
from tenants import selectors, services
from tenants.access import principal_for
from tenants.console.base import render_page, tenant_page
from tenants.console.once import REPEATED_MESSAGE, first_submission
from tenants.console.forms import (
    AlertThresholdsForm,
    AuditFilterForm,
    IssueKeyForm,
    KeyLimitsForm,
    KeySubLimitsForm,
    ManagementTokenForm,
    ProjectForm,
    ProjectLimitsForm,
    RevokeKeyForm,
    RotateKeyForm,
    add_service_errors,
)
from tenants.exceptions import KeyExpired, KeyRevoked, SlugTaken
from tenants.management_tokens import masked_token
from tenants.models import ApiKey, Project, Tenant

AUDIT_PAGE_SIZE = 50
SECRET_TEMPLATE = "console/key_secret.html"


def _actor(request: HttpRequest) -> str:
    return principal_for(request).actor


def _require_manage(request: HttpRequest, tenant: Tenant) -> None:
    if not principal_for(request).can_manage(tenant):
        raise PermissionDenied("Your role in this tenant does not allow changes.")


def _project(tenant: Tenant, public_id: str) -> Project:
    project = selectors.tenant_projects(tenant).filter(public_id=public_id).first()
    if project is None:
        raise Http404("No such project.")
    return project


def _key(tenant: Tenant, public_id: str) -> ApiKey:
    api_key = selectors.tenant_keys(tenant).filter(public_id=public_id).first()
    if api_key is None:
        raise Http404("No such API key.")
    return api_key


def _live_status(tenant: Tenant) -> QuotaStatus | None:
    """The live counters, or None when the quota store is down (pages then say so)."""
    try:
        return quota_status(tenant)
    except QuotaStoreUnavailable:
        return None


def _no_store(response: HttpResponse) -> HttpResponse:
    # A page with a plaintext secret must not stay in a browser or proxy cache.
    response["Cache-Control"] = "no-store"
    return response


# -- projects and keys ---------------------------------------------------------------------------


def _key_row(api_key: ApiKey, usage: dict[str, dict[str, int]], now: Any) -> dict[str, Any]:
    used = usage.get(api_key.public_id, {})
    return {
        "key": api_key,
        "masked": selectors.listed_masked_key(api_key, now=now),
        "status": selectors.key_status(api_key, now=now),
        "today": used.get("today", 0),
        "month": used.get("month", 0),
    }


def _projects_page(
    request: HttpRequest,
    tenant: Tenant,
    *,
    project_form: ProjectForm | None = None,
    issue_forms: dict[str, IssueKeyForm] | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    project_usage = selectors.usage_today_and_month(tenant, "project")
    key_usage = selectors.usage_today_and_month(tenant, "key")
    keys_by_project: dict[int, list[dict[str, Any]]] = {}
    for api_key in selectors.tenant_keys(tenant):
        keys_by_project.setdefault(api_key.project_id, []).append(_key_row(api_key, key_usage, now))
    issue_forms = issue_forms or {}
    projects = [
        {
            "project": project,
            "today": project_usage.get(project.public_id, {}).get("today", 0),
            "month": project_usage.get(project.public_id, {}).get("month", 0),
            "keys": keys_by_project.get(project.pk, []),
            "issue_form": issue_forms.get(project.public_id)
            or IssueKeyForm(prefix=project.public_id),
        }
        for project in selectors.tenant_projects(tenant)
    ]
    context = {"projects": projects, "project_form": project_form or ProjectForm()}
    return render_page(request, tenant, "console/projects.html", context,
                       nav="console-projects", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def projects_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _projects_page(request, tenant)
    _require_manage(request, tenant)
    form = ProjectForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            project = services.create_project(
                tenant, data["slug"], actor=_actor(request), name=data["name"],
                tokens_per_day=data["tokens_per_day"], tokens_per_month=data["tokens_per_month"],
                within_limits=True,
            )
        except SlugTaken:
            form.add_error("slug", "A project with this slug already exists in this tenant.")
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Project {project.name} created.")
            return redirect("console-projects", tenant.public_id)
    return _projects_page(request, tenant, project_form=form, status=400)


def _secret_page(
    request: HttpRequest, tenant: Tenant, *, title: str, plaintext: str, api_key: ApiKey | None,
    note: str = "", back_url: str = "", nav: str = "console-projects", what: str = "key",
) -> HttpResponse:
    context = {"title": title, "plaintext": plaintext, "api_key": api_key, "note": note,
               "back_url": back_url, "what": what}
    return _no_store(render_page(request, tenant, SECRET_TEMPLATE, context, nav=nav))


@require_POST
@tenant_page(manage=True)
def key_issue(request: HttpRequest, tenant: Tenant, project_id: str) -> HttpResponse:
    project = _project(tenant, project_id)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-projects", tenant.public_id)
    form = IssueKeyForm(request.POST, prefix=project.public_id)
    if form.is_valid():
        try:
            issued = services.issue_key(
                project, actor=_actor(request), name=form.cleaned_data["name"], within_limits=True
            )
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return _secret_page(
                request, tenant, title=f"New key for {project.name}", plaintext=issued.plaintext,
                api_key=issued.api_key,
            )
    return _projects_page(request, tenant, issue_forms={project.public_id: form}, status=400)


def _key_page(
    request: HttpRequest, tenant: Tenant, api_key: ApiKey, *,
    limits_form: KeyLimitsForm | None = None, rotate_form: RotateKeyForm | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    usage = selectors.usage_today_and_month(tenant, "key")
    live = _live_status(tenant)
    live_scopes = ([s for s in live.scopes if s.kind == "key" and s.ref == api_key.public_id]
                   if live is not None else [])
    context = {
        "row": _key_row(api_key, usage, now),
        "project": api_key.project,
        "secrets": [
            {"secret": secret,
             "valid": secret.revoked_at is None and (secret.expires_at is None
                                                      or secret.expires_at > now)}
            for secret in api_key.secrets.all()
        ],
        "limits": selectors.effective_limits(tenant),
        "live_available": live is not None,
        "live_scopes": live_scopes,
        "limits_form": limits_form or KeyLimitsForm(initial=KeyLimitsForm.initial_for(api_key)),
        "rotate_form": rotate_form or RotateKeyForm(),
    }
    return render_page(request, tenant, "console/key_detail.html", context,
                       nav="console-projects", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def key_detail(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    api_key = _key(tenant, key_id)
    if request.method != "POST":
        return _key_page(request, tenant, api_key)
    _require_manage(request, tenant)
    form = KeyLimitsForm(request.POST)
    if form.is_valid():
        try:
            services.update_key(api_key, actor=_actor(request), **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, "Key limits saved.")
            return redirect("console-key", tenant.public_id, api_key.public_id)
    return _key_page(request, tenant, api_key, limits_form=form, status=400)


@require_POST
@tenant_page(manage=True)
def key_rotate(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    api_key = _key(tenant, key_id)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-key", tenant.public_id, api_key.public_id)
    form = RotateKeyForm(request.POST)
    if not form.is_valid():
        return _key_page(request, tenant, api_key, rotate_form=form, status=400)
    grace = form.cleaned_data["grace_seconds"]
    try:
        issued = services.rotate_key(api_key, actor=_actor(request), grace_seconds=grace)
    except (KeyRevoked, KeyExpired) as exc:
        messages.error(request, str(exc))
        return redirect("console-key", tenant.public_id, api_key.public_id)
    label = {int(v): t for v, t in form.fields["grace_seconds"].choices}[grace].lower()
    return _secret_page(
        request, tenant, title=f"Key {api_key.name or api_key.public_id} rotated",
        plaintext=issued.plaintext, api_key=issued.api_key,
        note=f"The previous secret stops working {label}.",
    )


@require_http_methods(["GET", "POST"])
@tenant_page(manage=True)
def key_revoke(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    """A confirmation page (works without JavaScript), then the revocation."""
    api_key = _key(tenant, key_id)
    form = RevokeKeyForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        if services.revoke_key(api_key, actor=_actor(request)):
            messages.success(request, f"Key {api_key.name or api_key.public_id} revoked.")
        else:
            messages.info(request, "This key was already revoked.")
        return redirect("console-key", tenant.public_id, api_key.public_id)
    context = {"api_key": api_key, "masked": selectors.listed_masked_key(api_key), "form": form}
    return render_page(request, tenant, "console/key_revoke.html", context,
                       nav="console-projects", status=400 if request.method == "POST" else 200)


# -- limits ---------------------------------------------------------------------------------------


def _limits_page(
    request: HttpRequest, tenant: Tenant, *, bound: dict[str, Any] | None = None,
    status: int = 200,
) -> HttpResponse:
    """`bound`: the one submitted form (by its prefix) to show with its errors."""
    bound = bound or {}
    live = _live_status(tenant)
    by_scope: dict[tuple[str, str, str], Any] = {}
    if live is not None:
        by_scope = {(s.kind, s.ref, s.window): s for s in live.scopes}
    limits = selectors.effective_limits(tenant)
    projects = []
    for project in selectors.tenant_projects(tenant):
        prefix = f"p-{project.public_id}"
        projects.append({
            "project": project,
            "day": by_scope.get(("project", project.public_id, "day")),
            "form": bound.get(prefix) or ProjectLimitsForm(prefix=prefix, initial={
                "tokens_per_day": project.tokens_per_day,
                "tokens_per_month": project.tokens_per_month,
            }),
        })
    keys = []
    for api_key in selectors.tenant_keys(tenant, status="active"):
        prefix = f"k-{api_key.public_id}"
        keys.append({
            "key": api_key,
            "day": by_scope.get(("key", api_key.public_id, "day")),
            "masked": selectors.listed_masked_key(api_key),
            "form": bound.get(prefix) or KeySubLimitsForm(prefix=prefix, initial={
                "tokens_per_day": api_key.tokens_per_day,
                "tokens_per_month": api_key.tokens_per_month,
            }),
        })
    context = {
        "plan": tenant.plan,
        "limits": limits,
        "live_available": live is not None,
        "open_holds": live.open_holds if live is not None else None,
        "tenant_day": by_scope.get(("tenant", tenant.public_id, "day")),
        "tenant_month": by_scope.get(("tenant", tenant.public_id, "month")),
        "models": [s for s in (live.of("model", "day") if live is not None else [])],
        "projects": projects,
        "keys": keys,
        "alerts_form": bound.get("alerts") or AlertThresholdsForm(
            prefix="alerts",
            initial={"alert_thresholds": ", ".join(map(str, tenant.alert_thresholds))},
        ),
    }
    return render_page(request, tenant, "console/limits.html", context,
                       nav="console-limits", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def limits_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _limits_page(request, tenant)
    _require_manage(request, tenant)
    target = request.POST.get("form", "")
    if target == "alerts":
        alerts = AlertThresholdsForm(request.POST, prefix="alerts")
        if alerts.is_valid():
            try:
                services.set_tenant_limits(tenant, actor=_actor(request),
                                           alert_thresholds=alerts.cleaned_data["alert_thresholds"])
            except ValidationError as exc:
                add_service_errors(alerts, exc)
            else:
                messages.success(request, "Alert thresholds saved.")
                return redirect("console-limits", tenant.public_id)
        return _limits_page(request, tenant, bound={"alerts": alerts}, status=400)
    if target.startswith("p-"):
        project = _project(tenant, target[2:])
        form = ProjectLimitsForm(request.POST, prefix=target)
        if form.is_valid():
            try:
                services.update_project(project, actor=_actor(request), **form.cleaned_data)
            except ValidationError as exc:
                add_service_errors(form, exc)
            else:
                messages.success(request, f"Limits of project {project.name} saved.")
                return redirect("console-limits", tenant.public_id)
        return _limits_page(request, tenant, bound={target: form}, status=400)
    if target.startswith("k-"):
        api_key = _key(tenant, target[2:])
        key_form = KeySubLimitsForm(request.POST, prefix=target)
        if key_form.is_valid():
            try:
                services.update_key(api_key, actor=_actor(request), **key_form.cleaned_data)
            except ValidationError as exc:
                add_service_errors(key_form, exc)
            else:
                messages.success(request, f"Limits of key {api_key.name or api_key.public_id} "
                                 "saved.")
                return redirect("console-limits", tenant.public_id)
        return _limits_page(request, tenant, bound={target: key_form}, status=400)
    return _limits_page(request, tenant, status=400)


# -- audit log ------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "—"
    return str(value)


def audit_details(data: dict[str, Any]) -> list[tuple[str, str]]:
    """An event's data as (name, text) pairs for a person: empty values left out, and a
    "changes" record ({field: {"from", "to"}}) as one "from → to" pair per field."""
    details: list[tuple[str, str]] = []
    for name, value in data.items():
        if name == "changes" and isinstance(value, dict):
            for field_name, change in value.items():
                if isinstance(change, dict) and {"from", "to"} <= set(change):
                    details.append((field_name,
                                    f"{_shown(change['from'])} → {_shown(change['to'])}"))
                else:
                    details.append((field_name, _shown(change)))
        elif value not in (None, "", [], {}):
            details.append((name, _shown(value)))
    return details


@require_http_methods(["GET"])
@tenant_page()
def audit_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    form = AuditFilterForm(request.GET or None, actions=selectors.audit_actions(tenant))
    filters: dict[str, Any] = {}
    status = 200
    if request.GET:
        if form.is_valid():
            filters = {
                "start": form.cleaned_data["from"], "end": form.cleaned_data["to"],
                "action": form.cleaned_data["action"], "actor": form.cleaned_data["actor"],
            }
        else:
            status = 400
    events = selectors.audit_events(tenant, **filters) if status == 200 else selectors.audit_events(
        tenant).none()
    page = Paginator(events, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    rows = [{"event": event, "details": audit_details(event.data)} for event in page.object_list]
    context = {"form": form, "page": page, "rows": rows, "query": query.urlencode()}
    return render_page(request, tenant, "console/audit.html", context,
                       nav="console-audit", status=status)


# -- management tokens ---------------------------------------------------------------------------


def _tokens_page(
    request: HttpRequest, tenant: Tenant, *, form: ManagementTokenForm | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    tokens = [
        {"token": token, "masked": masked_token(token.prefix, token.last4),
         "status": ("revoked" if token.revoked_at else
                    "expired" if token.expires_at and token.expires_at <= now else "active")}
        for token in selectors.management_tokens(tenant)
    ]
    context = {"tokens": tokens, "form": form or ManagementTokenForm()}
    return render_page(request, tenant, "console/tokens.html", context,
                       nav="console-tokens", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def tokens_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _tokens_page(request, tenant)
    _require_manage(request, tenant)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-tokens", tenant.public_id)
    form = ManagementTokenForm(request.POST)
    if form.is_valid():
        try:
            issued = services.issue_management_token(
                tenant, name=form.cleaned_data["name"], actor=_actor(request)
            )
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return _secret_page(
                request, tenant, title=f"New management token {issued.token.name}",
                plaintext=issued.plaintext, api_key=None, nav="console-tokens", what="token",
                note="Use it as 'Authorization: Bearer <token>' for /api/. It acts as an admin "
                "of this tenant.",
                back_url=reverse("console-tokens", args=[tenant.public_id]),
            )
    return _tokens_page(request, tenant, form=form, status=400)


@require_POST
@tenant_page(manage=True)
def token_revoke(request: HttpRequest, tenant: Tenant, token_id: str) -> HttpResponse:
    token = selectors.management_tokens(tenant).filter(public_id=token_id).first()
    if token is None:
        raise Http404("No such token.")
    if not request.POST.get("confirm"):
        # The checkbox is `required` in the page; this covers clients that skip the browser check.
        messages.error(request, "Tick the confirmation box to revoke the token.")
        return redirect("console-tokens", tenant.public_id)
    if services.revoke_management_token(token, actor=_actor(request)):
        messages.success(request, f"Token {token.name} revoked.")
    else:
        messages.info(request, "This token was already revoked.")
    return redirect("console-tokens", tenant.public_id)


urlpatterns: list[URLPattern] = [
    path("t/<str:tenant_id>/projects/", projects_page, name="console-projects"),
    path("t/<str:tenant_id>/projects/<str:project_id>/keys/new/", key_issue,
         name="console-key-issue"),
    path("t/<str:tenant_id>/keys/<str:key_id>/", key_detail, name="console-key"),
    path("t/<str:tenant_id>/keys/<str:key_id>/rotate/", key_rotate, name="console-key-rotate"),
    path("t/<str:tenant_id>/keys/<str:key_id>/revoke/", key_revoke, name="console-key-revoke"),
    path("t/<str:tenant_id>/limits/", limits_page, name="console-limits"),
    path("t/<str:tenant_id>/audit/", audit_page, name="console-audit"),
    path("t/<str:tenant_id>/tokens/", tokens_page, name="console-tokens"),
    path("t/<str:tenant_id>/tokens/<str:token_id>/revoke/", token_revoke,
         name="console-token-revoke"),
]
