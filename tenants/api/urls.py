"""/api/ routes of the tenants app. Tenants are addressed by public id (ten_...)."""

from django.urls import path

from tenants.api import views

TENANT = "tenants/<str:tenant_id>/"

urlpatterns = [
    path("tenants/", views.TenantListView.as_view(), name="api-tenant-list"),
    path(TENANT, views.TenantDetailView.as_view(), name="api-tenant-detail"),
]
