"""Console pages of a tenant's projects and API keys: the projects with today's and this
month's usage and their key counts, the keys (searched, filtered and paged: a tenant may have
thousands), a new project, issuing a key, a key's page (its secrets, sub-limits and live
counters: where a key's limits are edited), rotating and revoking it.

Every page takes the tenant's public id from the URL (config.console.frame.tenant_page: 404 for
a tenant the user cannot see); objects are looked up through that tenant, so another tenant's
project or key is a 404 too. Members read; a POST from them is a 403. Views parse a form, call
one service and render; a plaintext key is rendered once, straight into the response of the POST
that created it, and never stored in the session.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from billing.usage import usage_today_and_month
from config.console.allotment_lines import tenant_allotment_lines
from config.console.forms import (
    IssueKeyForm,
    KeyFilterForm,
    KeyLimitsForm,
    ProjectForm,
    RevokeKeyForm,
    RotateKeyForm,
    add_service_errors,
)
from config.console.frame import (
    actor,
    live_status,
    render_page,
    require_manage,
    secret_page,
    tenant_key,
    tenant_page,
    tenant_project,
)
from config.console.one_use_forms import REPEATED_MESSAGE, first_submission
from config.console.paging import (
    DEFAULT_PAGE_SIZE,
    PAGE_SIZES,
    NumberedPage,
    numbered_page,
    query_without_page,
)
from tenants import selectors, services
from tenants.exceptions import KeyExpired, KeyRevoked, SlugTaken
from tenants.models import ApiKey, Tenant



PROJECTS_PAGE_SIZE = 25


def _key_row(api_key: ApiKey, usage: dict[str, dict[str, int]], now: Any) -> dict[str, Any]:
    used = usage.get(api_key.public_id, {})
    return {
        "key": api_key,
        "masked": selectors.listed_masked_key(api_key, now=now),
        "status": selectors.key_status(api_key, now=now),
        "rotating": selectors.key_in_rotation(api_key, now=now),
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
    """The tenant's projects a page at a time, each with its usage, how many keys it has (a
    link to them on the keys page) and a form to issue one: the keys themselves are listed,
    searched and paged on the keys page, which a tenant with thousands of keys needs."""
    listing = numbered_page(selectors.tenant_projects(tenant), request.GET.get("page"),
                            PROJECTS_PAGE_SIZE)
    page_projects = listing.rows
    project_usage = usage_today_and_month(tenant, "project", only=page_projects)
    key_counts = selectors.project_key_counts(tenant, page_projects)
    issue_forms = issue_forms or {}
    projects = [
        {
            "project": project,
            "today": project_usage.get(project.public_id, {}).get("today", 0),
            "month": project_usage.get(project.public_id, {}).get("month", 0),
            "keys": key_counts.get(project.pk, {"total": 0, "unrevoked": 0}),
            "issue_form": issue_forms.get(project.public_id)
            or IssueKeyForm(prefix=project.public_id),
        }
        for project in page_projects
    ]
    context = {"projects": projects, "project_form": project_form or ProjectForm(),
               "listing": listing, "query": query_without_page(request.GET)}
    if listing.error and status == 200:
        status = 400
    return render_page(request, tenant, "console/projects.html", context,
                       nav="console-projects", status=status)


@require_http_methods(["GET"])
@tenant_page()
def keys_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    """The tenant's keys, searched by name or id, filtered by project, status and last use,
    in a chosen (always total) order, a bounded page at a time. A junk filter is a 400 naming
    it, with no rows; a page past the end is an empty page saying so."""
    projects = list(selectors.tenant_projects(tenant))
    form = KeyFilterForm(
        request.GET, projects=[(p.public_id, f"{p.name} ({p.slug})") for p in projects],
        statuses=selectors.KEY_FILTERS, last_use=selectors.LAST_USE,
        orders=tuple(selectors.KEY_ORDERS), page_sizes=PAGE_SIZES,
    )
    status = 200
    listing: NumberedPage
    if form.is_valid():
        data = form.cleaned_data
        by_id = {p.public_id: p for p in projects}
        keys = selectors.search_keys(
            tenant, text=data["q"], project=by_id.get(data["project"]),
            status=data["status"] or None, used=data["used"] or None,
            order=data["sort"] or "newest",
        )
        listing = numbered_page(keys, request.GET.get("page"),
                                data["per_page"] or DEFAULT_PAGE_SIZE)
        if listing.error:
            status = 400
    else:
        listing = NumberedPage([], 1, 0, DEFAULT_PAGE_SIZE)
        status = 400
    now = timezone.now()
    usage = (usage_today_and_month(tenant, "key", only=listing.rows) if listing.rows else {})
    context = {
        "form": form,
        "listing": listing,
        "rows": [_key_row(api_key, usage, now) for api_key in listing.rows],
        "query": query_without_page(request.GET),
        "filtered": any(request.GET.get(name) for name in ("q", "project", "status", "used")),
        "project_choices": form.fields["project"].choices,
        "project_value": request.GET.get("project", ""),
    }
    return render_page(request, tenant, "console/keys.html", context,
                       nav="console-keys", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def projects_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _projects_page(request, tenant)
    require_manage(request, tenant)
    form = ProjectForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            project = services.create_project(
                tenant, data["slug"], actor=actor(request), name=data["name"],
                tokens_per_day=data["tokens_per_day"], tokens_per_month=data["tokens_per_month"],
                allotment_tokens_per_day=data["allotment_tokens_per_day"],
                allotment_tokens_per_month=data["allotment_tokens_per_month"],
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



@require_POST
@tenant_page(manage=True)
def key_issue(request: HttpRequest, tenant: Tenant, project_id: str) -> HttpResponse:
    project = tenant_project(tenant, project_id)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-projects", tenant.public_id)
    form = IssueKeyForm(request.POST, prefix=project.public_id)
    if form.is_valid():
        try:
            issued = services.issue_key(
                project, actor=actor(request), name=form.cleaned_data["name"], within_limits=True
            )
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return secret_page(
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
    usage = usage_today_and_month(tenant, "key", only=[api_key])
    live = live_status(tenant, keys=[api_key] if api_key.revoked_at is None else [])
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
        "allotment_lines": _key_allotment_lines(tenant, api_key),
        "limits_form": limits_form or KeyLimitsForm(initial=KeyLimitsForm.initial_for(api_key)),
        "rotate_form": rotate_form or RotateKeyForm(),
    }
    return render_page(request, tenant, "console/key_detail.html", context,
                       nav="console-keys", status=status)


def _key_allotment_lines(tenant: Tenant, api_key: ApiKey) -> list[Any]:
    """The key's own allotment rows (per window), with their live figures when Redis answers."""
    if api_key.allotment_tokens_per_day is None and api_key.allotment_tokens_per_month is None:
        return []
    return [line for line in tenant_allotment_lines(tenant).lines
            if line.kind == "key" and line.ref == api_key.public_id]


