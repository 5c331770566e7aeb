"""The console's audit log page: the tenant's audit trail, filtered by day, action and actor,
newest first, one page at a time."""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_http_methods

from config.console.forms import AuditFilterForm
from config.console.frame import render_page, tenant_page
from tenants import selectors
from tenants.models import Tenant

AUDIT_PAGE_SIZE = 50



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

