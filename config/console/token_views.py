"""The console's management token page: the tenant's tokens for /api/ (masked), issuing one
(its plaintext shown once, in the POST's response) with a scope and a lifetime, and revoking one.
A token issued here carries the issuing user's rights (tenants.membership revokes it with
them)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from config.console.forms import ManagementTokenForm, add_service_errors
from config.console.frame import (
    actor,
    render_page,
    require_manage,
    secret_page,
    tenant_page,
)
from config.console.one_use_forms import REPEATED_MESSAGE, first_submission
from tenants import selectors, services
from tenants.management_tokens import masked_token
from tenants.models import ManagementToken, Tenant
from tenants.services.management_tokens import DEFAULT_LIFETIME

NEVER = "never"
# Lifetimes offered, in days; the default is the services' (90 days).
LIFETIME_DAYS = (7, 30, DEFAULT_LIFETIME.days, 365)


class TokenIssueForm(ManagementTokenForm):
    """The name, plus what the token may do and how long it lives. A post without the two (an
    older script, the tests' minimal form) gets the defaults: full scope, 90 days."""

    scope = forms.ChoiceField(
        choices=ManagementToken.Scope.choices, required=False,
        initial=ManagementToken.Scope.FULL,
        help_text="read: read only; keys: also projects and API keys (not their allotments); "
        "full: everything an admin may do.",
    )
    lifetime = forms.ChoiceField(
        choices=[*((str(days), f"{days} days") for days in LIFETIME_DAYS),
                 (NEVER, "Never expires")],
        required=False, initial=str(DEFAULT_LIFETIME.days), label="Expires after",
        help_text="It stops working then; revoke it sooner if it is no longer needed.",
    )

    def clean_scope(self) -> str:
        return self.cleaned_data.get("scope") or ManagementToken.Scope.FULL

    def clean_lifetime(self) -> str:
        return self.cleaned_data.get("lifetime") or str(DEFAULT_LIFETIME.days)

    def expires_at(self) -> datetime | None:
        lifetime = self.cleaned_data["lifetime"]
        return None if lifetime == NEVER else timezone.now() + timedelta(days=int(lifetime))


def _tokens_page(
    request: HttpRequest, tenant: Tenant, *, form: TokenIssueForm | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    tokens = [
        {"token": token, "masked": masked_token(token.prefix, token.last4),
         "status": ("revoked" if token.revoked_at else
                    "expired" if token.expires_at and token.expires_at <= now else "active")}
        for token in selectors.management_tokens(tenant)
    ]
    context = {"tokens": tokens, "form": form or TokenIssueForm()}
    return render_page(request, tenant, "console/tokens.html", context,
                       nav="console-tokens", status=status)


@require_http_methods(["GET", "POST"])
@tenant_page()
def tokens_page(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method != "POST":
        return _tokens_page(request, tenant)
    require_manage(request, tenant)
    if not first_submission(request):
        messages.warning(request, REPEATED_MESSAGE)
        return redirect("console-tokens", tenant.public_id)
    form = TokenIssueForm(request.POST)
    if form.is_valid():
        try:
            issued = services.issue_management_token(
                tenant, name=form.cleaned_data["name"], actor=actor(request),
                scope=form.cleaned_data["scope"], expires_at=form.expires_at(),
                issued_by=request.user,
            )
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return secret_page(
                request, tenant, title=f"New management token {issued.token.name}",
                plaintext=issued.plaintext, api_key=None, nav="console-tokens", what="token",
                note="Use it as 'Authorization: Bearer <token>' for /api/. It acts as an admin "
                f"of this tenant, with the '{issued.token.scope}' scope, "
                + (f"until {issued.token.expires_at:%Y-%m-%d %H:%M} UTC"
                   if issued.token.expires_at else "with no expiry")
                + "; it is revoked if you leave the tenant or lose its admin role.",
                back_url=reverse("console-tokens", args=[tenant.public_id]),
            )
    return _tokens_page(request, tenant, form=form, status=400)


@require_POST
@tenant_page(manage=True)
def token_revoke(request: HttpRequest, tenant: Tenant, token_id: str) -> HttpResponse:
    token = selectors.management_tokens(tenant).filter(public_id=token_id).first()
    if token is None:
        raise Http404("No such token.")
    if not request.POST.get("confirm"):
        # The checkbox is `required` in the page; this covers clients that skip the browser check.
        messages.error(request, "Tick the confirmation box to revoke the token.")
        return redirect("console-tokens", tenant.public_id)
    if services.revoke_management_token(token, actor=actor(request)):
        messages.success(request, f"Token {token.name} revoked.")
    else:
        messages.info(request, "This token was already revoked.")
    return redirect("console-tokens", tenant.public_id)

