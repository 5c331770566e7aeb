"""The model catalog and the upstream provider keys, as operators edit them in the admin.

The hot path never reads these tables: gateway.catalog and gateway.providers build in-process
snapshots from them.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from tenants.ids import PUBLIC_ID_MAX_LENGTH, PUBLIC_ID_RANDOM_LENGTH, random_base62
from tenants.validators import validate_model_list

_NON_NEGATIVE = [MinValueValidator(0)]
_POSITIVE = [MinValueValidator(1)]


class Tokenizer(models.TextChoices):
    O200K_BASE = "o200k_base", "o200k_base (gpt-4o, gpt-4.1, o-series)"
    CL100K_BASE = "cl100k_base", "cl100k_base (gpt-4, gpt-3.5-turbo, text-embedding-3)"
    HEURISTIC = "heuristic", "Heuristic (unknown tokenizer)"


class ModelKind(models.TextChoices):
    CHAT = "chat", "Chat completions"
    COMPLETION = "completion", "Completions (legacy)"
    EMBEDDING = "embedding", "Embeddings"


class ModelSpec(models.Model):
    """What the gateway needs to know about a model to reserve for it and to price it."""

    name = models.CharField(max_length=200, unique=True, help_text='As clients send it: "gpt-4o".')
    tokenizer = models.CharField(max_length=32, choices=Tokenizer.choices)
    kind = models.CharField(max_length=16, choices=ModelKind.choices, default=ModelKind.CHAT)
    context_window = models.PositiveIntegerField(validators=_POSITIVE)
    default_output_tokens = models.PositiveIntegerField(
        help_text="Output tokens reserved (and sent upstream as max_tokens) when the client "
        "gives no max_tokens."
    )
    max_output_tokens = models.PositiveIntegerField()
    input_price_micros_per_mtok = models.BigIntegerField(
        validators=_NON_NEGATIVE, help_text="Micro-dollars per million input tokens."
    )
    output_price_micros_per_mtok = models.BigIntegerField(
        validators=_NON_NEGATIVE, help_text="Micro-dollars per million output tokens."
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "model"
        ordering = ["name"]
        constraints = [
            # The reservation math relies on these; the database refuses what the admin form
            # would refuse, also for writes that bypass it.
            models.CheckConstraint(
                condition=models.Q(context_window__gte=1), name="modelspec_context_window_min"
            ),
            models.CheckConstraint(
                condition=models.Q(default_output_tokens__lte=models.F("max_output_tokens")),
                name="modelspec_default_output_within_max",
            ),
            models.CheckConstraint(
                condition=models.Q(max_output_tokens__lte=models.F("context_window")),
                name="modelspec_max_output_within_context",
            ),
            models.CheckConstraint(
                condition=models.Q(input_price_micros_per_mtok__gte=0)
                & models.Q(output_price_micros_per_mtok__gte=0),
                name="modelspec_prices_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if (
            self.default_output_tokens is not None
            and self.max_output_tokens is not None
            and self.default_output_tokens > self.max_output_tokens
        ):
            errors["default_output_tokens"] = "Cannot exceed the maximum output tokens."
        if (
            self.max_output_tokens is not None
            and self.context_window is not None
            and self.max_output_tokens > self.context_window
        ):
            errors["max_output_tokens"] = "Cannot exceed the context window."
        if errors:
            raise ValidationError(errors)


def new_provider_key_id() -> str:
    return "pk_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def validate_base_url(value: str) -> None:
    """An http(s) URL of an OpenAI-compatible API root, with no credentials in it.

    Django's URLValidator would refuse single-label hosts such as a docker-compose service name
    ("http://upstream:8000/v1"), which are normal for self-hosted upstreams.
    """
    try:
        parts = urlsplit(value)
        port = parts.port  # raises ValueError on a malformed port
    except ValueError as exc:
        raise ValidationError(f"Not a valid URL: {exc}.") from exc
    if parts.scheme not in {"http", "https"}:
        raise ValidationError("The base URL must start with http:// or https://.")
    if not parts.hostname:
        raise ValidationError("The base URL needs a host.")
    if parts.username is not None or parts.password is not None:
        # The base URL is stored in plain text; credentials belong in the encrypted secret.
        raise ValidationError("Put credentials in the secret, not in the base URL.")
    if parts.query or parts.fragment:
        raise ValidationError("The base URL must not have a query string or a fragment.")
    if port == 0:
        raise ValidationError("The base URL has an invalid port.")


class ProviderKey(models.Model):
    """An upstream API credential. The secret is stored only as Fernet ciphertext."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, editable=False, default=new_provider_key_id
    )
    name = models.CharField(max_length=200)
    base_url = models.CharField(
        max_length=500,
        validators=[validate_base_url],
        help_text="API root of an OpenAI-compatible upstream, e.g. https://api.openai.com/v1",
    )
    secret_encrypted = models.TextField(editable=False)
    secret_last4 = models.CharField(max_length=4, blank=True, editable=False)
    rpm_capacity = models.PositiveIntegerField(
        null=True, blank=True, help_text="Upstream requests per minute; empty if unknown."
    )
    tpm_capacity = models.PositiveIntegerField(
        null=True, blank=True, help_text="Upstream tokens per minute; empty if unknown."
    )
    priority = models.IntegerField(
        default=0, help_text="Higher is tried first; keys of equal priority share the load."
    )
    enabled = models.BooleanField(default=True)
    # A key dedicated to one tenant (e.g. its own upstream account) serves that tenant only.
    # CASCADE rather than SET_NULL: a tenant's key must never become a shared one.
    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="provider_keys",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Last: from here on, `models` in this class body is this field, not django.db.models.
    models = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_model_list],
        help_text="Model names this key serves; empty means every model.",
    )

    class Meta:
        verbose_name = "provider key"
        ordering = ["-priority", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"
