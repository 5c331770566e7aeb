"""Django admin for platform operators.

Every save and delete here goes through the services, as the console's and the API's do: the
same audit events, the same limit checks and the same invalidation messages to the gateways
(tenants.services, tenants.membership). What no service does is not offered: tenants, projects
and keys are not deleted (suspend a tenant, revoke a key), a tenant's slug, a project's tenant
and slug, a plan's name and a key's expiry are fixed once created. Keys are issued and rotated
with the console, the API or the management commands only, because the plaintext must be shown
exactly once to the person who asked for it. Digests are never displayed.
"""

from __future__ import annotations

from copy import copy
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.forms import BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from tenants.allotments import ALLOTMENT_FIELDS, over_quota_warnings
from tenants.key_usability import key_usability
from tenants.management_tokens import masked_token
from tenants.membership import (
    LastOwner,
    add_member,
    change_member_role,
    remove_member,
    revoke_invitation,
)
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
from tenants.services.allotments import check_allotments, keys_above_project_limit_errors
from tenants.services.api_keys import KEY_EDIT_FIELDS, revoke_key, update_key
from tenants.services.limits import check_key_limits, check_project_limits
from tenants.services.management_tokens import revoke_management_token
from tenants.services.plans import (
    PLAN_CREATE_FIELDS,
    PLAN_FIELDS,
    create_plan,
    delete_plan,
    update_plan,
)
from tenants.services.projects import PROJECT_EDIT_FIELDS, create_project, update_project
from tenants.services.tenants import (
    TENANT_OVERRIDE_FIELDS,
    change_plan,
    create_tenant,
    rename_tenant,
    set_tenant_limits,
    set_tenant_status,
)


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


def _changes(form: ModelForm, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The form's changed values of the fields a service may change."""
    return {name: form.cleaned_data[name] for name in form.changed_data if name in allowed}


def _no_delete(self: admin.ModelAdmin, request: HttpRequest, obj: Any = None) -> bool:
    return False


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

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The API names plans by name: it stays what it was created as; its cycle is its
        # tenants' windows, fixed once created too (tenants.services.plans.PLAN_CREATE_FIELDS).
        if obj is None:
            return self.readonly_fields
        return (*self.readonly_fields, "name", "reset_cycle", "allows_custom_cycle")

    def save_model(self, request: HttpRequest, obj: Plan, form: ModelForm, change: bool) -> None:
        if change:
            # Audited, and every gateway applies it to the next request.
            update_plan(obj, actor=_actor(request), **_changes(form, PLAN_FIELDS))
            return
        fields = {n: form.cleaned_data[n] for n in PLAN_CREATE_FIELDS if n in form.cleaned_data}
        created = create_plan(obj.name, actor=_actor(request), **fields)
        obj.pk, obj.created_at, obj.updated_at = created.pk, created.created_at, created.updated_at

    def delete_model(self, request: HttpRequest, obj: Plan) -> None:
        delete_plan(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Plan]) -> None:
        for plan in queryset:
            delete_plan(plan, actor=_actor(request))


