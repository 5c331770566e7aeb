"""Console login, logout and tenant switching."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from config.console.frame import SESSION_TENANT
from config.console.login_throttle import THROTTLED_MESSAGE, throttled_login
from tenants.access import principal_for


class ConsoleLoginView(auth_views.LoginView):
    template_name = "console/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        def refuse() -> HttpResponse:
            return render(request, self.template_name,
                          {"form": AuthenticationForm(request, data=None),
                           "throttled": THROTTLED_MESSAGE}, status=429)

        return throttled_login(request, lambda: super(ConsoleLoginView, self).post(
            request, *args, **kwargs), refuse)


class ConsoleLogoutView(auth_views.LogoutView):
    pass


@login_required
def console_index(request: HttpRequest) -> HttpResponse:
    """/console/: the tenant last worked on, else the first one; a page saying so when none."""
    tenants = principal_for(request).visible_tenants().order_by("name")
    last = request.session.get(SESSION_TENANT)
    tenant = tenants.filter(public_id=last).first() if last else None
    tenant = tenant or tenants.first()
    if tenant is None:
        return render(request, "console/no_tenants.html")
    return redirect("console-dashboard", tenant.public_id)


@login_required
@require_POST
def switch_tenant(request: HttpRequest) -> HttpResponse:
    public_id = request.POST.get("tenant", "")
    tenant = principal_for(request).visible_tenants().filter(public_id=public_id).first()
    if tenant is None:
        raise Http404("No such tenant.")
    request.session[SESSION_TENANT] = tenant.public_id
    return HttpResponseRedirect(reverse("console-dashboard", args=[tenant.public_id]))
