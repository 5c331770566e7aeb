"""Reads of the billing app that the interfaces (console pages, management API) make: a tenant's
webhook endpoints and an endpoint's delivery log. Usage figures from the ledger are in
billing/usage.py, the dashboard's figures in billing/dashboard.py; the writes are services
(billing/webhooks.py)."""

from __future__ import annotations

from django.db.models import QuerySet

from billing.models import WebhookDelivery, WebhookEndpoint
from tenants.models import Tenant


def webhook_endpoints(tenant: Tenant) -> QuerySet[WebhookEndpoint]:
    """The tenant's webhook endpoints, oldest first."""
    return (WebhookEndpoint.objects.filter(tenant=tenant).select_related("tenant")
            .order_by("created_at", "pk"))


def webhook_deliveries(endpoint: WebhookEndpoint) -> QuerySet[WebhookDelivery]:
    """The endpoint's deliveries, newest first."""
    return (WebhookDelivery.objects.filter(endpoint=endpoint).select_related("endpoint__tenant")
            .order_by("-created_at", "-id"))
