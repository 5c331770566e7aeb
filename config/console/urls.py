"""/console/ routes: every console page. Tenant pages live under /console/t/<tenant public id>/;
accepting an invitation does not (the visitor may not belong to any tenant yet)."""

from __future__ import annotations

from django.urls import URLPattern, path

from config.console import (
    audit_views,
    dashboard_views,
    limit_views,
    login_views,
    member_views,
    project_views,
    report_views,
    token_views,
    webhook_views,
)

_TENANT = "t/<str:tenant_id>/"
_HOOK = f"{_TENANT}webhooks/<str:webhook_id>/"

urlpatterns: list[URLPattern] = [
    path("login/", login_views.ConsoleLoginView.as_view(), name="console-login"),
    path("logout/", login_views.ConsoleLogoutView.as_view(), name="console-logout"),
    path("", login_views.console_index, name="console-index"),
    path("switch/", login_views.switch_tenant, name="console-switch"),
    # dashboard and reports
    path(_TENANT, dashboard_views.dashboard, name="console-dashboard"),
    path(f"{_TENANT}reports/", report_views.reports, name="console-reports"),
    # webhooks
    path(f"{_TENANT}webhooks/", webhook_views.webhooks_page, name="console-webhooks"),
    path(_HOOK, webhook_views.webhook_detail, name="console-webhook-detail"),
    path(f"{_HOOK}toggle/", webhook_views.webhook_toggle, name="console-webhook-toggle"),
    path(f"{_HOOK}test/", webhook_views.webhook_test, name="console-webhook-test"),
    path(f"{_HOOK}delete/", webhook_views.webhook_delete, name="console-webhook-delete"),
    path(f"{_HOOK}rotate-secret/", webhook_views.webhook_rotate_secret,
         name="console-webhook-rotate-secret"),
    path(f"{_HOOK}deliveries/<str:delivery_id>/redeliver/", webhook_views.webhook_redeliver,
         name="console-webhook-redeliver"),
    # projects and keys
    path(f"{_TENANT}projects/", project_views.projects_page, name="console-projects"),
    path(f"{_TENANT}projects/<str:project_id>/keys/new/", project_views.key_issue,
         name="console-key-issue"),
    path(f"{_TENANT}keys/", project_views.keys_page, name="console-keys"),
    path(f"{_TENANT}keys/<str:key_id>/", project_views.key_detail, name="console-key"),
    path(f"{_TENANT}keys/<str:key_id>/rotate/", project_views.key_rotate,
         name="console-key-rotate"),
    path(f"{_TENANT}keys/<str:key_id>/revoke/", project_views.key_revoke,
         name="console-key-revoke"),
    # limits, audit log, management tokens
    path(f"{_TENANT}limits/", limit_views.limits_page, name="console-limits"),
    path(f"{_TENANT}audit/", audit_views.audit_page, name="console-audit"),
    path(f"{_TENANT}tokens/", token_views.tokens_page, name="console-tokens"),
    path(f"{_TENANT}tokens/<str:token_id>/revoke/", token_views.token_revoke,
         name="console-token-revoke"),
    # members and invitations
    path(f"{_TENANT}members/", member_views.members, name="console-members"),
    path(f"{_TENANT}members/invite/", member_views.invite, name="console-member-invite"),
    path(f"{_TENANT}members/<str:username>/role/", member_views.change_role,
         name="console-member-role"),
    path(f"{_TENANT}members/<str:username>/remove/", member_views.remove,
         name="console-member-remove"),
    path(f"{_TENANT}invitations/<str:invitation_id>/revoke/", member_views.revoke,
         name="console-invitation-revoke"),
    path("invite/<str:secret>/", member_views.accept, name="console-invite-accept"),
]
