"""The model catalog, its prices and aliases, and the upstream provider keys, as operators edit
them in the admin.

The hot path never reads these tables: gateway.catalog and gateway.providers build in-process
snapshots from them. Prices live here (not in billing) because the hot path holds money with the
same price the ledger charges, and imports run billing -> gateway, never back.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

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


# The prices of token classes an upstream bills apart from their totals (per million tokens,
# micro-dollars). Null: the class costs what its total costs (cached and cache-write input the
# input price, reasoning the output price), so a row without them prices every call as before.
CLASS_PRICE_FIELDS = ("cached_input_micros_per_mtok", "cache_write_micros_per_mtok",
                      "reasoning_micros_per_mtok")


def _class_price(what: str, total: str) -> models.BigIntegerField:
    return models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text=f"Micro-dollars per million {what}; empty: the {total} price.")


def _class_prices_non_negative(prefix: str) -> models.CheckConstraint:
    # Null is allowed (the total's price); said explicitly so that Django's own constraint
    # validation, which evaluates the condition in a query, agrees with the database.
    condition = models.Q()
    for name in CLASS_PRICE_FIELDS:
        condition &= models.Q(**{f"{name}__isnull": True}) | models.Q(**{f"{name}__gte": 0})
    return models.CheckConstraint(condition=condition, name=f"{prefix}_class_prices_non_negative")


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
    cached_input_micros_per_mtok = _class_price("cached input tokens (prompt-cache reads)",
                                                "input")
    cache_write_micros_per_mtok = _class_price("input tokens written to the prompt cache",
                                               "input")
    reasoning_micros_per_mtok = _class_price("reasoning (thinking) output tokens", "output")
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
            _class_prices_non_negative("modelspec"),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.name and ModelAlias.objects.filter(alias=self.name).exists():
            # One name, one meaning: the alias would silently stop applying.
            errors["name"] = "This name is an alias of another model; delete the alias first."
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


class ModelPrice(models.Model):
    """A model's price over a period; overrides the catalog's list price (ModelSpec).

    The table predates the move of prices into the gateway app and keeps its name. Rows are
    append-mostly: a price that has charged calls is not edited; a new period is a new row and
    the old one is closed (valid_to). Resolution: gateway.prices.PriceBook.
    """

    model = models.CharField(max_length=200, help_text='The catalog name, e.g. "gpt-4o" (not '
                             "an alias: aliases take their model's price).")
    input_micros_per_mtok = models.BigIntegerField(validators=_NON_NEGATIVE)
    output_micros_per_mtok = models.BigIntegerField(validators=_NON_NEGATIVE)
    cached_input_micros_per_mtok = _class_price("cached input tokens (prompt-cache reads)",
                                                "input")
    cache_write_micros_per_mtok = _class_price("input tokens written to the prompt cache",
                                               "input")
    reasoning_micros_per_mtok = _class_price("reasoning (thinking) output tokens", "output")
    valid_from = models.DateTimeField()
    valid_to = models.DateTimeField(null=True, blank=True, help_text="Exclusive; empty: open.")

    class Meta:
        db_table = "billing_modelprice"
        verbose_name = "model price"
        ordering = ["model", "-valid_from"]
        constraints = [
            models.CheckConstraint(
                name="price_non_negative",
                condition=models.Q(input_micros_per_mtok__gte=0, output_micros_per_mtok__gte=0)),
            _class_prices_non_negative("price"),
            models.CheckConstraint(
                name="price_period_ordered",
                condition=models.Q(valid_to__isnull=True)
                | models.Q(valid_to__gt=models.F("valid_from"))),
        ]

    def __str__(self) -> str:
        return f"{self.model} from {self.valid_from:%Y-%m-%d}"

    def clean(self) -> None:
        if self.model and ModelAlias.objects.filter(alias=self.model).exists():
            # Never applied: prices are looked up by the alias's catalog model.
            raise ValidationError({"model": "This name is an alias; price its catalog model."})
        if (self.valid_from is not None and self.valid_to is not None
                and self.valid_to <= self.valid_from):
            raise ValidationError({"valid_to": "Must be after the start of the period."})


class ModelAlias(models.Model):
    """Another name of a catalog model, e.g. the dated snapshot "gpt-4o-2024-08-06" of "gpt-4o".

    A call naming the alias is forwarded under that name, and otherwise treated as its model:
    price, output caps and context, per-model limits, allowed-model lists and reconciliation.
    """

    alias = models.CharField(max_length=200, unique=True,
                             help_text='The name clients or bills use, e.g. "gpt-4o-2024-08-06".')
    model = models.ForeignKey(ModelSpec, on_delete=models.CASCADE, related_name="aliases",
                              help_text="The catalog model it stands for.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "model alias"
        verbose_name_plural = "model aliases"
        ordering = ["alias"]

    def __str__(self) -> str:
        return self.alias

    def clean(self) -> None:
        if not self.alias or self.alias != self.alias.strip() or any(c.isspace()
                                                                      for c in self.alias):
            raise ValidationError({"alias": "A model name without spaces."})
        if ModelSpec.objects.filter(name=self.alias).exists():
            raise ValidationError({"alias": "A catalog model has this name already."})
        current = models.Q(valid_to__isnull=True) | models.Q(valid_to__gt=timezone.now())
        if ModelPrice.objects.filter(current, model=self.alias).exists():
            # They would stop applying: an alias is priced as its catalog model.
            raise ValidationError({"alias": "Open price periods exist for this name: close "
                                   "them (valid to) and price the catalog model instead."})


class ProviderKind(models.TextChoices):
    """The API a provider key speaks; a call goes only to keys of its endpoint's kind."""

    OPENAI = "openai", "OpenAI-compatible (chat, completions, embeddings, responses, moderations)"
    ANTHROPIC = "anthropic", "Anthropic (the Messages API)"


