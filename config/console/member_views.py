"""Console pages: the tenant's members and invitations, and accepting an invitation.

Writes go through tenants.membership; these views only translate forms and errors.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth import login
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from config.console.frame import SESSION_TENANT, actor, render_page, tenant_page
from config.console.one_use_forms import first_submission
from tenants.access import principal_for
from tenants.invitation_links import invitation_link
from tenants.membership import (
    INVITABLE_ROLES,
    InvitationClosed,
    InvitationUnusable,
    LastOwner,
    RoleNotAllowed,
    accept_invitation,
    accept_invitation_as_new_user,
    change_member_role,
    invitation_for_secret,
    invite_member,
    members_of,
    pending_invitations,
    remove_member,
    revoke_invitation,
    tenant_invitations,
)
from tenants.models import Membership, Tenant

INVITE_ROLE_CHOICES = [(value, label) for value, label in Membership.Role.choices
                       if value in INVITABLE_ROLES]


class InviteForm(forms.Form):
    email = forms.EmailField(label="Email address")
    role = forms.ChoiceField(choices=INVITE_ROLE_CHOICES, initial=Membership.Role.ADMIN)


class NewAccountForm(forms.Form):
    username = forms.CharField(max_length=150)
    password1 = forms.CharField(label="Password", strip=False, widget=forms.PasswordInput)
    password2 = forms.CharField(label="Password again", strip=False, widget=forms.PasswordInput)

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("password1") and data.get("password1") != data.get("password2"):
            self.add_error("password2", "The two passwords differ.")
        return data


def _members_page(request: HttpRequest, tenant: Tenant, *, form: InviteForm | None = None,
                  issued: Any = None, status: int = 200) -> HttpResponse:
    principal = principal_for(request)
    role = principal.role_in(tenant)
    members_list = list(members_of(tenant))
    return render_page(request, tenant, "console/members.html", {
        "members": members_list,
        "owner_count": sum(m.role == Membership.Role.OWNER for m in members_list),
        "invitations": pending_invitations(tenant),
        "invite_form": form or InviteForm(),
        "issued": issued,
        "roles": Membership.Role.choices,
        # Only an owner may hand out or take away ownership (tenants/membership.py).
        "is_owner": role == Membership.Role.OWNER,
        "me": request.user.get_username(),
    }, nav="console-members", status=status)


@require_safe
@tenant_page()
def members(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    return _members_page(request, tenant)


@require_POST
@tenant_page(manage=True)
def invite(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    form = InviteForm(request.POST)
    if not form.is_valid():
        return _members_page(request, tenant, form=form, status=400)
    if not first_submission(request):
        messages.warning(request, (
            f"This form was sent already: {form.cleaned_data['email']} is invited, and the link "
            "is not shown again. If it was lost, revoke the invitation and invite them again."))
        return redirect("console-members", tenant.public_id)
    try:
        issued = invite_member(
            tenant, form.cleaned_data["email"], role=form.cleaned_data["role"],
            actor=actor(request),
            accept_url=lambda secret: invitation_link(request.build_absolute_uri("/"), secret),
        )
    except ValidationError as exc:
        for field, errors in exc.message_dict.items():
            form.add_error(field if field in form.fields else None, errors)
        return _members_page(request, tenant, form=form, status=400)
    # Rendered in the POST's answer rather than after a redirect: the link must not be put in
    # the session or any other store to survive one.
    return _members_page(request, tenant, issued=issued)


def _membership(tenant: Tenant, username: str) -> Membership:
    membership = members_of(tenant).filter(user__username=username).first()
    if membership is None:
        raise Http404("No such member.")
    return membership


@require_POST
@tenant_page(manage=True)
def change_role(request: HttpRequest, tenant: Tenant, username: str) -> HttpResponse:
    membership = _membership(tenant, username)
    role = request.POST.get("role", "")
    by_role = principal_for(request).role_in(tenant)
    try:
        before = membership.role
        change_member_role(membership, role, actor=actor(request), by_role=by_role)
    except RoleNotAllowed as exc:
        raise PermissionDenied(str(exc)) from None
    except (LastOwner, ValidationError) as exc:
        text = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        messages.error(request, text)
    else:
        if before != membership.role:
            messages.success(request, f"{username} is now {membership.get_role_display().lower()}.")
    return redirect("console-members", tenant.public_id)


@require_POST
@tenant_page(manage=True)
def remove(request: HttpRequest, tenant: Tenant, username: str) -> HttpResponse:
    membership = _membership(tenant, username)
    try:
        remove_member(membership, actor=actor(request),
                      by_role=principal_for(request).role_in(tenant))
    except RoleNotAllowed as exc:
        raise PermissionDenied(str(exc)) from None
    except LastOwner as exc:
        messages.error(request, str(exc))
        return redirect("console-members", tenant.public_id)
    messages.success(request, f"{username} was removed from {tenant.name}.")
    if username == request.user.get_username():
        return redirect("console-index")  # they no longer see this tenant
    return redirect("console-members", tenant.public_id)


@require_POST
@tenant_page(manage=True)
def revoke(request: HttpRequest, tenant: Tenant, invitation_id: str) -> HttpResponse:
    invitation = tenant_invitations(tenant).filter(public_id=invitation_id).first()
    if invitation is None:
        raise Http404("No such invitation.")
    try:
        revoke_invitation(invitation, actor=actor(request))
    except InvitationClosed as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"The invitation for {invitation.email} was revoked.")
    return redirect("console-members", tenant.public_id)


def _joined(request: HttpRequest, membership: Membership) -> HttpResponse:
    request.session[SESSION_TENANT] = membership.tenant.public_id
    messages.success(request, f"Welcome to {membership.tenant.name}: you joined as "
                              f"{membership.get_role_display().lower()}.")
    return redirect("console-index")


@require_http_methods(["GET", "POST"])
def accept(request: HttpRequest, secret: str) -> HttpResponse:
    """/console/invite/<secret>/: a logged-in user joins with one click; a visitor creates an
    account (username and password) and joins. A link that cannot be used changes nothing."""
    try:
        invitation = invitation_for_secret(secret)
    except InvitationUnusable as exc:
        return render(request, "console/invite_invalid.html", {"problem": str(exc)}, status=410)
    form = NewAccountForm()
    if request.method == "POST":
        try:
            if request.user.is_authenticated:
                return _joined(request, accept_invitation(secret, request.user))
            form = NewAccountForm(request.POST)
            if form.is_valid():
                membership = accept_invitation_as_new_user(
                    secret, username=form.cleaned_data["username"],
                    password=form.cleaned_data["password1"])
                login(request, membership.user,
                      backend="django.contrib.auth.backends.ModelBackend")
                return _joined(request, membership)
        except InvitationUnusable as exc:
            return render(request, "console/invite_invalid.html", {"problem": str(exc)},
                          status=410)
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                form.add_error("password1" if field == "password" else
                               field if field in form.fields else None, errors)
    context = {"invitation": invitation, "form": form,
               "login_url": f"{reverse('console-login')}?next={request.path}"}
    return render(request, "console/invite_accept.html", context,
                  status=400 if form.errors else 200)