class ProjectInline(admin.TabularInline):
    model = Project
    fields = ("public_id", "slug", "name", "tokens_per_day", "tokens_per_month",
              "allotment_tokens_per_day", "allotment_tokens_per_month", "created_at")
    readonly_fields = fields
    extra = 0
    show_change_link = True
    # Projects are created through create_project (ProjectAdmin or the CLI) so it is audited.
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class MembershipForm(ModelForm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            # A membership is one person's: remove it and add another instead.
            self.fields["user"].disabled = True


class MembershipFormSet(BaseInlineFormSet):
    def clean(self) -> None:
        super().clean()
        before = after = 0
        for form in self.forms:
            if not hasattr(form, "cleaned_data") or not form.cleaned_data:
                continue
            if form.instance.pk is not None and form.initial.get("role") == Membership.Role.OWNER:
                before += 1
            if not self._should_delete_form(form) and (
                form.cleaned_data.get("role") == Membership.Role.OWNER
            ):
                after += 1
        if before and not after:
            raise ValidationError(str(LastOwner()))


class MembershipInline(admin.TabularInline):
    """Added, changed and removed through tenants.membership (audited; operators act as
    owners, so they may make and remove owners, never the last one)."""

    model = Membership
    form = MembershipForm
    formset = MembershipFormSet
    extra = 0
    autocomplete_fields = ("user",)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "public_id", "plan", "status", "created_at")
    list_filter = ("status", "plan")
    search_fields = ("slug", "name", "public_id")
    readonly_fields = ("public_id", "created_at")
    inlines = (ProjectInline, MembershipInline)
    has_delete_permission = _no_delete  # suspend it instead; its ledger keeps it anyway

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The CLI names tenants by slug: it stays what it was created as.
        return (*self.readonly_fields, "slug") if obj is not None else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: Tenant, form: ModelForm, change: bool) -> None:
        actor = _actor(request)
        limits = {
            name: form.cleaned_data[name]
            for name in TENANT_OVERRIDE_FIELDS
            if name in form.cleaned_data
        }
        if not change:
            # Blank override fields mean "inherit the plan": leave them out of the audit record.
            overrides = {name: value for name, value in limits.items() if value is not None}
            created = create_tenant(
                obj.slug, plan_name=obj.plan.name, actor=actor, name=obj.name, **overrides
            )
            if obj.status != created.status:
                set_tenant_status(created, obj.status, actor=actor)
            # The admin redirects to the object it saved, so give it the created row's identity.
            obj.pk, obj.public_id, obj.created_at = (
                created.pk,
                created.public_id,
                created.created_at,
            )
            return
        changed = set(form.changed_data)
        if "name" in changed:
            rename_tenant(obj, obj.name, actor=actor)
        if "plan" in changed:
            change_plan(obj, obj.plan.name, actor=actor)
        changed_limits = {name: value for name, value in limits.items() if name in changed}
        if changed_limits:
            set_tenant_limits(obj, actor=actor, **changed_limits)
        if "status" in changed:
            set_tenant_status(obj, obj.status, actor=actor)
        if changed & {"plan", *TENANT_OVERRIDE_FIELDS}:
            # A lower quota is not refused for the allotments it leaves above it (the pool is
            # then empty); say so, with what to lower.
            for warning in over_quota_warnings(obj):
                messages.warning(request, warning)

    def save_formset(
        self, request: HttpRequest, form: ModelForm, formset: Any, change: bool
    ) -> None:
        if formset.model is not Membership:
            super().save_formset(request, form, formset, change)
            return
        actor, tenant = _actor(request), form.instance
        formset.save(commit=False)  # sorts the rows into new, changed and deleted
        # New owners first, so handing ownership over in one save never passes through none.
        for membership in formset.new_objects:
            add_member(tenant, membership.user, membership.role, actor=actor)
        for membership, fields in formset.changed_objects:
            if "role" in fields:
                change_member_role(membership, membership.role, actor=actor,
                                   by_role=Membership.Role.OWNER)
        for membership in formset.deleted_objects:
            remove_member(membership, actor=actor, by_role=Membership.Role.OWNER)


def _check_allotments_on(form: ModelForm, tenant: Tenant) -> None:
    """The allotment rules on the row as the form would save it, so that a refusal lands on its
    field (the services check again under the tenant's lock)."""
    if not any(name in form.changed_data for name in (*ALLOTMENT_FIELDS, "tokens_per_day",
                                                      "tokens_per_month")):
        return
    row = copy(form.instance)
    for name, value in form.cleaned_data.items():
        if name in ALLOTMENT_FIELDS or name in ("tokens_per_day", "tokens_per_month"):
            setattr(row, name, value)
    if isinstance(row, Project):
        row.tenant = tenant
        # Its own limits cannot go below its keys' allotments either (update_project refuses).
        errors = keys_above_project_limit_errors(row)
        if errors:
            raise ValidationError(errors)
    check_allotments(tenant, row)


