"""Management API routes of the billing app: usage, live quota, webhooks and cost reports."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