@require_http_methods(["GET", "POST"])
@tenant_page()
def key_detail(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    api_key = tenant_key(tenant, key_id)
    if request.method != "POST":
        return _key_page(request, tenant, api_key)
    require_manage(request, tenant)
    form = KeyLimitsForm(request.POST)
    if form.is_valid():
        try:
            services.update_key(api_key, actor=actor(request), **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, "Key limits saved.")
            return redirect("console-key", tenant.public_id, api_key.public_id)
    return _key_page(request, tenant, api_key, limits_form=form, status=400)


@require_POST
@tenant_page(manage=True)
def key_rotate(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    api_key = tenant_key(tenant, key_id)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-key", tenant.public_id, api_key.public_id)
    form = RotateKeyForm(request.POST)
    if not form.is_valid():
        return _key_page(request, tenant, api_key, rotate_form=form, status=400)
    grace = form.cleaned_data["grace_seconds"]
    try:
        issued = services.rotate_key(api_key, actor=actor(request), grace_seconds=grace)
    except (KeyRevoked, KeyExpired) as exc:
        messages.error(request, str(exc))
        return redirect("console-key", tenant.public_id, api_key.public_id)
    label = {int(v): t for v, t in form.fields["grace_seconds"].choices}[grace].lower()
    return secret_page(
        request, tenant, title=f"Key {api_key.name or api_key.public_id} rotated",
        plaintext=issued.plaintext, api_key=issued.api_key,
        note=f"The previous secret stops working {label}.",
    )


@require_http_methods(["GET", "POST"])
@tenant_page(manage=True)
def key_revoke(request: HttpRequest, tenant: Tenant, key_id: str) -> HttpResponse:
    """A confirmation page (works without JavaScript), then the revocation."""
    api_key = tenant_key(tenant, key_id)
    form = RevokeKeyForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        if services.revoke_key(api_key, actor=actor(request)):
            messages.success(request, f"Key {api_key.name or api_key.public_id} revoked.")
        else:
            messages.info(request, "This key was already revoked.")
        return redirect("console-key", tenant.public_id, api_key.public_id)
    context = {"api_key": api_key, "masked": selectors.listed_masked_key(api_key), "form": form}
    return render_page(request, tenant, "console/key_revoke.html", context,
                       nav="console-projects", status=400 if request.method == "POST" else 200)

