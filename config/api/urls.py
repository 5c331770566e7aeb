"""/api/ routes: every management API endpoint. Tenants are addressed by public id (ten_...);
everything of a tenant's lives below /api/tenants/<tenant_id>/ and is looked up through that
tenant (config/api/tenant_scope.py).

Action endpoints (rotate, revoke, limits) answer with or without a trailing slash, since both
spellings appear in scripts and a POST cannot follow a redirect to the other.

Any other path under /api/ (but the schema and its docs page, routed in config/urls.py) is a
JSON 404 in the API's error shape, not Django's HTML page: a client of the API only ever gets JSON
errors, as the schema promises.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import URLPattern, path, re_path

from config.api import (  # noqa: F401 - openapi registers the token scheme's description
    audit_views,
    limit_views,
    member_views,
    openapi,
    project_views,
    report_views,
    tenant_views,
    token_views,
    usage_views,
    webhook_views,
)

_TENANT = "tenants/<str:tenant_id>/"
_TENANT_RE = r"^tenants/(?P<tenant_id>[^/]+)"
_HOOK = f"{_TENANT}webhooks/<str:webhook_id>/"
_MONTH_FILE = r"(?P<month>\d{4}-\d{2})\.(?P<fmt>csv|xlsx)"
# A tenant's report: a month, or one of its cycle windows by id (quotas.cycles.report_span).
_PERIOD_FILE = r"(?P<month>\d{4}-\d{2}|[mc]\d{4}-\d{2}(?:-\d{2})?(?:@\d{1,12})?)\.(?P<fmt>csv|xlsx)"



def api_not_found(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"detail": "Not found."}, status=404)


urlpatterns: list[URLPattern] = [
    # tenants
    path("tenants/", tenant_views.TenantListView.as_view(), name="api-tenant-list"),
    path(_TENANT, tenant_views.TenantDetailView.as_view(), name="api-tenant-detail"),
    # plans and limits
    path("plans/", limit_views.PlanListView.as_view(), name="api-plan-list"),
    path("plans/<str:name>/", limit_views.PlanDetailView.as_view(), name="api-plan-detail"),
    re_path(rf"{_TENANT_RE}/limits/?$", limit_views.TenantLimitsView.as_view(),
            name="api-tenant-limits"),
    re_path(rf"{_TENANT_RE}/pace/trips/?$", limit_views.PaceTripsView.as_view(),
            name="api-tenant-pace-trips"),
    re_path(rf"{_TENANT_RE}/pace/resume/?$", limit_views.PaceResumeView.as_view(),
            name="api-tenant-pace-resume"),
    # projects and keys
    path(f"{_TENANT}projects/", project_views.ProjectListView.as_view(),
         name="api-project-list"),
    path(f"{_TENANT}projects/<str:project_id>/", project_views.ProjectDetailView.as_view(),
         name="api-project-detail"),
    path(f"{_TENANT}keys/", project_views.KeyListView.as_view(), name="api-key-list"),
    path(f"{_TENANT}keys/<str:key_id>/", project_views.KeyDetailView.as_view(),
         name="api-key-detail"),
    re_path(rf"{_TENANT_RE}/keys/(?P<key_id>[^/]+)/rotate/?$",
            project_views.KeyRotateView.as_view(), name="api-key-rotate"),
    re_path(rf"{_TENANT_RE}/keys/(?P<key_id>[^/]+)/revoke/?$",
            project_views.KeyRevokeView.as_view(), name="api-key-revoke"),
    # management tokens and the audit trail
    path(f"{_TENANT}tokens/", token_views.ManagementTokenListView.as_view(),
         name="api-token-list"),
    re_path(rf"{_TENANT_RE}/tokens/(?P<token_id>[^/]+)/revoke/?$",
            token_views.ManagementTokenRevokeView.as_view(), name="api-token-revoke"),
    path(f"{_TENANT}audit-events/", audit_views.AuditEventListView.as_view(),
         name="api-audit-events"),
    # members and invitations
    path(f"{_TENANT}members/", member_views.MemberListView.as_view(), name="api-member-list"),
    path(f"{_TENANT}members/<str:member_id>/", member_views.MemberDetailView.as_view(),
         name="api-member-detail"),
    path(f"{_TENANT}invitations/", member_views.InvitationListView.as_view(),
         name="api-invitation-list"),
    path(f"{_TENANT}invitations/<str:invitation_id>/revoke",
         member_views.InvitationRevokeView.as_view(), name="api-invitation-revoke"),
    # usage and live quota
    path(f"{_TENANT}usage", usage_views.UsageView.as_view(), name="api-usage"),
    path(f"{_TENANT}quota", usage_views.QuotaView.as_view(), name="api-quota"),
    # webhooks
    path(f"{_TENANT}webhooks/", webhook_views.WebhookListView.as_view(),
         name="api-webhook-list"),
    path(_HOOK, webhook_views.WebhookDetailView.as_view(), name="api-webhook-detail"),
    path(f"{_HOOK}test", webhook_views.WebhookTestView.as_view(), name="api-webhook-test"),
    re_path(rf"{_TENANT_RE}/webhooks/(?P<webhook_id>[^/]+)/rotate-secret/?$",
            webhook_views.WebhookRotateSecretView.as_view(), name="api-webhook-rotate-secret"),
    path(f"{_HOOK}deliveries/", webhook_views.DeliveryListView.as_view(),
         name="api-webhook-deliveries"),
    path(f"{_HOOK}deliveries/<str:delivery_id>/redeliver",
         webhook_views.RedeliverView.as_view(), name="api-webhook-redeliver"),
    # cost reports
    re_path(rf"{_TENANT_RE}/reports/{_PERIOD_FILE}$",
            report_views.TenantCostReportView.as_view(), name="api-tenant-cost-report"),
    re_path(rf"^reports/{_MONTH_FILE}$", report_views.PlatformCostReportView.as_view(),
            name="platform-cost-report"),
    # Last: everything else below /api/ except the schema and docs (config/urls.py).
    re_path(r"^(?!schema/$|docs/$)", api_not_found),
]
