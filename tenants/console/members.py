"""Console pages for the tenant's members and invitations, and accepting an invitation
(views in tenants/console/member_views.py)."""

from __future__ import annotations

from django.urls import URLPattern, path

from tenants.console import member_views as views

urlpatterns: list[URLPattern] = [
    path("t/<str:tenant_id>/members/", views.members, name="console-members"),
    path("t/<str:tenant_id>/members/invite/", views.invite, name="console-member-invite"),
    path("t/<str:tenant_id>/members/<str:username>/role/", views.change_role,
         name="console-member-role"),
    path("t/<str:tenant_id>/members/<str:username>/remove/", views.remove,
         name="console-member-remove"),
    path("t/<str:tenant_id>/invitations/<str:invitation_id>/revoke/", views.revoke,
         name="console-invitation-revoke"),
    # Not below a tenant: the visitor may not belong to any tenant yet.
    path("invite/<str:secret>/", views.accept, name="console-invite-accept"),
]
