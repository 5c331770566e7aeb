"""The console's audit log page: the tenant's audit trail, filtered by day, action and actor,
newest first, one page at a time (a cursor to the older events)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_http_methods

from config import audit_cursor
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
    """A page of AUDIT_PAGE_SIZE events, then "Older" with a cursor (config/audit_cursor.py):
    a keyset walk, so the millionth event costs what the first does (no COUNT, no OFFSET over
    the trail). An altered cursor or a junk filter is a 400 saying which, with no rows."""
    form = AuditFilterForm(request.GET or None, actions=selectors.audit_actions(tenant))
    filters: dict[str, Any] = {}
    status = 200
    cursor_error = ""
    after = None
    if request.GET:
        if form.is_valid():
            filters = {
                "start": form.cleaned_data["from"], "end": form.cleaned_data["to"],
                "action": form.cleaned_data["action"], "actor": form.cleaned_data["actor"],
            }
        else:
            status = 400
        if raw := request.GET.get("after"):
            try:
                after = audit_cursor.decode(raw)
            except audit_cursor.BadCursor as exc:
                cursor_error, status = str(exc), 400
    events: list[Any] = []
    following = None
    if status == 200:
        events, following = selectors.audit_page(
            selectors.audit_events(tenant, **filters), after, AUDIT_PAGE_SIZE)
    query = request.GET.copy()
    query.pop("after", None)
    rows = [{"event": event, "details": audit_details(event.data)} for event in events]
    context = {
        "form": form, "rows": rows, "query": query.urlencode(), "cursor_error": cursor_error,
        "older": audit_cursor.encode(following) if following is not None else "",
        "paged": after is not None,
    }
    return render_page(request, tenant, "console/audit.html", context,
                       nav="console-audit", status=status)
