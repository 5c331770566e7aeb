"""Management API: the tenant's members and invitations (views in tenants/api/member_views.py)."""

from __future__ import annotations

from django.urls import URLPattern, path

from tenants.api import member_views as views

urlpatterns: list[URLPattern] = [
    path("tenants/<str:tenant_id>/members/", views.MemberListView.as_view(),
         name="api-member-list"),
    path("tenants/<str:tenant_id>/members/<str:member_id>/", views.MemberDetailView.as_view(),
         name="api-member-detail"),
    path("tenants/<str:tenant_id>/invitations/", views.InvitationListView.as_view(),
         name="api-invitation-list"),
    path("tenants/<str:tenant_id>/invitations/<str:invitation_id>/revoke",
         views.InvitationRevokeView.as_view(), name="api-invitation-revoke"),
]
