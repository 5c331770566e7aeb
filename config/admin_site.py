"""Django admin with the console's login throttle: /admin/login/ spends the same per-username
and per-address budgets (config/console/login_throttle.py), so the admin is no side door for
guessing passwords."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

from config.console.login_throttle import THROTTLED_MESSAGE, throttled_login


class TollgateAdminSite(admin.AdminSite):
    def login(self, request: HttpRequest, extra_context: dict[str, Any] | None = None
              ) -> HttpResponse:
        def refuse() -> HttpResponse:
            return HttpResponse(THROTTLED_MESSAGE, status=429,
                                content_type="text/plain; charset=utf-8")

        return throttled_login(request, lambda: super(TollgateAdminSite, self).login(
            request, extra_context), refuse)
