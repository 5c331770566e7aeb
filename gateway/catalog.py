"""The model catalog as the hot path sees it: an immutable in-process snapshot of the enabled
ModelSpec rows with the price book (prices and model aliases, gateway/prices.py), the reservation
arithmetic (DESIGN.md invariant 2), and cost in micro-dollars.

Rebuild the snapshot with load_catalog() when models, prices, aliases or provider keys change
(gateway/listener.py does on pub/sub); reads never query.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from types import MappingProxyType

from gateway.models import ModelKind, ModelSpec, ProviderKind, Tokenizer
from gateway.prices import Price, PriceBook

# Unknown models (not in the catalog, or disabled there but allowed by a plan) get these
# defaults. 128k is the context of most current OpenAI-compatible chat models; a larger real
# window only means a hold capped a little early. The 4096-token default output matches the
# catalog's chat defaults. What such a model costs comes from the price book, which refuses it
# unless a price period or a provider key's default price names one (never $0 by accident).
FALLBACK_CONTEXT_WINDOW = 128_000
FALLBACK_DEFAULT_OUTPUT_TOKENS = 4_096
FALLBACK_MAX_OUTPUT_TOKENS = 16_384


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: str
    kind: str
    context_window: int
    default_output_tokens: int
    max_output_tokens: int
    known: bool = True  # False for fallback_model_info()

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelInfo:
        return cls(
            name=spec.name,
            tokenizer=spec.tokenizer,
            kind=spec.kind,
            context_window=spec.context_window,
            default_output_tokens=spec.default_output_tokens,
            max_output_tokens=spec.max_output_tokens,
        )


def fallback_model_info(name: str) -> ModelInfo:
    """What the gateway assumes about a chat model it has no catalog entry for."""
    return ModelInfo(
        name=name,
        tokenizer=Tokenizer.HEURISTIC.value,
        kind=ModelKind.CHAT.value,
        context_window=FALLBACK_CONTEXT_WINDOW,
        default_output_tokens=FALLBACK_DEFAULT_OUTPUT_TOKENS,
        max_output_tokens=FALLBACK_MAX_OUTPUT_TOKENS,
        known=False,
    )


@dataclass(frozen=True)
class Catalog:
    models: Mapping[str, ModelInfo] = field(default_factory=lambda: MappingProxyType({}))
    prices: PriceBook = field(default_factory=PriceBook)

    @classmethod
    def of(cls, infos: Iterable[ModelInfo], prices: PriceBook | None = None) -> Catalog:
        return cls(MappingProxyType({info.name: info for info in infos}), prices or PriceBook())

    def canonical(self, model_name: str) -> str:
        """The catalog model a name stands for: itself, or the model an alias names. Per-model
        limits, allowed-model lists, caps and prices all use this name."""
        return self.prices.canonical(model_name)

    def spec(self, model_name: str) -> ModelInfo | None:
        return self.models.get(self.canonical(model_name))

    def resolve(self, model_name: str) -> ModelInfo:
        """The catalog entry (of the alias's model for an alias), or the fallback for an unknown
        model."""
        return self.spec(model_name) or fallback_model_info(model_name)

    def price(self, model_name: str, at: datetime | None = None,
              kind: str = ProviderKind.OPENAI.value) -> Price | None:
        """What a call of this model served by a provider key of `kind` (the endpoint's,
        gateway.dialects.provider_kind) costs now (or at `at`); None when it has no price."""
        return self.prices.price(model_name, at or datetime.now(UTC), kind)

    def names(self, kind: str | None = None) -> list[str]:
        return sorted(n for n, info in self.models.items() if kind is None or info.kind == kind)

    def __contains__(self, model_name: object) -> bool:
        return model_name in self.models

    def __len__(self) -> int:
        return len(self.models)


def load_catalog() -> Catalog:
    """A snapshot of every enabled ModelSpec and of the price book (five queries)."""
    return Catalog.of((ModelInfo.from_spec(spec) for spec in ModelSpec.objects.filter(enabled=True)),
                      PriceBook.load())


@functools.lru_cache(maxsize=64, typed=True)  # a handful of factors, each checked once
def _ratio(safety_factor: Decimal) -> tuple[int, int]:
    # Exact integer arithmetic: a float or a rounded Decimal division could put the hold one
    # token below the bound it must be.
    if not isinstance(safety_factor, Decimal) or not safety_factor.is_finite():
        raise TypeError("the safety factor must be a finite Decimal")
    if safety_factor < 1:
        raise ValueError(f"the safety factor must be >= 1, got {safety_factor}")
    return safety_factor.as_integer_ratio()


def _check_counts(prompt_tokens: int, choices: int) -> None:
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if choices < 1:
        raise ValueError(f"choices must be >= 1, got {choices}")


def hold_for(prompt_tokens: int, output_tokens: int, safety_factor: Decimal) -> int:
    """ceil((prompt + output) * safety_factor), exactly."""
    numerator, denominator = _ratio(safety_factor)
    return -(-(prompt_tokens + output_tokens) * numerator // denominator)


def reservation_tokens(
    prompt_tokens: int,
    requested_output: int | None,
    info: ModelInfo,
    safety_factor: Decimal,
    *,
    choices: int = 1,
) -> tuple[int, int]:
    """(tokens to hold, output cap per choice to send upstream as max_tokens).

    The cap is the client's max_tokens, else the model's default output reservation, limited by
    the model's maximum output and by what the context window leaves after the prompt. With
    `choices` (n) above 1 the upstream may produce the cap once per choice. When the context
    window is what limits the cap, the hold covers the whole window, which bounds the bill
    even if the prompt estimate was low; a cap of 0 then means the estimated prompt fills the
    window (reject the request, or forward it without max_tokens).
    """
    _check_counts(prompt_tokens, choices)
    if requested_output is not None and requested_output < 0:
        raise ValueError(f"requested_output must be >= 0, got {requested_output}")
    wanted = info.default_output_tokens if requested_output is None else requested_output
    output_cap = max(0, min(wanted, info.max_output_tokens, info.context_window - prompt_tokens))
    return hold_for(prompt_tokens, output_cap * choices, safety_factor), output_cap


def output_cap_for_hold(
    hold: int, prompt_tokens: int, safety_factor: Decimal, *, choices: int = 1
) -> int:
    """The largest per-choice max_tokens whose reservation fits in `hold` (0 if none does).

    For shrinking a hold to the remaining headroom: reservation_tokens() with this cap as the
    requested output holds at most `hold` (when the model's own caps do not lower it further).
    """
    _check_counts(prompt_tokens, choices)
    numerator, denominator = _ratio(safety_factor)
    # ceil(x * n / d) <= hold  <=>  x * n / d <= hold  <=>  x <= floor(hold * d / n), x integer.
    max_billable = hold * denominator // numerator
    return max(0, (max_billable - prompt_tokens) // choices)


def cost_micros(price: Price, input_tokens: int, output_tokens: int) -> int:
    """What a call costs in micro-dollars at `price` (see gateway.prices.price_micros)."""
    return price.cost(input_tokens, output_tokens)

