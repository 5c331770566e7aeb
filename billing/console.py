"""Console pages of the billing app: the dashboard, webhooks and cost reports."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
