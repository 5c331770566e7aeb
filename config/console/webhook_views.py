"""The console's webhook pages: the tenant's endpoints, adding one (its signing secret shown
once), an endpoint's events and delivery log, enabling or disabling it, a test event, a
redelivery, rotating its signing secret (the new one shown once) and deleting it.

Every page resolves its tenant through config.console.frame.tenant_page (outsiders get 404);
pages that change something are for owners and admins (members get 403), and members see each
endpoint's URL masked (it can carry a receiver's token), and its host masked in the delivery log.
Test events and redeliveries are bounded (billing.webhooks): a refusal is a message, nothing
queued. A test event and a redelivery are
queued for a worker: the page answers at once and the delivery log shows the result. The logic
is in billing/webhooks.py (services), billing/tasks.py (queueing) and billing/selectors.py
(reads); these views read forms and render.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from billing import selectors, tasks, webhooks
from billing.models import WebhookEndpoint
from config.celery import app as _celery_app  # noqa: F401 - the web process publishes with it
from config.console.frame import actor, no_store, render_page, require_manage, tenant_page
from config.console.one_use_forms import REPEATED_MESSAGE, first_submission
from config.console.webhook_forms import (
    WebhookCreateForm,
    WebhookEventsForm,
    WebhookRotateSecretForm,
)
from tenants.access import principal_for
from tenants.models import Tenant

DELIVERIES_PER_PAGE = 25


def _endpoint(tenant: Tenant, public_id: str) -> WebhookEndpoint:
    endpoint = selectors.webhook_endpoints(tenant).filter(public_id=public_id).first()
    if endpoint is None:
        raise Http404("No such webhook endpoint.")
    return endpoint


def _shown(endpoints: list[WebhookEndpoint], request: HttpRequest,
           tenant: Tenant) -> list[WebhookEndpoint]:
    """The endpoints with `shown_url`: the URL for owners and admins, masked for members (it
    can carry the receiver's token). One permission check for the page."""
    full = _sees_full_urls(request, tenant)
    for endpoint in endpoints:
        endpoint.shown_url = webhooks.shown_url(endpoint.url, full)
    return endpoints


def _sees_full_urls(request: HttpRequest, tenant: Tenant) -> bool:
    return webhooks.sees_full_urls(principal_for(request), tenant)


def _webhooks_page(request: HttpRequest, tenant: Tenant, form: WebhookCreateForm | None = None,
                   *, status: int = 200) -> HttpResponse:
    endpoints = _shown(list(selectors.webhook_endpoints(tenant)), request, tenant)
    return render_page(request, tenant, "console/webhooks.html", {
        "endpoints": endpoints, "form": form or WebhookCreateForm(),
        "legacy_headers_removed_in": webhooks.LEGACY_HEADERS_REMOVED_IN,
    }, nav="console-webhooks", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def webhooks_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _webhooks_page(request, tenant)
    require_manage(request, tenant)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-webhooks", tenant.public_id)
    form = WebhookCreateForm(request.POST)
    if form.is_valid():
        try:
            endpoint, secret = webhooks.create_endpoint(
                tenant, form.cleaned_data["url"], form.cleaned_data["events"],
                actor=actor(request))
        except webhooks.WebhookUrlRefused as exc:
            form.add_error("url", str(exc))
        except ValueError as exc:
            form.add_error("events", str(exc))
        else:
            # Rendered straight into this response: the plaintext is never stored anywhere.
            return no_store(render_page(request, tenant, "console/webhook_secret.html", {
                "endpoint": endpoint, "secret": secret,
            }, nav="console-webhooks"))
    return _webhooks_page(request, tenant, form, status=400)


def _detail_page(request: HttpRequest, tenant: Tenant, endpoint: WebhookEndpoint, *,
                 form: WebhookEventsForm | None = None,
                 rotate_form: WebhookRotateSecretForm | None = None,
                 status: int = 200) -> HttpResponse:
    [endpoint] = _shown([endpoint], request, tenant)
    deliveries = Paginator(selectors.webhook_deliveries(endpoint), DELIVERIES_PER_PAGE)
    page = deliveries.get_page(request.GET.get("page"))
    full = _sees_full_urls(request, tenant)
    for delivery in page.object_list:
        delivery.shown_error = webhooks.shown_error(delivery, full)
    waiting = any(d.status == d.Status.PENDING for d in page.object_list)
    return render_page(request, tenant, "console/webhook_detail.html", {
        "endpoint": endpoint, "page": page, "waiting": waiting,
        "form": form or WebhookEventsForm(initial={"events": endpoint.events}),
        "rotate_form": rotate_form or WebhookRotateSecretForm(),
        "previous_valid_until": endpoint.previous_secret_valid_until(timezone.now()),
    }, nav="console-webhooks", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def webhook_detail(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    """The endpoint, its events (editable by owners and admins), its signing secret's rotation
    and its delivery log."""
    endpoint = _endpoint(tenant, webhook_id)
    if request.method != "POST":
        return _detail_page(request, tenant, endpoint)
    require_manage(request, tenant)
    form = WebhookEventsForm(request.POST)
    if form.is_valid():
        webhooks.update_endpoint(endpoint, actor=actor(request),
                                 events=form.cleaned_data["events"])
        messages.success(request, "Events saved.")
        return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)
    return _detail_page(request, tenant, endpoint, form=form, status=400)


@require_POST
@tenant_page(manage=True)
def webhook_rotate_secret(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    """A new signing secret, shown once in this response; the old one keeps signing for the
    grace period chosen. A reload of the page does not rotate again (first_submission)."""
    endpoint = _endpoint(tenant, webhook_id)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)
    form = WebhookRotateSecretForm(request.POST)
    if not form.is_valid():
        return _detail_page(request, tenant, endpoint, rotate_form=form, status=400)
    endpoint, secret, unusable = webhooks.rotate_secret(
        endpoint, actor=actor(request), grace_seconds=form.cleaned_data["grace_seconds"])
    # Rendered straight into this response, as at creation: the plaintext is stored nowhere.
    return no_store(render_page(request, tenant, "console/webhook_secret.html", {
        "endpoint": endpoint, "secret": secret, "rotated": True,
        "previous_valid_until": endpoint.previous_secret_valid_until(timezone.now()),
        "previous_unusable": unusable,
    }, nav="console-webhooks"))


@require_POST
@tenant_page(manage=True)
def webhook_toggle(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    enabled = not endpoint.enabled
    webhooks.update_endpoint(endpoint, actor=actor(request), enabled=enabled)
    messages.success(request, "Endpoint enabled." if enabled else
                     "Endpoint disabled: no events are sent to it until it is enabled again.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_POST
@tenant_page(manage=True)
def webhook_test(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    try:
        delivery = tasks.queue_test_event(endpoint, actor=actor(request))
    except webhooks.ManualDeliveryRefused as exc:
        messages.error(request, f"Nothing queued: {exc}.")
    else:
        messages.success(request, f"Test event queued as delivery {delivery.public_id}: its "
                         "result shows in the delivery log below once the endpoint has answered.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_POST
@tenant_page(manage=True)
def webhook_redeliver(request: HttpRequest, tenant: Tenant, webhook_id: str,
                      delivery_id: str) -> HttpResponse:
    endpoint = _endpoint(tenant, webhook_id)
    delivery = selectors.webhook_deliveries(endpoint).filter(public_id=delivery_id).first()
    if delivery is None:
        raise Http404("No such delivery.")
    try:
        delivery = tasks.queue_redelivery(delivery, actor=actor(request))
    except webhooks.ManualDeliveryRefused as exc:
        messages.error(request, f"Nothing queued: {exc}.")
    else:
        messages.success(request, f"Redelivery of {delivery.public_id} queued: its result shows "
                         "in the delivery log below once the endpoint has answered.")
    return redirect("console-webhook-detail", tenant.public_id, endpoint.public_id)


@require_http_methods(["GET", "POST"])
@tenant_page(manage=True)
def webhook_delete(request: HttpRequest, tenant: Tenant, webhook_id: str) -> HttpResponse:
    """GET asks for confirmation (the page works without JavaScript); POST deletes."""
    endpoint = _endpoint(tenant, webhook_id)
    if request.method == "POST":
        webhooks.delete_endpoint(endpoint, actor=actor(request))
        messages.success(request, f"Webhook endpoint {endpoint.url} deleted.")
        return redirect("console-webhooks", tenant.public_id)
    return render_page(request, tenant, "console/webhook_delete.html", {"endpoint": endpoint},
                       nav="console-webhooks")