class ProjectAdminForm(ModelForm):
    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        tenant = cleaned.get("tenant") if self.instance.pk is None else self.instance.tenant
        if tenant is not None:
            # Within the tenant's limits, as the console and the API check (the service checks
            # again under its lock); here so that a refusal lands on the field.
            check_project_limits(tenant, tokens_per_day=cleaned.get("tokens_per_day"),
                                 tokens_per_month=cleaned.get("tokens_per_month"))
            _check_allotments_on(self, tenant)
        return cleaned


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "tenant", "public_id", "tokens_per_day", "tokens_per_month")
    list_select_related = ("tenant",)
    search_fields = ("slug", "name", "public_id", "tenant__slug")
    readonly_fields = ("public_id", "created_at")
    form = ProjectAdminForm
    # Deleting one would delete its keys unrevoked: revoke them instead.
    has_delete_permission = _no_delete

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return self.readonly_fields
        return (*self.readonly_fields, "tenant", "slug")

    def save_model(self, request: HttpRequest, obj: Project, form: ModelForm, change: bool) -> None:
        if change:
            # Audited; gateways cache projects with the keys.
            update_project(obj, actor=_actor(request), **_changes(form, PROJECT_EDIT_FIELDS))
            return
        created = create_project(
            obj.tenant,
            obj.slug,
            actor=_actor(request),
            name=obj.name,
            tokens_per_day=obj.tokens_per_day,
            tokens_per_month=obj.tokens_per_month,
            pace_share_percent=obj.pace_share_percent,
            pace_spend_micros=obj.pace_spend_micros,
            allotment_tokens_per_day=obj.allotment_tokens_per_day,
            allotment_tokens_per_month=obj.allotment_tokens_per_month,
            within_limits=True,
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


class ApiKeyAdminForm(ModelForm):
    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        key = self.instance
        value = {n: cleaned.get(n, getattr(key, n)) for n in KEY_EDIT_FIELDS}
        # Within the project's and the tenant's limits and the plan's models, as the console
        # and the API check (update_key checks again under its lock).
        check_key_limits(key.project, tokens_per_day=value["tokens_per_day"],
                         tokens_per_month=value["tokens_per_month"],
                         requests_per_minute=value["requests_per_minute"],
                         allowed_models=value["allowed_models"])
        _check_allotments_on(self, key.project.tenant)
        return cleaned


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
        "pace_share_percent",
        "pace_spend_micros",
        "allotment_tokens_per_day",
        "allotment_tokens_per_month",
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
        "expires_at",
        "revoked_at",
        "last_used_at",
        "created_at",
        "created_by",
    )
    inlines = (ApiKeySecretInline,)
    actions = ("revoke_selected",)
    form = ApiKeyAdminForm
    has_delete_permission = _no_delete  # revoke instead: the gateways hear of a revocation

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A revoked key cannot be changed (update_key refuses): its page is read-only.
        if obj is not None and key_usability(obj).revoked:
            return False
        return super().has_change_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: ApiKey, form: ModelForm, change: bool) -> None:
        # Audited; sub-limits and allowed models are cached by the gateways.
        update_key(obj, actor=_actor(request), **_changes(form, KEY_EDIT_FIELDS))

    @admin.display(description="Key")
    def masked(self, api_key: ApiKey) -> str:
        return masked_key(api_key)

    @admin.action(description="Revoke selected API keys")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = sum(revoke_key(key, actor=_actor(request)) for key in queryset)
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

    list_display = ("public_id", "masked", "name", "tenant", "scope", "issued_by", "created_by",
                    "created_at", "last_used_at", "expires_at", "revoked_at")
    list_select_related = ("tenant", "issued_by")
    list_filter = ("scope", "revoked_at")
    search_fields = ("public_id", "name", "tenant__slug", "prefix")
    fields = ("public_id", "masked", "name", "tenant", "scope", "issued_by", "created_by",
              "created_at", "last_used_at", "expires_at", "revoked_at")
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
            revoke_management_token(token, actor=_actor(request))
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
