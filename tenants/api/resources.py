"""Management API routes: projects, API keys, plans, limits, management tokens and audit events.

Action endpoints (rotate, revoke, limits) answer with or without a trailing slash, since both
spellings appear in scripts and a POST cannot follow a redirect to the other.
"""

from __future__ import annotations

from django.urls import URLPattern, path, re_path

from tenants.api import audit, limits, projects, schema  # noqa: F401 - schema registers

_TENANT = r"^tenants/(?P<tenant_id>[^/]+)"

urlpatterns: list[URLPattern] = [
    path("plans/", limits.PlanListView.as_view(), name="api-plan-list"),
    path("plans/<str:name>/", limits.PlanDetailView.as_view(), name="api-plan-detail"),
    path("tenants/<str:tenant_id>/projects/", projects.ProjectListView.as_view(),
         name="api-project-list"),
    path("tenants/<str:tenant_id>/projects/<str:project_id>/",
         projects.ProjectDetailView.as_view(), name="api-project-detail"),
    path("tenants/<str:tenant_id>/keys/", projects.KeyListView.as_view(), name="api-key-list"),
    path("tenants/<str:tenant_id>/keys/<str:key_id>/", projects.KeyDetailView.as_view(),
         name="api-key-detail"),
    re_path(rf"{_TENANT}/keys/(?P<key_id>[^/]+)/rotate/?$", projects.KeyRotateView.as_view(),
            name="api-key-rotate"),
    re_path(rf"{_TENANT}/keys/(?P<key_id>[^/]+)/revoke/?$", projects.KeyRevokeView.as_view(),
            name="api-key-revoke"),
    re_path(rf"{_TENANT}/limits/?$", limits.TenantLimitsView.as_view(), name="api-tenant-limits"),
    path("tenants/<str:tenant_id>/tokens/", audit.ManagementTokenListView.as_view(),
         name="api-token-list"),
    re_path(rf"{_TENANT}/tokens/(?P<token_id>[^/]+)/revoke/?$",
            audit.ManagementTokenRevokeView.as_view(), name="api-token-revoke"),
    path("tenants/<str:tenant_id>/audit-events/", audit.AuditEventListView.as_view(),
         name="api-audit-events"),
]
