"""The seeded catalog, its in-process snapshot, the reservation arithmetic and cost."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from hypothesis import given
from hypothesis import strategies as st

from gateway.catalog import (
    Catalog,
    ModelInfo,
    cost_micros,
    fallback_model_info,
    hold_for,
    load_catalog,
    output_cap_for_hold,
    reservation_tokens,
)
from gateway.models import ModelSpec
from gateway.prices import Price

SEEDED = {
    # name: (tokenizer, kind, input micros/1M, output micros/1M)
    "gpt-4o": ("o200k_base", "chat", 2_500_000, 10_000_000),
    "gpt-4o-mini": ("o200k_base", "chat", 150_000, 600_000),
    "gpt-4.1": ("o200k_base", "chat", 2_000_000, 8_000_000),
    "gpt-4.1-mini": ("o200k_base", "chat", 400_000, 1_600_000),
    "o3-mini": ("o200k_base", "chat", 1_100_000, 4_400_000),
    "gpt-3.5-turbo": ("cl100k_base", "chat", 500_000, 1_500_000),
    "gpt-4": ("cl100k_base", "chat", 30_000_000, 60_000_000),
    "text-embedding-3-small": ("cl100k_base", "embedding", 20_000, 0),
    "text-embedding-3-large": ("cl100k_base", "embedding", 130_000, 0),
    # Not tiktoken models: the catalog's rule for an unknown tokenizer, the heuristic.
    "claude-sonnet-4-5": ("heuristic", "chat", 3_000_000, 15_000_000),
    "claude-haiku-4-5": ("heuristic", "chat", 1_000_000, 5_000_000),
    "claude-opus-4-1": ("heuristic", "chat", 15_000_000, 75_000_000),
    "claude-opus-4-5": ("heuristic", "chat", 5_000_000, 25_000_000),
}
# name: (cached input, cache write, reasoning) micros/1M; absent: all null (the totals' prices).
SEEDED_CLASS_PRICES = {
    "gpt-4o": (1_250_000, None, None),
    "gpt-4o-mini": (75_000, None, None),
    "gpt-4.1": (500_000, None, None),
    "gpt-4.1-mini": (100_000, None, None),
    "o3-mini": (550_000, None, 4_400_000),  # reasoning at the output price, said explicitly
    # Anthropic: cache reads 0.1x input, cache writes (5-minute cache) 1.25x input.
    "claude-sonnet-4-5": (300_000, 3_750_000, None),
    "claude-haiku-4-5": (100_000, 1_250_000, None),
    "claude-opus-4-1": (1_500_000, 18_750_000, None),
    "claude-opus-4-5": (500_000, 6_250_000, None),
}

SF = Decimal("1.25")


def info(**overrides: Any) -> ModelInfo:
    base = ModelInfo(
        name="m",
        tokenizer="o200k_base",
        kind="chat",
        context_window=128_000,
        default_output_tokens=4_096,
        max_output_tokens=16_384,
    )
    return dataclasses.replace(base, **overrides)


# --- the seeded catalog ------------------------------------------------------------------------


@pytest.mark.django_db
def test_seeded_models_and_exact_prices():
    rows = {
        spec.name: (
            spec.tokenizer,
            spec.kind,
            spec.input_price_micros_per_mtok,
            spec.output_price_micros_per_mtok,
        )
        for spec in ModelSpec.objects.all()
    }
    assert rows == SEEDED
    classes = {spec.name: (spec.cached_input_micros_per_mtok, spec.cache_write_micros_per_mtok,
                           spec.reasoning_micros_per_mtok) for spec in ModelSpec.objects.all()}
    assert classes == {name: SEEDED_CLASS_PRICES.get(name, (None, None, None))
                       for name in SEEDED}


@pytest.mark.django_db
def test_seeded_windows_are_consistent():
    for spec in ModelSpec.objects.all():
        spec.full_clean()
        assert spec.enabled
        if spec.kind == "embedding":
            assert spec.default_output_tokens == spec.max_output_tokens == 0
        else:
            # gpt-4 may spend its whole 8k window on output.
            assert 0 < spec.default_output_tokens <= spec.max_output_tokens <= spec.context_window
    gpt4o = ModelSpec.objects.get(name="gpt-4o")
    assert (gpt4o.context_window, gpt4o.max_output_tokens) == (128_000, 16_384)


@pytest.mark.django_db
def test_load_catalog_is_one_query_per_table(django_assert_num_queries: Any):
    # Models, then the price book: list prices, price periods, aliases, provider default prices.
    ModelSpec.objects.filter(name="gpt-4").update(enabled=False)
    with django_assert_num_queries(5):
        catalog = load_catalog()

    assert "gpt-4" not in catalog
    assert catalog.spec("gpt-4") is None
    assert len(catalog) == len(SEEDED) - 1
    gpt4o = catalog.spec("gpt-4o")
    assert gpt4o == ModelInfo(
        name="gpt-4o",
        tokenizer="o200k_base",
        kind="chat",
        context_window=128_000,
        default_output_tokens=4_096,
        max_output_tokens=16_384,
    )
    # A disabled model keeps its list price: the ledger prices its past calls.
    assert catalog.price("gpt-4") == Price(30_000_000, 60_000_000)
    assert catalog.price("gpt-4o") == Price(2_500_000, 10_000_000, 1_250_000)
    assert catalog.price("claude-sonnet-4-5") == Price(3_000_000, 15_000_000, 300_000, 3_750_000)
    assert catalog.price("claude-sonnet-4-5-20250929") == catalog.price("claude-sonnet-4-5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpt4o.context_window = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        catalog.models["x"] = gpt4o  # type: ignore[index]
    assert catalog.names(kind="embedding") == ["text-embedding-3-large", "text-embedding-3-small"]


@pytest.mark.django_db
def test_operators_can_add_models_and_the_next_snapshot_sees_them():
    ModelSpec.objects.create(
        name="llama-3.1-70b",
        tokenizer="heuristic",
        kind="chat",
        context_window=131_072,
        default_output_tokens=2_048,
        max_output_tokens=8_192,
        input_price_micros_per_mtok=600_000,
        output_price_micros_per_mtok=600_000,
    )
    assert load_catalog().spec("llama-3.1-70b").tokenizer == "heuristic"


@pytest.mark.django_db
def test_inconsistent_specs_are_refused_by_the_form_and_the_database():
    spec = ModelSpec(
        name="broken",
        tokenizer="o200k_base",
        context_window=1_000,
        default_output_tokens=2_000,
        max_output_tokens=1_500,
        input_price_micros_per_mtok=1,
        output_price_micros_per_mtok=1,
    )
    with pytest.raises(ValidationError) as excinfo:
        spec.full_clean()
    assert set(excinfo.value.message_dict) >= {"default_output_tokens", "max_output_tokens"}
    with pytest.raises(IntegrityError), transaction.atomic():
        spec.save()
    spec.default_output_tokens, spec.max_output_tokens = 100, 500
    spec.input_price_micros_per_mtok = -1
    with pytest.raises(IntegrityError), transaction.atomic():
        spec.save()


def test_unknown_models_fall_back_to_documented_defaults():
    fallback = fallback_model_info("mystery-model")
    assert (fallback.name, fallback.tokenizer, fallback.kind) == (
        "mystery-model",
        "heuristic",
        "chat",
    )
    assert (fallback.context_window, fallback.default_output_tokens) == (128_000, 4_096)
    assert not fallback.known
    catalog = Catalog.of([info(name="gpt-4o")])
    assert catalog.resolve("gpt-4o").known
    assert catalog.resolve("mystery-model") == fallback


# --- reservation arithmetic --------------------------------------------------------------------


def test_default_output_when_the_client_gives_no_max_tokens():
    assert reservation_tokens(1_000, None, info(), SF) == (
        (1_000 + 4_096) * 5 // 4,
        4_096,
    )


def test_requested_output_is_used_and_capped_at_the_model_maximum():
    assert reservation_tokens(1_000, 500, info(), SF) == (1_875, 500)
    assert reservation_tokens(1_000, 100_000, info(), SF) == (
        (1_000 + 16_384) * 5 // 4,
        16_384,
    )


def test_requested_zero_is_not_replaced_by_the_default():
    assert reservation_tokens(100, 0, info(), SF) == (125, 0)


def test_output_is_capped_at_what_the_context_window_leaves():
    model = info(context_window=8_192, max_output_tokens=8_192)
    hold, cap = reservation_tokens(8_000, 4_096, model, SF)
    assert cap == 192
    assert hold == 10_240  # the whole window times the safety factor
    assert reservation_tokens(8_192, None, model, SF) == (10_240, 0)
    # A prompt estimated beyond the window holds the estimate, with no room for output.
    assert reservation_tokens(9_000, None, model, SF) == (11_250, 0)


@pytest.mark.parametrize(
    ("prompt", "output", "factor", "expected"),
    [
        (100, 0, "1.25", 125),  # exact
        (101, 0, "1.25", 127),  # 126.25 rounds up
        (1, 0, "1.25", 2),
        (0, 0, "1.25", 0),
        (999, 1, "1", 1_000),
        (10, 0, "1.1", 11),
        (11, 0, "1.10", 13),  # 12.1 rounds up
        (3, 0, "1.33", 4),  # 3.99 rounds up
        (1_000_000_007, 0, "1.25", 1_250_000_009),  # 1_250_000_008.75: no float drift
    ],
)
def test_safety_factor_rounds_the_hold_up(prompt: int, output: int, factor: str, expected: int):
    model = info(context_window=2_000_000_000, max_output_tokens=1_000)
    assert reservation_tokens(prompt, output, model, Decimal(factor))[0] == expected
    assert hold_for(prompt, output, Decimal(factor)) == expected


def test_several_choices_multiply_the_output_hold():
    hold, cap = reservation_tokens(1_000, 500, info(), SF, choices=3)
    assert (hold, cap) == ((1_000 + 3 * 500) * 5 // 4, 500)


@pytest.mark.parametrize(
    "call",
    [
        lambda: reservation_tokens(-1, None, info(), SF),
        lambda: reservation_tokens(1, -5, info(), SF),
        lambda: reservation_tokens(1, None, info(), Decimal("0.99")),
        lambda: reservation_tokens(1, None, info(), SF, choices=0),
        lambda: output_cap_for_hold(100, -1, SF),
    ],
)
def test_invalid_arguments_are_refused(call: Any):
    with pytest.raises(ValueError):
        call()


def test_a_float_safety_factor_is_refused():
    with pytest.raises(TypeError):
        reservation_tokens(1, None, info(), 1.25)  # type: ignore[arg-type]


def test_output_cap_for_a_shrunk_hold():
    # Headroom 1_000 at 1.25: at most 800 billable tokens, 300 after a 500-token prompt.
    assert output_cap_for_hold(1_000, 500, SF) == 300
    assert reservation_tokens(500, 300, info(), SF)[0] == 1_000
    assert reservation_tokens(500, 301, info(), SF)[0] == 1_002
    assert output_cap_for_hold(1_000, 500, SF, choices=2) == 150
    assert output_cap_for_hold(624, 500, SF) == 0  # not even the prompt fits
    assert output_cap_for_hold(0, 0, SF) == 0


@given(
    hold=st.integers(min_value=0, max_value=10**12),
    prompt=st.integers(min_value=0, max_value=10**9),
    factor=st.decimals(min_value=1, max_value=5, places=2),
    choices=st.integers(min_value=1, max_value=8),
)
def test_output_cap_for_hold_is_the_largest_cap_that_fits(
    hold: int, prompt: int, factor: Decimal, choices: int
):
    cap = output_cap_for_hold(hold, prompt, factor, choices=choices)
    assert cap >= 0
    if hold_for(prompt, 0, factor) <= hold:
        assert hold_for(prompt, cap * choices, factor) <= hold
        assert hold_for(prompt, (cap + 1) * choices, factor) > hold
    else:
        assert cap == 0


@given(
    prompt=st.integers(min_value=0, max_value=200_000),
    requested=st.one_of(st.none(), st.integers(min_value=0, max_value=200_000)),
    factor=st.decimals(min_value=1, max_value=3, places=2),
)
def test_the_hold_bounds_every_bill_the_upstream_can_produce(
    prompt: int, requested: int | None, factor: Decimal
):
    # Sent upstream as max_tokens, the cap bounds the output, and the window bounds the total.
    model = info(context_window=128_000, max_output_tokens=16_384)
    hold, cap = reservation_tokens(prompt, requested, model, factor)
    assert hold >= prompt + cap
    assert cap <= model.max_output_tokens
    if requested is not None and prompt + requested <= model.context_window:
        assert cap == min(requested, model.max_output_tokens)
    if cap == model.context_window - prompt:
        assert hold >= model.context_window


# --- cost --------------------------------------------------------------------------------------


def test_cost_of_a_million_tokens_is_the_price():
    gpt4o = Price(2_500_000, 10_000_000)
    assert cost_micros(gpt4o, 1_000_000, 0) == 2_500_000
    assert cost_micros(gpt4o, 0, 1_000_000) == 10_000_000
    assert cost_micros(gpt4o, 1_000, 500) == 2_500 + 5_000


def test_cost_rounds_half_up_once_per_call():
    embedding = Price(20_000, 0)
    assert cost_micros(embedding, 24, 0) == 0  # 0.48 micro-dollars
    assert cost_micros(embedding, 25, 0) == 1  # 0.5
    assert cost_micros(embedding, 74, 0) == 1  # 1.48
    assert cost_micros(embedding, 75, 0) == 2  # 1.5
    mini = Price(150_000, 600_000)
    # 3 * 0.15 + 1 * 0.6 = 1.05 -> 1: the components are summed before rounding.
    assert cost_micros(mini, 3, 1) == 1
    assert isinstance(cost_micros(mini, 10**12, 10**12), int)
    with pytest.raises(ValueError):
        cost_micros(mini, -1, 0)
