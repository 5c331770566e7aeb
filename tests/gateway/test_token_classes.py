"""Prices per token class: Price.cost_of (each class at its price, rounded half up once per
call), price rows with and without class prices, the price book's upper bound per class, the
catalog's seeded class prices and Anthropic models, their audit and admin, and the migrations
that add them, applied and reversed."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.urls import reverse
from hypothesis import given
from hypothesis import strategies as st

from gateway.models import ModelAlias, ModelPrice, ModelSpec
from gateway.prices import DefaultPrice, Period, Price, PriceBook, save_model_spec, save_price
from gateway.usage import Usage
from tenants.models import AuditEvent

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
GPT_4O = Price(2_500_000, 10_000_000, cached_input_micros_per_mtok=1_250_000)
SONNET = Price(3_000_000, 15_000_000, cached_input_micros_per_mtok=300_000,
               cache_write_micros_per_mtok=3_750_000)
O3_MINI = Price(1_100_000, 4_400_000, cached_input_micros_per_mtok=550_000,
                reasoning_micros_per_mtok=4_400_000)


# --- cost per class ----------------------------------------------------------------------------


def test_each_class_costs_its_own_price() -> None:
    # 600 plain input at 2.5, 400 cached at 1.25, 500 output at 10 (micro-dollars per token).
    assert GPT_4O.cost_of(Usage(1_000, 500, cached_input_tokens=400)) == 1_500 + 500 + 5_000
    # The same totals without a cache read cost the plain price throughout.
    assert GPT_4O.cost_of(Usage(1_000, 500)) == 2_500 + 5_000 == GPT_4O.cost(1_000, 500)
    # Anthropic: 2,000 plain input at 3, 6,000 cache reads at 0.3, 2,000 cache writes at 3.75,
    # 1,000 output at 15 of which 400 thinking (at the output price: no reasoning price).
    usage = Usage(10_000, 1_000, cached_input_tokens=6_000, cache_write_tokens=2_000,
                  reasoning_tokens=400)
    assert SONNET.cost_of(usage) == 6_000 + 1_800 + 7_500 + 15_000 == 30_300
    # o3-mini: reasoning priced explicitly at the output price.
    assert O3_MINI.cost_of(Usage(2_000, 3_000, cached_input_tokens=1_000,
                                 reasoning_tokens=2_500)) == 1_100 + 550 + 13_200


def test_a_call_is_rounded_half_up_once_not_per_class() -> None:
    price = Price(1_000_000, 1_000_000, cached_input_micros_per_mtok=250_000,
                  reasoning_micros_per_mtok=250_000)
    # Two cached tokens (0.5) and two reasoning tokens (0.5): exactly 1 micro-dollar, where
    # rounding each class half up would charge 2.
    assert price.cost_of(Usage(2, 2, cached_input_tokens=2, reasoning_tokens=2)) == 1
    assert price.cost_of(Usage(2, 0, cached_input_tokens=2)) == 1  # 0.5 rounds up
    assert price.cost_of(Usage(1, 0, cached_input_tokens=1)) == 0  # 0.25 rounds down
    assert isinstance(SONNET.cost_of(Usage(10**12, 10**12, 10**11, 10**11, 10**11)), int)


@given(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**9),
       st.integers(0, 10**9), st.integers(0, 10**9))
def test_without_class_prices_the_split_changes_nothing(inp: int, out: int, cached: int,
                                                         write: int, reasoning: int) -> None:
    usage = Usage.of(inp, out, cached=cached, cache_write=write, reasoning=reasoning)
    plain = Price(2_500_000, 10_000_000)
    assert plain.cost_of(usage) == plain.cost(usage.input_tokens, usage.output_tokens)
    # With class prices no dearer than the totals', a split never costs more than none.
    assert GPT_4O.cost_of(usage) <= GPT_4O.cost(usage.input_tokens, usage.output_tokens)


def test_the_hold_bound_is_at_the_dearest_class() -> None:
    assert Price(1_000_000, 2_000_000).bound(1_000) == 2_000
    assert SONNET.bound(1_000) == 15_000  # output is Sonnet's dearest
    assert Price(1_000_000, 2_000_000, cache_write_micros_per_mtok=3_000_000).bound(1_000) == 3_000
    assert Price(1_000_000, 2_000_000, reasoning_micros_per_mtok=5_000_001).bound(1) == 6


@given(st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7),
       st.integers(0, 10**7), st.integers(0, 10**7))
def test_the_bound_covers_every_split(inp: int, out: int, cached: int, write: int,
                                      reasoning: int) -> None:
    usage = Usage.of(inp, out, cached=cached, cache_write=write, reasoning=reasoning)
    for price in (GPT_4O, SONNET, O3_MINI, Price(1, 2, 3, 4, 5)):
        assert price.cost_of(usage) <= price.bound(usage.total)


# --- the price book ----------------------------------------------------------------------------


def test_provider_default_prices_stay_an_upper_bound_per_class() -> None:
    defaults = [DefaultPrice(Price(5, 1, cached_input_micros_per_mtok=2), frozenset()),
                DefaultPrice(Price(3, 9, reasoning_micros_per_mtok=20), frozenset())]
    highest = PriceBook.of(defaults=defaults).price("mystery", NOW)
    # Cached: 2 on one key, 3 (its input price) on the other; cache writes cost the input price
    # on both (5 at most: null); reasoning 1 (the output price) or 20.
    assert highest == Price(5, 9, cached_input_micros_per_mtok=3, reasoning_micros_per_mtok=20)
    for default in defaults:
        for usage in (Usage(10, 10, 10, 0, 10), Usage(10, 10, 0, 10, 0), Usage(10, 10)):
            assert default.price.cost_of(usage) <= highest.cost_of(usage)
    # Without class prices the result keeps the plain shape.
    assert PriceBook.of(defaults=[DefaultPrice(Price(5, 1), frozenset()),
                                  DefaultPrice(Price(2, 9), frozenset())]).price(
        "mystery", NOW) == Price(5, 9)


@pytest.mark.django_db
def test_price_rows_with_and_without_class_prices_load_into_the_book() -> None:
    save_price(ModelPrice(model="plain", input_micros_per_mtok=7, output_micros_per_mtok=8,
                          valid_from=NOW))
    save_price(ModelPrice(model="classed", input_micros_per_mtok=7, output_micros_per_mtok=8,
                          cached_input_micros_per_mtok=1, cache_write_micros_per_mtok=9,
                          reasoning_micros_per_mtok=0, valid_from=NOW))
    spec = save_model_spec(ModelSpec(
        name="llama-classes", tokenizer="heuristic", context_window=1_000,
        default_output_tokens=10, max_output_tokens=100, input_price_micros_per_mtok=4,
        output_price_micros_per_mtok=6, cached_input_micros_per_mtok=2))
    prices = PriceBook.load()
    assert prices.price("plain", NOW) == Price(7, 8)
    assert prices.price("classed", NOW) == Price(7, 8, 1, 9, 0)
    assert prices.price("llama-classes", NOW) == Price(4, 6, 2)
    # Reasoning at 0 is a price (free thinking), not "the output price".
    assert prices.price("classed", NOW).cost_of(Usage(0, 1_000_000, reasoning_tokens=10**6)) == 0
    # Seeded: gpt-4o's cached input, Claude's cache reads and writes.
    assert prices.price("gpt-4o", NOW) == GPT_4O
    assert prices.price("claude-sonnet-4-5", NOW) == SONNET
    assert prices.price("o3-mini", NOW) == O3_MINI

    created = AuditEvent.objects.get(action="model_price.create", target="classed")
    assert (created.data["cached_input_micros_per_mtok"],
            created.data["cache_write_micros_per_mtok"],
            created.data["reasoning_micros_per_mtok"]) == (1, 9, 0)
    assert AuditEvent.objects.get(action="model_price.create",
                                  target="plain").data["cached_input_micros_per_mtok"] is None
    model = AuditEvent.objects.get(action="model.create", target="llama-classes")
    assert model.data["cached_input_micros_per_mtok"] == 2
    spec.reasoning_micros_per_mtok = 12
    save_model_spec(spec, changed=["reasoning_micros_per_mtok"])
    assert AuditEvent.objects.get(action="model.update", target="llama-classes").data == {
        "fields": ["reasoning_micros_per_mtok"]}


@pytest.mark.django_db
def test_a_negative_class_price_is_refused_by_the_service_and_the_database() -> None:
    with pytest.raises(ValidationError) as info:
        save_price(ModelPrice(model="m", input_micros_per_mtok=1, output_micros_per_mtok=1,
                              cache_write_micros_per_mtok=-1, valid_from=NOW))
    assert "cache_write_micros_per_mtok" in info.value.message_dict
    spec = ModelSpec.objects.get(name="gpt-4o")
    spec.reasoning_micros_per_mtok = -5
    with pytest.raises(ValidationError):
        save_model_spec(spec, changed=["reasoning_micros_per_mtok"])
    with pytest.raises(IntegrityError), transaction.atomic():
        ModelSpec.objects.filter(name="gpt-4o").update(cached_input_micros_per_mtok=-1)
    with pytest.raises(IntegrityError), transaction.atomic():
        ModelPrice.objects.create(model="m", input_micros_per_mtok=1, output_micros_per_mtok=1,
                                  reasoning_micros_per_mtok=-1, valid_from=NOW)
    assert not ModelPrice.objects.exists()


def test_a_period_applies_with_its_class_prices() -> None:
    book = PriceBook.of(list_prices={"m": Price(1, 2)},
                        periods=[("m", Period(Price(1, 2, 0), NOW, NOW + timedelta(days=1)))])
    assert book.price("m", NOW).cost_of(Usage(10**6, 0, cached_input_tokens=10**6)) == 0
    assert book.price("m", NOW - timedelta(seconds=1)).cost_of(
        Usage(10**6, 0, cached_input_tokens=10**6)) == 1


# --- the seeded catalog ------------------------------------------------------------------------


@pytest.mark.django_db
def test_claude_models_are_in_the_catalog_with_their_dated_aliases() -> None:
    aliases = dict(ModelAlias.objects.values_list("alias", "model__name"))
    assert aliases == {
        "claude-sonnet-4-5-20250929": "claude-sonnet-4-5",
        "claude-haiku-4-5-20251001": "claude-haiku-4-5",
        "claude-opus-4-1-20250805": "claude-opus-4-1",
        "claude-opus-4-5-20251101": "claude-opus-4-5",
    }
    for spec in ModelSpec.objects.filter(name__startswith="claude-"):
        spec.full_clean()
        assert (spec.tokenizer, spec.kind, spec.context_window) == ("heuristic", "chat", 200_000)
        # Cache writes 1.25x and cache reads 0.1x the input price, exactly.
        assert spec.cache_write_micros_per_mtok * 4 == spec.input_price_micros_per_mtok * 5
        assert spec.cached_input_micros_per_mtok * 10 == spec.input_price_micros_per_mtok
        assert spec.reasoning_micros_per_mtok is None  # thinking is billed as output


# --- admin -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin_shows_and_edits_class_prices(admin_client: Client) -> None:
    response = admin_client.post(reverse("admin:gateway_modelprice_add"), {
        "model": "gpt-4o", "input_micros_per_mtok": 2_000_000,
        "output_micros_per_mtok": 8_000_000, "cached_input_micros_per_mtok": 1_000_000,
        "cache_write_micros_per_mtok": "", "reasoning_micros_per_mtok": "",
        "valid_from_0": "2026-11-01", "valid_from_1": "00:00:00"})
    assert response.status_code == 302, response.content[:2000]
    row = ModelPrice.objects.get()
    assert (row.cached_input_micros_per_mtok, row.cache_write_micros_per_mtok) == (1_000_000, None)
    # A period's prices are what charged its calls: read-only once saved.
    page = admin_client.get(reverse("admin:gateway_modelprice_change", args=[row.pk]))
    assert b'name="cached_input_micros_per_mtok"' not in page.content
    assert b"1000000" in page.content
    listing = admin_client.get(reverse("admin:gateway_modelprice_changelist")).content.decode()
    assert "cached input micros per mtok" in listing.lower()

    spec = ModelSpec.objects.get(name="claude-haiku-4-5")
    change = reverse("admin:gateway_modelspec_change", args=[spec.pk])
    page = admin_client.get(change).content.decode()
    assert 'name="cache_write_micros_per_mtok" value="1250000"' in page
    form = {name: getattr(spec, name) for name in (
        "name", "tokenizer", "kind", "context_window", "default_output_tokens",
        "max_output_tokens", "input_price_micros_per_mtok", "output_price_micros_per_mtok",
        "cached_input_micros_per_mtok", "cache_write_micros_per_mtok")}
    form.update(enabled="on", reasoning_micros_per_mtok=6_000_000)
    assert admin_client.post(change, form).status_code == 302
    spec.refresh_from_db()
    assert spec.reasoning_micros_per_mtok == 6_000_000
    assert AuditEvent.objects.get(action="model.update", target="claude-haiku-4-5").data == {
        "fields": ["reasoning_micros_per_mtok"]}


# --- the migrations ----------------------------------------------------------------------------


def _migrate(*targets: tuple[str, str]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(list(targets))
    return executor.loader.project_state(list(targets)).apps


def _columns(table: str) -> set[str]:
    with connection.cursor() as cursor:
        return {c.name for c in connection.introspection.get_table_description(cursor, table)}


@pytest.mark.django_db
def test_the_migrations_apply_and_reverse() -> None:
    """Back to the state before this work and forward again, inside the test's transaction
    (PostgreSQL's DDL is transactional): nothing of it outlives the test."""
    with connection.cursor() as cursor:
        # Deleting the seeded models (and their aliases) queues deferred foreign-key checks; an
        # ALTER TABLE of the same table in that transaction needs them run first.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    apps = _migrate(("gateway", "0003_prices_aliases"), ("billing", "0008_pace_trips"))
    assert "cached_input_micros_per_mtok" not in _columns("gateway_modelspec")
    assert "reasoning_micros_per_mtok" not in _columns("billing_modelprice")
    assert "kind" not in _columns("gateway_providerkey")
    assert "cached_input_tokens" not in _columns("billing_usagerecord")
    assert "theirs_priced_micros" not in _columns("billing_reconciliationrow")
    spec_model = apps.get_model("gateway", "ModelSpec")
    assert not spec_model.objects.filter(name__startswith="claude-").exists()
    # An operator's edits before the upgrade: gpt-4.1 repriced, a Claude model of their own.
    spec_model.objects.filter(name="gpt-4.1").update(input_price_micros_per_mtok=1_900_000)
    spec_model.objects.create(name="claude-haiku-4-5", tokenizer="cl100k_base", kind="chat",
                              context_window=100_000, default_output_tokens=1_000,
                              max_output_tokens=8_000, input_price_micros_per_mtok=9,
                              output_price_micros_per_mtok=9)

    apps = _migrate(("gateway", "0005_catalog_class_prices_anthropic"),
                    ("billing", "0009_usage_token_classes"))
    assert {"cached_input_tokens", "cache_write_tokens", "reasoning_tokens"} <= _columns(
        "billing_usagerecord")
    spec_model = apps.get_model("gateway", "ModelSpec")
    specs = {s.name: s for s in spec_model.objects.all()}
    assert specs["gpt-4o"].cached_input_micros_per_mtok == 1_250_000
    assert specs["o3-mini"].reasoning_micros_per_mtok == 4_400_000
    assert specs["gpt-4.1"].cached_input_micros_per_mtok is None  # the operator's price wins
    assert specs["claude-haiku-4-5"].input_price_micros_per_mtok == 9  # never overwritten
    assert specs["claude-haiku-4-5"].cached_input_micros_per_mtok is None
    assert specs["claude-opus-4-1"].cache_write_micros_per_mtok == 18_750_000
    aliases = set(apps.get_model("gateway", "ModelAlias").objects.values_list("alias", flat=True))
    assert "claude-opus-4-1-20250805" in aliases
    assert "claude-haiku-4-5-20251001" not in aliases  # not made for the operator's entry
    assert set(apps.get_model("gateway", "ProviderKey").objects.values_list(
        "kind", flat=True)) <= {"openai"}

    # After the upgrade: an alias of the operator's own Claude entry, a seeded one repriced.
    alias_model = apps.get_model("gateway", "ModelAlias")
    alias_model.objects.create(alias="claude-haiku-own", model=specs["claude-haiku-4-5"])
    spec_model.objects.filter(name="claude-opus-4-5").update(input_price_micros_per_mtok=4_000_000)

    apps = _migrate(("gateway", "0004_token_class_prices_provider_kind"))
    specs = {s.name: s for s in apps.get_model("gateway", "ModelSpec").objects.all()}
    assert specs["gpt-4o"].cached_input_micros_per_mtok is None
    assert specs["o3-mini"].reasoning_micros_per_mtok is None
    # Only the entries still exactly as 0005 seeded them go, with their aliases; the operator's
    # own entry of a seeded name and a seeded entry the operator edited stay.
    assert {name for name in specs if name.startswith("claude-")} == {"claude-haiku-4-5",
                                                                      "claude-opus-4-5"}
    assert specs["claude-haiku-4-5"].input_price_micros_per_mtok == 9
    aliases = dict(apps.get_model("gateway", "ModelAlias").objects.values_list("alias",
                                                                               "model__name"))
    assert aliases.get("claude-haiku-own") == "claude-haiku-4-5"
    assert aliases.get("claude-opus-4-5-20251101") == "claude-opus-4-5"
    assert "claude-sonnet-4-5-20250929" not in aliases
    assert "claude-opus-4-1-20250805" not in aliases
    apps = _migrate(("gateway", "0005_catalog_class_prices_anthropic"))
    specs = {s.name: s for s in apps.get_model("gateway", "ModelSpec").objects.all()}
    assert specs["claude-sonnet-4-5"].cache_write_micros_per_mtok == 3_750_000  # seeded again
    assert specs["claude-opus-4-5"].input_price_micros_per_mtok == 4_000_000  # still the edit
