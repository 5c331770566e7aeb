"""Management API: the tenant's members and invitations."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
