"""Billing routes outside /api/ (the management API's are in billing/api/urls.py)."""

from django.urls import path

from billing import views

urlpatterns = [
    path("metrics", views.metrics_view, name="metrics"),
]
