"""Management API: projects, API keys, plans, limits, management tokens and audit events."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
