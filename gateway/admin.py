"""Django admin for the model catalog, model prices and aliases, and the upstream provider keys.

Provider secrets are write-only here: the form has a password field that sets a new secret and
never renders the stored one; the list and the change page show only the last four characters.
Prices are append-mostly: a price that has been used to cost requests should not change, so a
new price is a new row and an existing one can only be closed (its `valid_to` set).

The provider key list and page show each key's circuit breakers (gateway/circuit.py), read from
Redis: the key's own (transport failures) and one per model it served (5xx answers), with the
state, the errors and calls of the current window, when an open one may half-open, and the
transitions so far. Redis unreachable: the column says so, the page still works.

Every save and delete goes through the services of gateway/prices.py and gateway/providers.py,
as the management commands' do: validated, audited, and published so that every gateway process
reloads its catalog or provider pool.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from gateway.models import ModelAlias, ModelPrice, ModelSpec, ProviderKey
from gateway.prices import (
    Price,
    delete_alias,
    delete_model_spec,
    save_alias,
    save_model_spec,
    save_price,
)
from gateway.providers import (
    KEY_BREAKER,
    apply_provider_secret,
    create_provider_key,
    delete_provider_key,
    normalize_base_url,
    set_provider_secret,
    update_provider_key,
)
from quotas.breakers import BreakerSnapshot, BreakerStore
from quotas.engine import QuotaError
from quotas.runtime import get_engine


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


@admin.register(ModelSpec)
class ModelSpecAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "kind",
        "tokenizer",
        "context_window",
        "default_output_tokens",
        "max_output_tokens",
        "input_price_micros_per_mtok",
        "output_price_micros_per_mtok",
        "cached_input_micros_per_mtok",
        "cache_write_micros_per_mtok",
        "reasoning_micros_per_mtok",
        "enabled",
    )
    list_filter = ("kind", "tokenizer", "enabled")
    search_fields = ("name",)
    readonly_fields = ("created_at", "updated_at")

    # Every gateway worker keeps the catalog in memory: the services tell them to reload it.
    def save_model(self, request: HttpRequest, obj: ModelSpec, form: forms.ModelForm,
                   change: bool) -> None:
        save_model_spec(obj, actor=_actor(request), changed=form.changed_data)

    def delete_model(self, request: HttpRequest, obj: ModelSpec) -> None:
        delete_model_spec(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ModelSpec]) -> None:
        for spec in queryset:
            delete_model_spec(spec, actor=_actor(request))


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = ("model", "input_micros_per_mtok", "output_micros_per_mtok",
                    "cached_input_micros_per_mtok", "cache_write_micros_per_mtok",
                    "reasoning_micros_per_mtok", "valid_from", "valid_to")
    search_fields = ("model",)
    list_filter = ("model",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        # A period's prices (every class's too) are what charged its calls: close it, add anew.
        return ("model", "input_micros_per_mtok", "output_micros_per_mtok",
                "cached_input_micros_per_mtok", "cache_write_micros_per_mtok",
                "reasoning_micros_per_mtok", "valid_from")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: ModelPrice, form: forms.ModelForm,
                   change: bool) -> None:
        save_price(obj, actor=_actor(request))  # validated, and every gateway reloads its catalog


@admin.register(ModelAlias)
class ModelAliasAdmin(admin.ModelAdmin):
    list_display = ("alias", "model", "created_at")
    search_fields = ("alias", "model__name")
    list_select_related = ("model",)
    autocomplete_fields = ("model",)
    readonly_fields = ("created_at",)

    def save_model(self, request: HttpRequest, obj: ModelAlias, form: forms.ModelForm,
                   change: bool) -> None:
        save_alias(obj, actor=_actor(request))

    # An alias deleted here stops applying on every gateway at once.
    def delete_model(self, request: HttpRequest, obj: ModelAlias) -> None:
        delete_alias(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ModelAlias]) -> None:
        for alias in queryset.select_related("model"):
            delete_alias(alias, actor=_actor(request))


_STATE_WORDS = {"closed": "closed", "open": "OPEN", "half_open": "half-open"}


def _breakers(obj: ProviderKey) -> list[BreakerSnapshot] | None:
    """The key's breakers as Redis holds them; None when Redis cannot be read."""
    try:
        return BreakerStore(get_engine().client).snapshots(obj.pk)
    except QuotaError:
        return None


def _breaker_name(breaker: BreakerSnapshot) -> str:
    return "key (transport)" if breaker.model == KEY_BREAKER else f"model {breaker.model}"