def new_provider_key_id() -> str:
    return "pk_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def validate_base_url(value: str) -> None:
    """An http(s) URL of an API root, with no credentials in it.

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
        help_text="API root with its version path: https://api.openai.com/v1 (OpenAI-compatible)"
        " or https://api.anthropic.com/v1 (Anthropic).",
    )
    kind = models.CharField(
        max_length=16, choices=ProviderKind.choices, default=ProviderKind.OPENAI,
        help_text="The API the key speaks: it serves only calls of that API's endpoints.")
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
    # What a call of a model with no price of its own (no ModelPrice period, no catalog entry)
    # costs when this key serves it: without one, such a call is refused (model_not_priced),
    # never forwarded for free. Both or neither.
    default_input_price_micros_per_mtok = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Micro-dollars per million input tokens for models that have no price; "
        "empty: such models are refused.")
    default_output_price_micros_per_mtok = models.BigIntegerField(
        null=True, blank=True, validators=_NON_NEGATIVE,
        help_text="Micro-dollars per million output tokens for models that have no price.")
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
        constraints = [
            models.CheckConstraint(
                name="providerkey_default_price_both_or_neither",
                condition=models.Q(default_input_price_micros_per_mtok__isnull=True,
                                   default_output_price_micros_per_mtok__isnull=True)
                # Explicitly not null: a CHECK whose condition is NULL passes.
                | models.Q(default_input_price_micros_per_mtok__isnull=False,
                           default_output_price_micros_per_mtok__isnull=False,
                           default_input_price_micros_per_mtok__gte=0,
                           default_output_price_micros_per_mtok__gte=0)),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"

    def clean(self) -> None:
        prices = (self.default_input_price_micros_per_mtok,
                  self.default_output_price_micros_per_mtok)
        if (prices[0] is None) != (prices[1] is None):
            raise ValidationError("Set both default prices (input and output) or neither.")
