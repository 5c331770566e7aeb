"""/console/ routes. Tenant pages live under /console/t/<tenant public id>/."""

from django.urls import path

from tenants.console import auth_views

urlpatterns = [
    path("login/", auth_views.ConsoleLoginView.as_view(), name="console-login"),
    path("logout/", auth_views.ConsoleLogoutView.as_view(), name="console-logout"),
    path("", auth_views.console_index, name="console-index"),
    path("switch/", auth_views.switch_tenant, name="console-switch"),
]