def _open_until(breaker: BreakerSnapshot) -> str:
    if breaker.state != "open":
        return "-"
    return datetime.fromtimestamp(breaker.until_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def breaker_summary(obj: ProviderKey) -> str:
    """One line for the list: "closed", or each breaker that is not closed."""
    if not obj.pk:
        return "-"
    breakers = _breakers(obj)
    if breakers is None:
        return "unknown (Redis unreachable)"
    resting = [f"{_STATE_WORDS.get(b.state, b.state)}: {_breaker_name(b)}"
               + (f" until {_open_until(b)}" if b.state == "open" else "")
               for b in breakers if b.state != "closed"]
    return "; ".join(resting) if resting else "closed"


def breaker_table(obj: ProviderKey) -> SafeString | str:
    """Every breaker of the key, for its page."""
    if not obj.pk:
        return "-"
    breakers = _breakers(obj)
    if breakers is None:
        return "unknown (Redis unreachable)"
    rows = format_html_join(
        "", "<tr><td>{}</td><td>{}</td><td>{} / {}</td><td>{}</td><td>{} / {} / {}</td></tr>",
        ((_breaker_name(b), _STATE_WORDS.get(b.state, b.state), b.errors, b.calls,
          _open_until(b), b.opened, b.half_opened, b.closed) for b in breakers))
    return format_html(
        "<table><thead><tr><th>Breaker</th><th>State</th><th>Errors / calls (window)</th>"
        "<th>Open until</th><th>Opened / half-opened / closed</th></tr></thead>"
        "<tbody>{}</tbody></table>", rows)


def _default_price(obj: ProviderKey) -> Price | None:
    pin, pout = obj.default_input_price_micros_per_mtok, obj.default_output_price_micros_per_mtok
    return None if pin is None or pout is None else Price(pin, pout)


class ProviderKeyForm(forms.ModelForm):
    secret = forms.CharField(
        required=False,
        strip=True,
        # render_value=False: a re-displayed form (after a validation error) must not echo it.
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Write-only. Required for a new key; leave empty to keep the current secret.",
    )

    class Meta:
        model = ProviderKey
        fields = (
            "name",
            "kind",
            "base_url",
            "models",
            "rpm_capacity",
            "tpm_capacity",
            "priority",
            "default_input_price_micros_per_mtok",
            "default_output_price_micros_per_mtok",
            "enabled",
            "tenant",
        )

    def clean_base_url(self) -> str:
        return normalize_base_url(self.cleaned_data["base_url"])

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if self.instance.pk is None and not cleaned.get("secret"):
            self.add_error("secret", "A new provider key needs a secret.")
        return cleaned

    def _post_clean(self) -> None:
        # The model's full_clean needs secret_encrypted; fill it before the model validates.
        secret = self.cleaned_data.get("secret")
        if secret:
            apply_provider_secret(self.instance, secret)
        super()._post_clean()


@admin.register(ProviderKey)
class ProviderKeyAdmin(admin.ModelAdmin):
    form = ProviderKeyForm
    list_display = (
        "name",
        "public_id",
        "kind",
        "base_url",
        "masked_secret",
        "priority",
        "rpm_capacity",
        "tpm_capacity",
        "tenant",
        "enabled",
        "breaker",
    )
    list_filter = ("enabled", "kind")
    list_select_related = ("tenant",)
    search_fields = ("name", "public_id", "base_url", "tenant__slug")
    autocomplete_fields = ("tenant",)
    readonly_fields = ("public_id", "masked_secret", "breakers", "created_at", "updated_at")
    fields = (
        "public_id",
        "name",
        "kind",
        "base_url",
        "masked_secret",
        "secret",
        "models",
        "rpm_capacity",
        "tpm_capacity",
        "priority",
        "default_input_price_micros_per_mtok",
        "default_output_price_micros_per_mtok",
        "enabled",
        "tenant",
        "breakers",
        "created_at",
        "updated_at",
    )

    @admin.display(description="Circuit breaker")
    def breaker(self, obj: ProviderKey) -> str:
        return breaker_summary(obj)

    @admin.display(description="Circuit breakers")
    def breakers(self, obj: ProviderKey) -> SafeString | str:
        return breaker_table(obj)

    @admin.display(description="Secret")
    def masked_secret(self, obj: ProviderKey) -> str:
        if not obj.pk:
            return "-"
        return f"****{obj.secret_last4}" if obj.secret_last4 else "**** (short secret)"

    def save_model(
        self, request: HttpRequest, obj: ProviderKey, form: forms.ModelForm, change: bool
    ) -> None:
        secret = form.cleaned_data.get("secret")
        if not change:
            created = create_provider_key(
                obj.name,
                base_url=obj.base_url,
                secret=secret,
                models=obj.models,
                rpm_capacity=obj.rpm_capacity,
                tpm_capacity=obj.tpm_capacity,
                priority=obj.priority,
                tenant=obj.tenant,
                enabled=obj.enabled,
                default_price=_default_price(obj),
                kind=obj.kind,
                actor=_actor(request),
            )
            # The admin redirects to the object it saved, so give it the created row's identity.
            obj.pk, obj.public_id = created.pk, created.public_id
            obj.created_at, obj.updated_at = created.created_at, created.updated_at
            return
        update_provider_key(
            obj, [name for name in form.changed_data if name != "secret"], actor=_actor(request)
        )
        if secret:
            set_provider_secret(obj, secret, actor=_actor(request))

    def delete_model(self, request: HttpRequest, obj: ProviderKey) -> None:
        delete_provider_key(obj, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ProviderKey]) -> None:
        for provider_key in queryset.select_related("tenant"):
            delete_provider_key(provider_key, actor=_actor(request))
