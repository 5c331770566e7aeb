"""/console/ routes. Tenant pages live under /console/t/<tenant public id>/."""

from django.urls import path

from billing.console import urlpatterns as billing_pages
from tenants.console import auth_views
from tenants.console.members import urlpatterns as member_pages
from tenants.console.pages import urlpatterns as tenant_pages

urlpatterns = [
    path("login/", auth_views.ConsoleLoginView.as_view(), name="console-login"),
    path("logout/", auth_views.ConsoleLogoutView.as_view(), name="console-logout"),
    path("", auth_views.console_index, name="console-index"),
    path("switch/", auth_views.switch_tenant, name="console-switch"),
    *billing_pages,
    *tenant_pages,
    *member_pages,
]
