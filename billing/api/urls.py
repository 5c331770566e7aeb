"""Management API routes of the billing app: usage, live quota, webhooks and cost reports.
Included below /api/ (tenants/api/urls.py); tenants are addressed by public id (ten_...)."""

from __future__ import annotations

from django.urls import URLPattern, path, re_path

from billing.api import views, webhooks

_MONTH_FILE = r"(?P<month>\d{4}-\d{2})\.(?P<fmt>csv|xlsx)"

urlpatterns: list[URLPattern] = [
    path("tenants/<str:tenant_id>/usage", views.UsageView.as_view(), name="api-usage"),
    path("tenants/<str:tenant_id>/quota", views.QuotaView.as_view(), name="api-quota"),
    path("tenants/<str:tenant_id>/webhooks/", webhooks.WebhookListView.as_view(),
         name="api-webhook-list"),
    path("tenants/<str:tenant_id>/webhooks/<str:webhook_id>/",
         webhooks.WebhookDetailView.as_view(), name="api-webhook-detail"),
    path("tenants/<str:tenant_id>/webhooks/<str:webhook_id>/test",
         webhooks.WebhookTestView.as_view(), name="api-webhook-test"),
    path("tenants/<str:tenant_id>/webhooks/<str:webhook_id>/deliveries/",
         webhooks.DeliveryListView.as_view(), name="api-webhook-deliveries"),
    path("tenants/<str:tenant_id>/webhooks/<str:webhook_id>/deliveries/<str:delivery_id>/"
         "redeliver", webhooks.RedeliverView.as_view(), name="api-webhook-redeliver"),
    re_path(rf"^tenants/(?P<tenant_id>[^/]+)/reports/{_MONTH_FILE}$",
            views.TenantCostReportView.as_view(), name="api-tenant-cost-report"),
    re_path(rf"^reports/{_MONTH_FILE}$", views.PlatformCostReportView.as_view(),
            name="platform-cost-report"),
]
