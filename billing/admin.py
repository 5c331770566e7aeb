"""Django admin for the ledger (read-only) and reconciliation. Model prices and aliases are
edited with the catalog (gateway/admin.py): the hot path and the ledger share them.

The ledger is the truth about what requests cost: nobody edits or deletes it here.
Reconciliation runs are a history: they are read here, with their rows inline, and a superuser
may prune them; upstream key aliases are edited here (OpenAI key ids). Both writes go through
billing/reconciliation.py's services, which record them in the audit trail.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from billing.models import (
    ReconciliationRow,
    ReconciliationRun,
    UpstreamKeyAlias,
    UsageRecord,
)
from billing.reconciliation import (
    delete_reconciliation_run,
    delete_upstream_key_alias,
    save_upstream_key_alias,
)


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


class ReadOnlyAdmin(admin.ModelAdmin):
    """Every field shown, nothing added, changed or deleted."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Viewing needs only the view permission; saving is refused.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ("request_id", "tenant", "served_model", "provider_key", "status",
                    "input_tokens", "output_tokens", "cached_input_tokens", "cache_write_tokens",
                    "reasoning_tokens", "cost_micros", "http_status", "ended_at")
    list_filter = ("status", "endpoint", "streamed")
    search_fields = ("request_id", "served_model", "model")
    date_hierarchy = "ended_at"
    list_select_related = ("tenant", "provider_key")
    show_full_result_count = False  # COUNT(*) over the whole ledger on every page is slow


class ReconciliationRowInline(admin.TabularInline):
    model = ReconciliationRow
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ("flagged", "day", "provider_key", "api_key_id", "model", "tenant", "ours_input",
              "ours_output", "theirs_input", "theirs_output", "difference", "difference_rate",
              "ours_cached_input", "theirs_cached_input", "ours_cache_write",
              "theirs_cache_write", "ours_reasoning", "theirs_reasoning", "ours_cost_micros",
              "theirs_cost_micros", "theirs_priced_micros", "note")
    readonly_fields = fields
    ordering = ("-flagged", "day", "model")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[ReconciliationRow]:
        return super().get_queryset(request).select_related("provider_key", "tenant")


@admin.register(ReconciliationRun)
class ReconciliationRunAdmin(ReadOnlyAdmin):
    list_display = ("public_id", "period_start", "source", "provider_key", "status",
                    "flagged_count", "rows_count", "max_difference_rate", "is_current",
                    "started_at")
    list_filter = ("status", "source", "period_start")
    search_fields = ("public_id", "provider_key__public_id", "provider_key__name")
    date_hierarchy = "started_at"
    list_select_related = ("provider_key",)
    inlines = [ReconciliationRowInline]

    @admin.display(boolean=True, description="current")
    def is_current(self, run: ReconciliationRun) -> bool:
        return run.superseded_by_id is None

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Old history may be pruned by a superuser.
        return bool(request.user.is_superuser)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # A run's rows go with it (nobody deletes a row alone): no permission of their own.
        perms_needed.discard(ReconciliationRow._meta.verbose_name)
        return deleted, counts, perms_needed, protected

    def delete_model(self, request: HttpRequest, obj: ReconciliationRun) -> None:
        delete_reconciliation_run(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ReconciliationRun]) -> None:
        for run in queryset:
            delete_reconciliation_run(run, actor=_actor(request))


@admin.register(ReconciliationRow)
class ReconciliationRowAdmin(ReadOnlyAdmin):
    list_display = ("run", "day", "provider_key", "api_key_id", "model", "tenant", "ours_input",
                    "ours_output", "theirs_input", "theirs_output", "difference_rate", "flagged",
                    "note")
    list_filter = ("flagged", "day", "run__source")
    search_fields = ("run__public_id", "model", "api_key_id", "note")
    list_select_related = ("run", "provider_key", "tenant")


@admin.register(UpstreamKeyAlias)
class UpstreamKeyAliasAdmin(admin.ModelAdmin):
    list_display = ("upstream_key_id", "provider_key", "derived", "created_at")
    list_filter = ("derived",)
    search_fields = ("upstream_key_id", "provider_key__public_id", "provider_key__name")
    autocomplete_fields = ("provider_key",)
    readonly_fields = ("derived", "created_at")
    list_select_related = ("provider_key",)

    def save_model(self, request: HttpRequest, obj: UpstreamKeyAlias, form: Any,
                   change: bool) -> None:
        save_upstream_key_alias(obj, actor=_actor(request))

    def delete_model(self, request: HttpRequest, obj: UpstreamKeyAlias) -> None:
        delete_upstream_key_alias(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[UpstreamKeyAlias]) -> None:
        for alias in queryset.select_related("provider_key"):
            delete_upstream_key_alias(alias, actor=_actor(request))
