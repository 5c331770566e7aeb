"""Console pages for the tenant's members and invitations, and accepting an invitation."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
