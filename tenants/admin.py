"""Django admin for platform operators.

Changes that the audit trail must record (creating tenants and projects, plan, limit and status
changes, key revocation) go through tenants.services rather than a plain save. Keys are issued
and rotated with the management commands only, because the plaintext must be shown exactly once
to the person who asked for it. Digests are never displayed.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from tenants import services
from tenants.invalidation import publish
from tenants.management_tokens import masked_token
from tenants.membership import revoke_invitation
from tenants.models import (
    ApiKey,
    ApiKeySecret,
    AuditEvent,
    Invitation,
    ManagementToken,
    Membership,
    Plan,
    Project,
    Tenant,
)
from tenants.selectors import masked_key


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "display_name",
        "tokens_per_day",
        "tokens_per_minute",
        "requests_per_second",
        "over_quota_policy",
        "queue_priority",
        "safety_factor",
    )
    readonly_fields = ("created_at", "updated_at")

    def save_model(self, request: HttpRequest, obj: Plan, form: ModelForm, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if change:
            publish("plan", obj.pk)  # limits and policy take effect on the next request


class ProjectInline(admin.TabularInline):
    model = Project
    fields = ("public_id", "slug", "name", "tokens_per_day", "tokens_per_month", "created_at")
    readonly_fields = fields
    extra = 0
    show_change_link = True
    # Projects are created through create_project (ProjectAdmin or the CLI) so it is audited.
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "public_id", "plan", "status", "created_at")
    list_filter = ("status", "plan")
    search_fields = ("slug", "name", "public_id")
    readonly_fields = ("public_id", "created_at")
    inlines = (ProjectInline, MembershipInline)

    def save_model(self, request: HttpRequest, obj: Tenant, form: ModelForm, change: bool) -> None:
        actor = _actor(request)
        limits = {
            name: form.cleaned_data[name]
            for name in services.TENANT_OVERRIDE_FIELDS
            if name in form.cleaned_data
        }
        if not change:
            # Blank override fields mean "inherit the plan": leave them out of the audit record.
            overrides = {name: value for name, value in limits.items() if value is not None}
            created = services.create_tenant(
                obj.slug, plan_name=obj.plan.name, actor=actor, name=obj.name, **overrides
            )
            if obj.status != created.status:
                services.set_tenant_status(created, obj.status, actor=actor)
            # The admin redirects to the object it saved, so give it the created row's identity.
            obj.pk, obj.public_id, obj.created_at = (
                created.pk,
                created.public_id,
                created.created_at,
            )
            return
        changed = set(form.changed_data)
        if changed & {"slug", "name"}:
            Tenant.objects.filter(pk=obj.pk).update(slug=obj.slug, name=obj.name)
        if "plan" in changed:
            services.change_plan(obj, obj.plan.name, actor=actor)
        changed_limits = {name: value for name, value in limits.items() if name in changed}
        if changed_limits:
            services.set_tenant_limits(obj, actor=actor, **changed_limits)
        if "status" in changed:
            services.set_tenant_status(obj, obj.status, actor=actor)


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "tenant", "public_id", "tokens_per_day", "tokens_per_month")
    list_select_related = ("tenant",)
    search_fields = ("slug", "name", "public_id", "tenant__slug")
    readonly_fields = ("public_id", "created_at")

    def save_model(self, request: HttpRequest, obj: Project, form: ModelForm, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            publish("tenant", obj.tenant_id)  # gateways cache projects with the keys
            return
        created = services.create_project(
            obj.tenant,
            obj.slug,
            actor=_actor(request),
            name=obj.name,
            tokens_per_day=obj.tokens_per_day,
            tokens_per_month=obj.tokens_per_month,
        )
        obj.pk, obj.public_id, obj.created_at = created.pk, created.public_id, created.created_at


class ApiKeySecretInline(admin.TabularInline):
    model = ApiKeySecret
    fields = ("masked", "created_at", "expires_at", "revoked_at")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="Secret")
    def masked(self, secret: ApiKeySecret) -> str:
        return secret.masked


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "public_id",
        "masked",
        "name",
        "project",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_select_related = ("project",)
    list_filter = ("revoked_at",)
    search_fields = (
        "public_id",
        "name",
        "project__slug",
        "project__tenant__slug",
        "secrets__prefix",
    )
    fields = (
        "public_id",
        "masked",
        "project",
        "name",
        "tokens_per_day",
        "tokens_per_month",
        "requests_per_minute",
        "max_concurrency",
        "allowed_models",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "created_at",
        "created_by",
    )
    readonly_fields = (
        "public_id",
        "masked",
        "project",
        "revoked_at",
        "last_used_at",
        "created_at",
        "created_by",
    )
    inlines = (ApiKeySecretInline,)
    actions = ("revoke_selected",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="Key")
    def save_model(self, request: HttpRequest, obj: ApiKey, form: ModelForm, change: bool) -> None:
        super().save_model(request, obj, form, change)
        publish("api_key", obj.pk)  # sub-limits and allowed models are cached by the gateways

    def masked(self, api_key: ApiKey) -> str:
        return masked_key(api_key)

    @admin.action(description="Revoke selected API keys")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = sum(services.revoke_key(key, actor=_actor(request)) for key in queryset)
        self.message_user(request, f"Revoked {revoked} API key(s).", messages.SUCCESS)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "action", "target", "actor", "tenant")
    list_filter = ("action",)
    list_select_related = ("tenant",)
    search_fields = ("target", "actor", "tenant__slug")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ManagementToken)
class ManagementTokenAdmin(admin.ModelAdmin):
    """Tokens are issued with `manage.py mgmt_token_issue` or from the console, where the
    plaintext is shown once; here operators see them masked and may revoke them. The digest is
    never displayed."""

    list_display = ("public_id", "masked", "name", "tenant", "created_by", "created_at",
                    "last_used_at", "expires_at", "revoked_at")
    list_select_related = ("tenant",)
    list_filter = ("revoked_at",)
    search_fields = ("public_id", "name", "tenant__slug", "prefix")
    fields = ("public_id", "masked", "name", "tenant", "created_by", "created_at",
              "last_used_at", "expires_at", "revoked_at")
    readonly_fields = fields
    actions = ("revoke_selected",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoke instead, so the trail keeps what the token was

    @admin.display(description="Token")
    def masked(self, token: ManagementToken) -> str:
        return masked_token(token.prefix, token.last4)

    @admin.action(description="Revoke selected management tokens")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ManagementToken]) -> None:
        revoked = sum(
            services.revoke_management_token(token, actor=_actor(request))
            for token in queryset.select_related("tenant")
        )
        self.message_user(request, f"Revoked {revoked} management token(s).", messages.SUCCESS)


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    """Invitations are made from the console or `manage.py invite` (the link is shown once and
    only its digest is stored); operators see them here and may revoke pending ones."""

    list_display = ("public_id", "email", "role", "tenant", "invited_by", "created_at",
                    "expires_at", "accepted_at", "revoked_at")
    list_select_related = ("tenant",)
    list_filter = ("role", "accepted_at", "revoked_at")
    search_fields = ("public_id", "email", "tenant__slug", "invited_by")
    fields = ("public_id", "email", "role", "tenant", "invited_by", "created_at", "expires_at",
              "accepted_at", "accepted_by", "revoked_at")
    readonly_fields = fields
    actions = ("revoke_selected",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Revoke selected pending invitations")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[Invitation]) -> None:
        pending = queryset.filter(accepted_at__isnull=True, revoked_at__isnull=True)
        revoked = 0
        for invitation in pending.select_related("tenant"):
            revoke_invitation(invitation, actor=_actor(request))
            revoked += 1
        self.message_user(request, f"Revoked {revoked} invitation(s).", messages.SUCCESS)
