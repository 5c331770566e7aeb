"""Provider-key default prices count only for calls of the key's kind (gateway/prices.py): a model
without a price of its own takes the highest default of the enabled keys of the CALL'S kind that
serve it (/v1/messages: anthropic keys; every other endpoint: openai keys), else it is unpriced
(403 model_not_priced). The ledger prices unmetered rows the same way (the kind from the event's
endpoint)."""
from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from billing.ledger import record_from_event
from billing.prices import PriceBook as LedgerPriceBook
from gateway.admission import check
from gateway.auth import load_key_context
from gateway.bodies import Endpoint, parse_body
from gateway.catalog import load_catalog
from gateway.errors import GatewayError
from gateway.models import ProviderKey
from gateway.prices import DefaultPrice, Price, PriceBook
from gateway.providers import create_provider_key
from tenants.api_key_format import parse_key
from tenants.services import create_project, create_tenant, issue_key

NOW = datetime(2026, 11, 20, 12, tzinfo=UTC)
UNPRICED = "kind-test-unpriced-model"  # in no catalog, no price period
CHEAP = Price(100_000, 200_000)
DEAR = Price(3_000_000, 15_000_000)


def test_a_default_price_serves_only_its_kind() -> None:
    book = PriceBook.of(defaults=[DefaultPrice(CHEAP, frozenset(), "openai"),
                                  DefaultPrice(DEAR, frozenset({"claude-x"}), "anthropic")])
    assert book.price(UNPRICED, NOW) == CHEAP  # "openai", like the pool's default
    assert book.price(UNPRICED, NOW, "openai") == CHEAP
    assert book.price(UNPRICED, NOW, "anthropic") is None  # the anthropic key does not serve it
    # The dearer anthropic default never raises what an OpenAI-side call of the name costs.
    assert book.price("claude-x", NOW, "openai") == CHEAP
    assert book.price("claude-x", NOW, "anthropic") == DEAR


def _only_these_keys(*keys: ProviderKey) -> None:
    # Keys another test committed for the session (tests/gateway/conftest.py) name default
    # prices for every model: out of this test's price book (rolled back with the test).
    ProviderKey.objects.exclude(pk__in=[key.pk for key in keys]).update(enabled=False)


def _check(endpoint: Endpoint, body: dict) -> Price:
    tenant = create_tenant(f"kinds-{endpoint.name.lower()}-{id(body)}", plan_name="free",
                           actor="test")
    issued = issue_key(create_project(tenant, "app", actor="test"), actor="test")
    ctx = load_key_context(parse_key(issued.plaintext))
    runtime = SimpleNamespace(catalog=load_catalog())
    parsed = parse_body(endpoint, json.dumps(body).encode())
    return check(runtime, ctx, parsed).estimate.price  # type: ignore[arg-type]


def _chat() -> Price:
    return _check(Endpoint.CHAT, {"model": UNPRICED, "max_tokens": 10,
                                  "messages": [{"role": "user", "content": "hi"}]})


def _messages() -> Price:
    return _check(Endpoint.MESSAGES, {"model": UNPRICED, "max_tokens": 10,
                                      "messages": [{"role": "user", "content": "hi"}]})


def _refused(call: object) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call()  # type: ignore[operator]
    return info.value


@pytest.mark.django_db
def test_admission_prices_an_unpriced_model_by_the_keys_of_the_calls_kind() -> None:
    openai_key = create_provider_key("cheap-openai", base_url="https://a.test/v1",
                                     secret="sk-kinds-openai-0001", default_price=CHEAP)
    anthropic_key = create_provider_key("plain-anthropic", base_url="https://b.test/v1",
                                        secret="sk-kinds-anthropic-0001", kind="anthropic")
    _only_these_keys(openai_key, anthropic_key)
    # Only the openai key names a default: chat uses it, /v1/messages is unpriced.
    assert _chat() == CHEAP
    error = _refused(_messages)
    assert (error.status, error.code) == (403, "model_not_priced")

    # The opposite: only the anthropic key names one.
    ProviderKey.objects.filter(pk=openai_key.pk).update(
        default_input_price_micros_per_mtok=None, default_output_price_micros_per_mtok=None)
    ProviderKey.objects.filter(pk=anthropic_key.pk).update(
        default_input_price_micros_per_mtok=DEAR.input_micros_per_mtok,
        default_output_price_micros_per_mtok=DEAR.output_micros_per_mtok)
    assert _messages() == DEAR
    error = _refused(_chat)
    assert (error.status, error.code) == (403, "model_not_priced")

    # Both: each endpoint its own kind's price, never the dearer of the two.
    ProviderKey.objects.filter(pk=openai_key.pk).update(
        default_input_price_micros_per_mtok=CHEAP.input_micros_per_mtok,
        default_output_price_micros_per_mtok=CHEAP.output_micros_per_mtok)
    assert (_chat(), _messages()) == (CHEAP, DEAR)


def _unmetered_event(endpoint: str) -> dict[str, str]:
    ms = int(NOW.timestamp() * 1000)
    return {"request_id": f"req-{endpoint}", "outcome": "unmetered", "actual": "1500",
            "created": str(ms - 100), "ended": str(ms), "held": "0",
            "meta": json.dumps({"m": UNPRICED, "served": UNPRICED, "ep": endpoint}),
            "event": json.dumps({"in": 1_000, "out": 500, "st": 200, "outcome": "complete"})}


@pytest.mark.django_db
def test_the_ledger_prices_an_unmetered_row_by_its_endpoints_kind() -> None:
    tenant = create_tenant("kinds-ledger", plan_name="free", actor="test")
    prices = LedgerPriceBook.of(defaults=[DefaultPrice(CHEAP, frozenset(), "openai"),
                                          DefaultPrice(DEAR, frozenset(), "anthropic")])
    # 1,000 input and 500 output tokens at each kind's default price.
    for endpoint, price in (("chat/completions", CHEAP), ("responses", CHEAP),
                            ("messages", DEAR)):
        row = record_from_event(tenant.pk, _unmetered_event(endpoint), prices)
        assert (row.status, row.endpoint) == ("unmetered", endpoint)
        assert row.cost_micros == price.cost(1_000, 500), endpoint
    # An event without an endpoint (written before the gateway recorded it): an OpenAI call.
    fields = _unmetered_event("")
    fields["meta"] = json.dumps({"m": UNPRICED, "served": UNPRICED})
    assert record_from_event(tenant.pk, fields, prices).cost_micros == CHEAP.cost(1_000, 500)
