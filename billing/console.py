"""Console pages of the billing app: the dashboard, webhooks and cost reports.

Every page resolves its tenant through tenants.console.base.tenant_page (outsiders get 404);
pages that change something use manage=True (members get 403). Logic lives in billing/dashboard.py,
billing/reports.py and billing/webhooks.py; these views only read forms and render.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from billing import dashboard as dashboard_data
from billing import webhooks
from billing.access import can_read_costs
from billing.forms import WebhookCreateForm, WebhookEventsForm
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.reports import Month
from tenants.access import principal_for
from tenants.console.base import render_page, tenant_page
from tenants.console.once import REPEATED_MESSAGE, first_submission
from tenants.models import Tenant

REPORT_MONTHS = 12
DELIVERIES_PER_PAGE = 25


@require_safe
@tenant_page()
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    board = dashboard_data.build(tenant)
    return render_page(request, tenant, "console/dashboard.html", {
        "board": board, "live": board.live, "chart": board.chart,
        "alert_rows": dashboard_data.alert_rows(board),
    }, nav="console-dashboard")


def recent_months(now: datetime, count: int = REPORT_MONTHS) -> list[Month]:
    """This month and the `count - 1` before it, newest first."""
    year, month = now.year, now.month
    months = []
    for _ in range(count):
        months.append(Month(year, month))
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
    return months


@require_safe
@tenant_page()
def reports(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    months = recent_months(datetime.now(UTC))
    chosen = months[0]
    error = ""
    wanted = request.GET.get("month", "").strip()
    if wanted:
        try:
            chosen = Month.parse(wanted)
        except ValueError as exc:
            error = str(exc)
    allowed = can_read_costs(principal_for(request), tenant)
    links = {}
    if allowed:
        for fmt in ("csv", "xlsx"):
            links[fmt] = reverse("api-tenant-cost-report",
                                 kwargs={"tenant_id": tenant.public_id, "month": str(chosen),
                                         "fmt": fmt})
    return render_page(request, tenant, "console/reports.html", {
        "months": [str(m) for m in months], "chosen": str(chosen), "links": links,
        "allowed": allowed, "error": error,
    }, nav="console-reports", status=400 if error else 200)


# -- webhooks -----------------------------------------------------------------------------------


def _actor(request: HttpRequest) -> str:
    return principal_for(request).actor


def _endpoint(tenant: Tenant, public_id: str) -> WebhookEndpoint:
    endpoint = (WebhookEndpoint.objects.filter(tenant=tenant, public_id=public_id)
                .select_related("tenant").first())
    if endpoint is None:
        raise Http404("No such webhook endpoint.")
    return endpoint


def _no_store(response: HttpResponse) -> HttpResponse:
    # The page with the signing secret must not stay in a browser or proxy cache.
    response["Cache-Control"] = "no-store"
    return response


def _webhooks_page(request: HttpRequest, tenant: Tenant, form: WebhookCreateForm | None = None,
                   *, status: int = 200) -> HttpResponse:
    endpoints = list(WebhookEndpoint.objects.filter(tenant=tenant).order_by("created_at", "pk"))
    return render_page(request, tenant, "console/webhooks.html", {
        "endpoints": endpoints, "form": form or WebhookCreateForm(),
    }, nav="console-webhooks", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def webhooks_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _webhooks_page(request, tenant)
    if not principal_for(request).can_manage(tenant):
        raise PermissionDenied("Your role in this tenant does not allow changes.")
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-webhooks", tenant.public_id)
    form = WebhookCreateForm(request.POST)
    if form.is_valid():
        try:
            endpoint, secret = webhooks.create_endpoint(
                tenant, form.cleaned_data["url"], form.cleaned_data["events"],
                actor=_actor(request))
        except webhooks.WebhookUrlRefused as exc:
            form.add_error("url", str(exc))
        except ValueError as exc:
            form.add_error("events", str(exc))
        else:
            # Rendered straight into this response: the plaintext is never stored anywhere.
            return _no_store(render_page(request, tenant, "console/webhook_secret.html", {
                "endpoint": endpoint, "secret": secret,
            }, nav="console-webhooks"))
    return _webhooks_page(request, tenant, form, status=400)


@require_http_methods(["GET", "POST"])
@tenant_page()
def webhook_detail(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    """The endpoint, its events (editable by owners and admins) and its delivery log."""
    endpoint = _endpoint(tenant, webhook_id)
    form = WebhookEventsForm(initial={"events": endpoint.events})
    status = 200
    if request.method == "POST":
        if not principal_for(request).can_manage(tenant):
            raise PermissionDenied("Your role in this tenant does not allow changes.")
        form = WebhookEventsForm(request.POST)
        if form.is_valid():
            webhooks.update_endpoint(endpoint, actor=_actor(request),
                                     events=form.cleaned_data["events"])
            messages.success(request, "Events saved.")
            return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)
        status = 400
    deliveries = Paginator(WebhookDelivery.objects.filter(endpoint=endpoint)
                           .order_by("-created_at", "-id"), DELIVERIES_PER_PAGE)
    page = deliveries.get_page(request.GET.get("page"))
    return render_page(request, tenant, "console/webhook_detail.html", {
        "endpoint": endpoint, "form": form, "page": page,
    }, nav="console-webhooks", status=status)


@require_POST
@tenant_page(manage=True)
def webhook_toggle(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    enabled = not endpoint.enabled
    webhooks.update_endpoint(endpoint, actor=_actor(request), enabled=enabled)
    messages.success(request, "Endpoint enabled." if enabled else
                     "Endpoint disabled: no events are sent to it until it is enabled again.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_POST
@tenant_page(manage=True)
def webhook_test(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    delivery = webhooks.request_test_event(endpoint, actor=_actor(request))
    if delivery.status == WebhookDelivery.Status.DELIVERED:
        messages.success(request, f"Test event delivered (HTTP {delivery.last_status_code}).")
    else:
        messages.error(request, "The test event was not accepted: "
                       f"{delivery.last_error or 'no answer'}. It will be retried.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_POST
@tenant_page(manage=True)
def webhook_redeliver(request: HttpRequest, tenant: Tenant, webhook_id: str,
                      delivery_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    delivery = (WebhookDelivery.objects.filter(endpoint=endpoint, public_id=delivery_id)
                .select_related("endpoint__tenant").first())
    if delivery is None:
        raise Http404("No such delivery.")
    delivery = webhooks.request_redelivery(delivery, actor=_actor(request))
    if delivery.status == WebhookDelivery.Status.DELIVERED:
        messages.success(request, f"Delivery {delivery.public_id} redelivered.")
    else:
        messages.error(request, f"Redelivery of {delivery.public_id} failed: "
                       f"{delivery.last_error or 'no answer'}.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_http_methods(["GET", "POST"])
@tenant_page(manage=True)
def webhook_delete(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    """GET asks for confirmation (the page works without JavaScript); POST deletes."""
    endpoint = _endpoint(tenant, webhook_id)
    if request.method == "POST":
        webhooks.delete_endpoint(endpoint, actor=_actor(request))
        messages.success(request, f"Webhook endpoint {endpoint.url} deleted.")
        return redirect("console-webhooks", tenant.public_id)
    return render_page(request, tenant, "console/webhook_delete.html", {"endpoint": endpoint},
                       nav="console-webhooks")


_HOOK = "t/<str:tenant_id>/webhooks/<str:webhook_id>/"

urlpatterns: list[URLPattern] = [
    path("t/<str:tenant_id>/", dashboard, name="console-dashboard"),
    path("t/<str:tenant_id>/reports/", reports, name="console-reports"),
    path("t/<str:tenant_id>/webhooks/", webhooks_page, name="console-webhooks"),
    path(_HOOK, webhook_detail, name="console-webhook-detail"),
    path(f"{_HOOK}toggle/", webhook_toggle, name="console-webhook-toggle"),
    path(f"{_HOOK}test/", webhook_test, name="console-webhook-test"),
    path(f"{_HOOK}delete/", webhook_delete, name="console-webhook-delete"),
    path(f"{_HOOK}deliveries/<str:delivery_id>/redeliver/", webhook_redeliver,
         name="console-webhook-redeliver"),
]
