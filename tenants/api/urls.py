"""/api/ routes. Tenants are addressed by public id (ten_...); everything of a tenant's lives
below /api/tenants/<tenant_id>/ and is looked up through that tenant (tenants/api/base.py)."""

from django.urls import path

from billing.api.urls import urlpatterns as billing_routes
from tenants.api import views
from tenants.api.members import urlpatterns as member_routes
from tenants.api.resources import urlpatterns as resource_routes

urlpatterns = [
    path("tenants/", views.TenantListView.as_view(), name="api-tenant-list"),
    path("tenants/<str:tenant_id>/", views.TenantDetailView.as_view(), name="api-tenant-detail"),
    *resource_routes,
    *member_routes,
    *billing_routes,
]
