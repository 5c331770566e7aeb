"""The console's limits page: the tenant's plan and effective limits, the live counters of the
tenant, its projects and models, the projects' own sub-limits (a page of projects at a time) and
the tenant's alert thresholds (each a form of its own on the page; a key's sub-limits are set on
the key's page, config/console/project_views.py, found through the keys page), the burn-rate breaker: the tenant's
pace rule and the scopes whose breaker is tripped, each with a Resume button (quotas/pace.py),
and the allotments: per window, the shared pool and each project's and key's allotment, what it
used of it, what it borrowed from the pool and what is left (config/console/allotment_lines.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods

from config.console.allotment_lines import tenant_allotment_lines
from config.console.forms import (
    AlertThresholdsForm,
    ProjectLimitsForm,
    add_service_errors,
)
from config.console.frame import (
    actor,
    live_status,
    render_page,
    require_manage,
    tenant_page,
    tenant_project,
)
from config.console.paging import numbered_page, query_without_page
from quotas.cycles import cycle_standing
from quotas.engine import QuotaStoreUnavailable
from quotas.pace import Trip, resume_trip, tenant_trips
from tenants import selectors, services
from tenants.models import Tenant


# Each project row is a form of six fields, and rendering a field's widget costs about half a
# millisecond: ten a page keeps the page within its budget (docs/benchmarks.md).
LIMITS_PROJECTS_PAGE_SIZE = 10


@dataclass(frozen=True)
class _TripRow:
    """A trip as the page shows it."""

    trip: Trip
    kind: str  # tenant / project / key
    name: str
    tripped_at: datetime
    until: datetime
    active: bool


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _trip_rows(tenant: Tenant) -> list[_TripRow] | None:
    """The tenant's trips, active first (None when the quota store is down)."""
    try:
        trips, now_ms = tenant_trips(tenant)
    except QuotaStoreUnavailable:
        return None
    rows = [_TripRow(t, t.kind, t.label or t.scope, _moment(t.tripped_ms), _moment(t.until_ms),
                     t.active(now_ms)) for t in trips]
    return sorted(rows, key=lambda r: not r.active)



def _limits_page(
    request: HttpRequest, tenant: Tenant, *, bound: dict[str, Any] | None = None,
    status: int = 200,
) -> HttpResponse:
    """`bound`: the one submitted form (by its prefix) to show with its errors."""
    bound = bound or {}
    live = live_status(tenant, keys=())  # no key's counters here: they are on each key's page
    by_scope: dict[tuple[str, str, str], Any] = {}
    if live is not None:
        by_scope = {(s.kind, s.ref, s.window): s for s in live.scopes}
    limits = selectors.effective_limits(tenant)
    tenant_projects = list(selectors.tenant_projects(tenant))
    allotments = tenant_allotment_lines(tenant, limits=limits, projects=tenant_projects)
    # The projects' forms a page at a time; keys have no form here (a tenant may have
    # thousands): each key's limits are edited on its own page, found through the keys page.
    listing = numbered_page(selectors.tenant_projects(tenant), request.GET.get("page"),
                            LIMITS_PROJECTS_PAGE_SIZE)
    projects = []
    for project in listing.rows:
        prefix = f"p-{project.public_id}"
        projects.append({
            "project": project,
            "day": by_scope.get(("project", project.public_id, "day")),
            "form": bound.get(prefix) or ProjectLimitsForm(prefix=prefix, initial={
                "tokens_per_day": project.tokens_per_day,
                "tokens_per_month": project.tokens_per_month,
                "pace_share_percent": project.pace_share_percent,
                "pace_spend_micros": project.pace_spend_micros,
                "allotment_tokens_per_day": project.allotment_tokens_per_day,
                "allotment_tokens_per_month": project.allotment_tokens_per_month,
            }),
        })
    # The tenant's reset cycle (quotas.cycles): read-only here, as the tenant's limits are
    # (operators change it: admin, API, manage.py tenant_cycle).
    cycle = cycle_standing(tenant)
    context = {
        "plan": tenant.plan,
        "cycle": cycle,
        "cycle_changes_at": (f"{cycle.changes_at:%Y-%m-%d %H:%M} ({cycle.changes_at:%Z})"
                             if cycle.changes_at is not None else ""),
        "limits": limits,
        "live_available": live is not None,
        "open_holds": live.open_holds if live is not None else None,
        "tenant_day": by_scope.get(("tenant", tenant.public_id, "day")),
        "tenant_month": by_scope.get(("tenant", tenant.public_id, "month")),
        "models": [s for s in (live.of("model", "day") if live is not None else [])],
        "projects": projects,
        "listing": listing,
        "query": query_without_page(request.GET),
        "active_keys": selectors.tenant_keys(tenant, status="active").count(),
        "trips": _trip_rows(tenant),
        "allotments": allotments,
        "alerts_form": bound.get("alerts") or AlertThresholdsForm(
            prefix="alerts",
            initial={"alert_thresholds": ", ".join(map(str, tenant.alert_thresholds)),
                     "forecast_threshold_percent": tenant.forecast_threshold_percent},
        ),
    }
    return render_page(request, tenant, "console/limits.html", context,
                       nav="console-limits", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def limits_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _limits_page(request, tenant)
    require_manage(request, tenant)
    target = request.POST.get("form", "")
    if target == "resume":
        return _resume(request, tenant)
    if target == "alerts":
        alerts = AlertThresholdsForm(request.POST, prefix="alerts")
        if alerts.is_valid():
            try:
                forecast = alerts.cleaned_data["forecast_threshold_percent"]
                services.set_tenant_limits(
                    tenant, actor=actor(request),
                    alert_thresholds=alerts.cleaned_data["alert_thresholds"],
                    **({} if forecast is None else {"forecast_threshold_percent": forecast}))
            except ValidationError as exc:
                add_service_errors(alerts, exc)
            else:
                messages.success(request, "Alert thresholds saved.")
                return redirect("console-limits", tenant.public_id)
        return _limits_page(request, tenant, bound={"alerts": alerts}, status=400)
    if target.startswith("p-"):
        project = tenant_project(tenant, target[2:])
        form = ProjectLimitsForm(request.POST, prefix=target)
        if form.is_valid():
            try:
                services.update_project(project, actor=actor(request), **form.cleaned_data)
            except ValidationError as exc:
                add_service_errors(form, exc)
            else:
                messages.success(request, f"Limits of project {project.name} saved.")
                return redirect("console-limits", tenant.public_id)
        return _limits_page(request, tenant, bound={target: form}, status=400)
    return _limits_page(request, tenant, status=400)



def _resume(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    """Lift a tripped scope's burn-rate breaker early (audited pace.resumed)."""
    scope = request.POST.get("scope", "")
    try:
        trip = resume_trip(tenant, scope, actor=actor(request))
    except QuotaStoreUnavailable:
        messages.error(request, "The quota store cannot be reached; nothing was resumed.")
        return redirect("console-limits", tenant.public_id)
    if trip is None:
        messages.info(request, "That breaker is no longer tripped.")
    else:
        messages.success(request, f"Resumed {trip.kind} {trip.label or trip.scope}: it may "
                         "spend a whole period's share again from now.")
    return redirect("console-limits", tenant.public_id)
