"""Django admin's app config with Tollgate's site (config/admin_site.py). Kept apart from the
site: INSTALLED_APPS imports this module before the app registry is ready."""

from __future__ import annotations

from django.contrib.admin.apps import AdminConfig


class TollgateAdminConfig(AdminConfig):
    default_site = "config.admin_site.TollgateAdminSite"
