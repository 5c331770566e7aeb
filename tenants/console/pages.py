"""Console pages for projects, API keys, limits, management tokens and the audit log."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
