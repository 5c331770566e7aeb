"""What a model costs at a moment, and which catalog model a name stands for: the one price
resolution that both the hot path (money holds and settles, through the runtime catalog) and the
ledger (billing.ledger, through billing.prices) use. Money is integer micro-dollars, never floats.

A name resolves to its canonical model first (ModelAlias: "gpt-4o-2024-08-06" -> "gpt-4o"), then:

1. a ModelPrice period of the canonical model covering the moment;
2. else the catalog's list price (ModelSpec, enabled or not);
3. else the highest default price named by an enabled provider key OF THE CALL'S KIND (the API
   its endpoint speaks: "anthropic" for /v1/messages, "openai" for every other endpoint) that
   serves the name (input and output each at their highest, so the hold stays an upper bound
   whichever key serves it). Only keys that could serve the call count: an Anthropic key's
   default price never prices a model called through the OpenAI-compatible endpoints, nor the
   other way round;
4. else no price: the gateway refuses the call (model_not_priced). Never $0 by accident; a model
   is free only when an operator priced it at 0.

A price has a figure per token class (Price.class_prices): plain input, cached input (prompt-cache
reads), cache writes, plain output, reasoning. A period or catalog entry without a class price
(null) prices that class at its total's price; a call's cost is Price.cost_of(usage), each class
at its price, rounded half up once. Provider keys' default prices name input and output only.

Every write to the catalog (models, price periods, aliases) goes through the functions at the end
(save_model_spec, save_price, save_alias and the deletes): they validate, record an audit event and
tell every gateway process to reload its catalog (pub/sub). Django admin calls them too.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from gateway.models import ModelAlias, ModelPrice, ModelSpec, ProviderKey, ProviderKind
from gateway.usage import Usage
from tenants.invalidation import publish
from tenants.services.audit import record_audit_event

MICROS_PER_MTOK_DIVISOR = 1_000_000  # prices are per million tokens

# The one rule for a model name, in the catalog (models, aliases, price periods) and in every
# /v1 request: it becomes a quota key, a ledger row and a cell of finance's CSV and XLSX. An
# ASCII letter or digit first (never a spreadsheet formula's `=`, `+`, `-`, `@`, tab or CR),
# then letters, digits and `. _ - : / @ =` ("gpt-4o", "ft:gpt-4o-mini:acme::id",
# "meta-llama/Llama-3.1-8B", "claude@20240620", the mock's "gpt-4o@status=500"): no spaces,
# quotes, parentheses, commas or `&`, so a name cannot be a formula or break out of a cell.
MODEL_NAME_MAX_LENGTH = 128
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@=-]{0,%d}" % (MODEL_NAME_MAX_LENGTH - 1))
MODEL_NAME_RULE = (f"A model name is 1 to {MODEL_NAME_MAX_LENGTH} characters: an ASCII letter or "
                   "digit, then letters, digits and . _ - : / @ =")


def is_model_name(name: object) -> bool:
    return isinstance(name, str) and MODEL_NAME.fullmatch(name) is not None


def price_micros(input_micros_per_mtok: int, output_micros_per_mtok: int, input_tokens: int,
                 output_tokens: int) -> int:
    """Tokens at per-million prices, in micro-dollars, rounded half up once per call.

    Rounding the exact total (not each component) keeps every call within half a micro-dollar
    of the exact figure. Ceil would add half a micro-dollar per call on average: a steady drift
    from the upstream bill that reconciliation would keep reporting.
    """
    if input_tokens < 0 or output_tokens < 0:
        raise ValueError("token counts must be >= 0")
    exact_times_million = (input_tokens * input_micros_per_mtok
                           + output_tokens * output_micros_per_mtok)
    return (exact_times_million + MICROS_PER_MTOK_DIVISOR // 2) // MICROS_PER_MTOK_DIVISOR


@dataclass(frozen=True)
class Price:
    input_micros_per_mtok: int
    output_micros_per_mtok: int
    # Token classes an upstream bills differently (per million tokens); None: the class costs
    # what its total costs (cached and cache-write input the input price, reasoning the output
    # price).
    cached_input_micros_per_mtok: int | None = None
    cache_write_micros_per_mtok: int | None = None
    reasoning_micros_per_mtok: int | None = None

    def cost(self, input_tokens: int, output_tokens: int) -> int:
        """Micro-dollars of plain input and output tokens, rounded half up once per call."""
        return price_micros(self.input_micros_per_mtok, self.output_micros_per_mtok,
                            input_tokens, output_tokens)

    def class_prices(self) -> tuple[int, int, int, int, int]:
        """Per million tokens: plain input, cached input, cache write, plain output, reasoning."""
        pin, pout = self.input_micros_per_mtok, self.output_micros_per_mtok
        return (pin, _or(self.cached_input_micros_per_mtok, pin),
                _or(self.cache_write_micros_per_mtok, pin), pout,
                _or(self.reasoning_micros_per_mtok, pout))

    def cost_of(self, usage: Usage) -> int:
        """Micro-dollars of a call's usage, each class at its price, rounded half up once."""
        pin, pcached, pwrite, pout, preason = self.class_prices()
        exact_times_million = (usage.plain_input_tokens * pin + usage.cached_input_tokens * pcached
                               + usage.cache_write_tokens * pwrite
                               + usage.plain_output_tokens * pout
                               + usage.reasoning_tokens * preason)
        return (exact_times_million + MICROS_PER_MTOK_DIVISOR // 2) // MICROS_PER_MTOK_DIVISOR

    def bound(self, tokens: int) -> int:
        """An upper bound of what `tokens` cost however they split into input and output and
        their classes: all of them at the dearest price, rounded up."""
        dearest = max(self.class_prices())
        return -(-tokens * dearest // MICROS_PER_MTOK_DIVISOR)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclass(frozen=True)
class Period:
    price: Price
    valid_from: datetime
    valid_to: datetime | None  # exclusive; None: open

    def covers(self, at: datetime) -> bool:
        return self.valid_from <= at and (self.valid_to is None or at < self.valid_to)


@dataclass(frozen=True)
class DefaultPrice:
    """A provider key's price for models with none of their own."""

    price: Price
    models: frozenset[str]  # the key's models; empty: every model
    kind: str = ProviderKind.OPENAI.value  # the key's kind (ProviderKind): the calls it serves

    def serves(self, model: str, kind: str) -> bool:
        return self.kind == kind and (not self.models or model in self.models)


def _highest(prices: Iterable[Price]) -> Price | None:
    """Each total and each class at its highest price among `prices`: an upper bound of what any
    of them charges, whatever the split of a call. A class whose highest is its total's highest
    stays None (the same figure, and Price's usual shape)."""
    prices = list(prices)
    if not prices:
        return None
    pin, pcached, pwrite, pout, preason = (max(column) for column in
                                           zip(*(p.class_prices() for p in prices)))
    return Price(pin, pout, None if pcached == pin else pcached,
                 None if pwrite == pin else pwrite, None if preason == pout else preason)


# The class price columns of ModelPrice and ModelSpec (gateway/models.py), in Price's order.
_CLASS_COLUMNS = ("cached_input_micros_per_mtok", "cache_write_micros_per_mtok",
                  "reasoning_micros_per_mtok")


def _class_prices(row: Any) -> dict[str, int | None]:
    return {name: getattr(row, name) for name in _CLASS_COLUMNS}


def _frozen(mapping: Mapping) -> Mapping:  # type: ignore[type-arg]
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class PriceBook:
    """Every price and alias, as an immutable snapshot (PriceBook.load: four queries)."""

    periods: Mapping[str, tuple[Period, ...]] = field(default_factory=lambda: _frozen({}))
    list_prices: Mapping[str, Price] = field(default_factory=lambda: _frozen({}))
    aliases: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    defaults: tuple[DefaultPrice, ...] = ()

    @classmethod
    def of(cls, *, periods: Iterable[tuple[str, Period]] = (),
           list_prices: Mapping[str, Price] | None = None,
           aliases: Mapping[str, str] | None = None,
           defaults: Iterable[DefaultPrice] = ()) -> PriceBook:
        by_model: dict[str, list[Period]] = {}
        for model, period in periods:
            by_model.setdefault(model, []).append(period)
        return cls(
            # Newest first: with overlapping periods (the admin does not forbid them), the one
            # that started last is the one an operator most recently meant.
            _frozen({m: tuple(sorted(ps, key=lambda p: p.valid_from, reverse=True))
                     for m, ps in by_model.items()}),
            _frozen(list_prices or {}), _frozen(aliases or {}), tuple(defaults))

    @classmethod
    def load(cls) -> PriceBook:
        return cls.of(
            periods=((row.model, Period(Price(row.input_micros_per_mtok,
                                              row.output_micros_per_mtok, **_class_prices(row)),
                                        row.valid_from, row.valid_to))
                     for row in ModelPrice.objects.all()),
            list_prices={name: Price(pin, pout, *classes)
                         for name, pin, pout, *classes in ModelSpec.objects.values_list(
                             "name", "input_price_micros_per_mtok",
                             "output_price_micros_per_mtok", *_CLASS_COLUMNS)},
            aliases=dict(ModelAlias.objects.values_list("alias", "model__name")),
            defaults=(DefaultPrice(Price(pin, pout), frozenset(models or ()), kind)
                      for pin, pout, models, kind in ProviderKey.objects.filter(
                          enabled=True, default_input_price_micros_per_mtok__isnull=False,
                          default_output_price_micros_per_mtok__isnull=False,
                      ).values_list("default_input_price_micros_per_mtok",
                                    "default_output_price_micros_per_mtok", "models", "kind")),
        )

    def canonical(self, model: str) -> str:
        """The catalog model `model` stands for (itself unless it is an alias)."""
        return self.aliases.get(model, model)

    def own_price(self, model: str, at: datetime) -> Price | None:
        """The model's own price at `at` (a period, else the list price); None if it has none."""
        name = self.canonical(model)
        for period in self.periods.get(name, ()):
            if period.covers(at):
                return period.price
        return self.list_prices.get(name)

    def price(self, model: str, at: datetime,
              kind: str = ProviderKind.OPENAI.value) -> Price | None:
        """What a call of `model` ending at `at` costs per million tokens; None: unpriced.
        `kind`: the provider key kind that serves the call (ProviderKind; "openai" like the
        pool's default): only default prices of keys of that kind count."""
        own = self.own_price(model, at)
        if own is not None:
            return own
        return _highest(d.price for d in self.defaults if d.serves(model, kind))


def load_aliases() -> dict[str, str]:
    """alias -> catalog model name, for readers that need only names (reconciliation)."""
    return dict(ModelAlias.objects.values_list("alias", "model__name"))


def _when(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


# The model name of each kind of catalog row, checked against MODEL_NAME before it is saved.
_NAME_FIELDS: dict[type, str] = {ModelSpec: "name", ModelAlias: "alias", ModelPrice: "model"}


def _save_catalog_row(row: Any, *, actor: str, action: str, target: str,
                      data: Callable[[bool], dict[str, Any]]) -> None:
    """Validate and save one catalog row (a model, a price period, an alias), tell every gateway
    process to reload its catalog, and audit `<action>.create` or `<action>.update` with
    `data(created)`; one transaction."""
    created = row.pk is None
    name_field = _NAME_FIELDS[type(row)]
    if not is_model_name(getattr(row, name_field)):
        raise ValidationError({name_field: MODEL_NAME_RULE})
    row.full_clean()
    with transaction.atomic():
        row.save()
        publish("catalog")
        record_audit_event(actor=actor, action=f"{action}.{'create' if created else 'update'}",
                           target=target, data=data(created))


def save_model_spec(spec: ModelSpec, *, actor: str = "system",
                    changed: Iterable[str] = ()) -> ModelSpec:
    """Validate and save a catalog model (`changed`: the fields an edit changed, for the audit
    trail); every gateway process reloads its catalog."""
    _save_catalog_row(spec, actor=actor, action="model", target=spec.name, data=lambda created: (
        {"kind": spec.kind, "input_price_micros_per_mtok": spec.input_price_micros_per_mtok,
         "output_price_micros_per_mtok": spec.output_price_micros_per_mtok,
         **_class_prices(spec)} if created
        else {"fields": sorted(changed)}))
    return spec


def delete_model_spec(spec: ModelSpec, *, actor: str = "system") -> None:
    """Delete a catalog model and its aliases; every gateway process reloads its catalog."""
    with transaction.atomic():
        aliases = sorted(spec.aliases.values_list("alias", flat=True))
        spec.delete()
        publish("catalog")
        record_audit_event(actor=actor, action="model.delete", target=spec.name,
                           data={"aliases": aliases})


def save_price(price: ModelPrice, *, actor: str = "system") -> ModelPrice:
    """Validate and save a price period; every gateway process reloads its catalog."""
    _save_catalog_row(price, actor=actor, action="model_price", target=price.model,
                      data=lambda _created: {
                          "input_micros_per_mtok": price.input_micros_per_mtok,
                          "output_micros_per_mtok": price.output_micros_per_mtok,
                          **_class_prices(price),
                          "valid_from": _when(price.valid_from),
                          "valid_to": _when(price.valid_to)})
    return price


def save_alias(alias: ModelAlias, *, actor: str = "system") -> ModelAlias:
    """Validate and save a model alias; every gateway process reloads its catalog."""
    _save_catalog_row(alias, actor=actor, action="model_alias", target=alias.alias,
                      data=lambda _created: {"model": alias.model.name})
    return alias


def delete_alias(alias: ModelAlias, *, actor: str = "system") -> None:
    """Delete a model alias: it stops applying on every gateway at once."""
    with transaction.atomic():
        model = alias.model.name
        alias.delete()
        publish("catalog")
        record_audit_event(actor=actor, action="model_alias.delete", target=alias.alias,
                           data={"model": model})
