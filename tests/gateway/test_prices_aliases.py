"""One price, one model name: the price book (price periods, list prices, model aliases, provider
keys' default prices) that the hot path's money holds and the ledger share; model_not_priced; a
spend budget of 0; aliases applied to caps, per-model limits, allowed-model lists and
reconciliation.

The end-to-end tests run a gateway of their own, started after this module's models, prices and
alias exist (and removed again at the end, so the seeded catalog other tests check is intact).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.test import Client

from billing.bills import CsvBill
from billing.ledger import drain_tenant
from billing.models import ReconciliationRun, UsageRecord
from billing.prices import FREE
from billing.prices import PriceBook as LedgerPriceBook
from billing.reconciliation import reconcile
from gateway.admission import admit, check, priced
from gateway.bodies import Endpoint, parse_body
from gateway.catalog import Catalog, ModelInfo, load_catalog
from gateway.errors import GatewayError
from gateway.listener import _apply
from gateway.mock_upstream import api_key_id
from gateway.models import ModelAlias, ModelPrice, ModelSpec, ProviderKey
from gateway.prices import DefaultPrice, Period, Price, PriceBook, save_alias, save_price
from gateway.providers import create_provider_key, update_provider_key
from quotas import keys as quota_keys
from quotas.engine import QuotaEngine, Reservation, ReserveRequest, ScopeLimit, Unit
from quotas.keys import INVALIDATION_CHANNEL
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.api_key_format import parse_key
from tenants.services import create_project, create_tenant, issue_key
from tests.gateway.conftest import (
    MOCK_DEFAULT_INPUT_PRICE,
    MOCK_DEFAULT_OUTPUT_PRICE,
    GatewayServer,
    MakeTenant,
    TenantKey,
    client_for,
    committed,
    start_gateway,
    wait_until,
)

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
LIST = Price(1_000_000, 2_000_000)
TRIPLE = Price(3_000_000, 6_000_000)
HI = [{"role": "user", "content": "hi there"}]


def book(**options: Any) -> PriceBook:
    return PriceBook.of(**options)


# --- the resolution ----------------------------------------------------------------------------


def test_a_price_period_overrides_the_list_price_only_while_it_runs() -> None:
    prices = book(list_prices={"m": LIST},
                  periods=[("m", Period(TRIPLE, NOW, NOW + timedelta(days=1)))])
    assert prices.price("m", NOW - timedelta(seconds=1)) == LIST
    assert prices.price("m", NOW) == TRIPLE  # valid_from is inclusive
    assert prices.price("m", NOW + timedelta(days=1)) == LIST  # valid_to is exclusive


def test_of_overlapping_periods_the_one_that_started_last_applies() -> None:
    prices = book(periods=[("m", Period(LIST, NOW - timedelta(days=9), None)),
                           ("m", Period(TRIPLE, NOW - timedelta(days=1), None))])
    assert prices.price("m", NOW) == TRIPLE
    assert prices.price("m", NOW - timedelta(days=2)) == LIST


def test_an_alias_takes_its_models_price_and_name() -> None:
    prices = book(list_prices={"gpt-4o": LIST}, aliases={"gpt-4o-2024-08-06": "gpt-4o"},
                  periods=[("gpt-4o", Period(TRIPLE, NOW, None))])
    assert prices.canonical("gpt-4o-2024-08-06") == "gpt-4o"
    assert prices.canonical("gpt-4o") == "gpt-4o"
    assert prices.price("gpt-4o-2024-08-06", NOW) == TRIPLE
    assert prices.price("gpt-4o-2024-08-06", NOW - timedelta(days=1)) == LIST


def test_an_unpriced_model_has_no_price_unless_a_provider_key_serving_it_names_one() -> None:
    assert book(list_prices={"gpt-4o": LIST}).price("gpt-4o-2099-01-01", NOW) is None
    defaults = [DefaultPrice(Price(5, 1), frozenset()),  # every model
                DefaultPrice(Price(2, 9), frozenset({"llama"})),
                DefaultPrice(Price(99, 99), frozenset({"other"}))]
    prices = book(list_prices={"gpt-4o": LIST}, defaults=defaults)
    # The dearer of each price among the keys that serve it: an upper bound whichever serves.
    assert prices.price("llama", NOW) == Price(5, 9)
    assert prices.price("mystery", NOW) == Price(5, 1)
    assert prices.price("gpt-4o", NOW) == LIST  # a model's own price always wins
    assert book(defaults=defaults[1:]).price("mystery", NOW) is None


def test_the_ledger_costs_a_row_it_cannot_price_at_zero_and_says_so(caplog: Any) -> None:
    prices = LedgerPriceBook.of(list_prices={"gpt-4o": LIST})
    assert prices.price("gpt-4o", NOW) == LIST
    with caplog.at_level(logging.ERROR, logger="billing.prices"):
        assert prices.price("withdrawn", NOW) == FREE
    assert "no price for model 'withdrawn'" in caplog.text


def test_a_money_hold_is_never_zero() -> None:
    from gateway.admission import Estimate

    info = ModelInfo("m", "o200k_base", "chat", 128_000, 4_096, 16_384)
    assert Estimate(info, 10, 100, 10, Price(0, 0)).worst_cost_micros == 1
    # Every held token at the dearer price, rounded up: 100 * 2.000001 micro-dollars.
    assert Estimate(info, 10, 100, 10, Price(1, 2_000_001)).worst_cost_micros == 201


def test_load_reads_periods_aliases_list_prices_and_enabled_default_prices() -> None:
    spec = ModelSpec.objects.get(name="gpt-4o")
    save_price(ModelPrice(model="gpt-4o", input_micros_per_mtok=7, output_micros_per_mtok=8,
                          valid_from=NOW))
    save_alias(ModelAlias(alias="gpt-4o-2024-08-06", model=spec))
    create_provider_key("priced", base_url="https://a.test/v1", secret="sk-priced-0000000001",
                        models=["llama"], default_price=Price(11, 12))
    create_provider_key("off", base_url="https://b.test/v1", secret="sk-priced-0000000002",
                        enabled=False, default_price=Price(99, 99))
    create_provider_key("unpriced", base_url="https://c.test/v1", secret="sk-priced-0000000003")
    prices = PriceBook.load()
    assert prices.price("gpt-4o-2024-08-06", NOW) == Price(7, 8)
    assert prices.price("gpt-4o-2024-08-06", NOW - timedelta(seconds=1)) == Price(
        spec.input_price_micros_per_mtok, spec.output_price_micros_per_mtok,
        cached_input_micros_per_mtok=spec.cached_input_micros_per_mtok)
    assert prices.price("llama", NOW) == Price(11, 12)
    assert prices.price("mystery", NOW) is None  # the disabled key's default does not count
    catalog = load_catalog()
    assert catalog.resolve("gpt-4o-2024-08-06") == catalog.resolve("gpt-4o")  # caps, tokenizer


# --- what operators can write ------------------------------------------------------------------


def test_one_name_one_meaning() -> None:
    gpt4o = ModelSpec.objects.get(name="gpt-4o")
    with pytest.raises(ValidationError, match="catalog model has this name"):
        save_alias(ModelAlias(alias="gpt-4o-mini", model=gpt4o))
    save_alias(ModelAlias(alias="gpt-4o-2024-08-06", model=gpt4o))
    with pytest.raises(ValidationError, match="alias"):
        save_price(ModelPrice(model="gpt-4o-2024-08-06", input_micros_per_mtok=1,
                              output_micros_per_mtok=1, valid_from=NOW))
    clash = ModelSpec(name="gpt-4o-2024-08-06", tokenizer="o200k_base", context_window=10,
                      default_output_tokens=1, max_output_tokens=1,
                      input_price_micros_per_mtok=1, output_price_micros_per_mtok=1)
    with pytest.raises(ValidationError, match="alias"):
        clash.full_clean()
    save_price(ModelPrice(model="llama", input_micros_per_mtok=1, output_micros_per_mtok=1,
                          valid_from=NOW))
    with pytest.raises(ValidationError, match="Open price periods"):
        save_alias(ModelAlias(alias="llama", model=gpt4o))


def test_a_provider_default_price_is_both_prices_or_none() -> None:
    key = create_provider_key("k", base_url="https://a.test/v1", secret="sk-default-000000001")
    key.default_input_price_micros_per_mtok = 5
    with pytest.raises(ValidationError, match="both"):
        update_provider_key(key, ["default_input_price_micros_per_mtok"])
    with pytest.raises(IntegrityError), transaction.atomic():
        ProviderKey.objects.filter(pk=key.pk).update(default_input_price_micros_per_mtok=5)
    key.default_output_price_micros_per_mtok = 6
    update_provider_key(key, ["default_input_price_micros_per_mtok",
                              "default_output_price_micros_per_mtok"])
    key.refresh_from_db()
    assert (key.default_input_price_micros_per_mtok, key.default_output_price_micros_per_mtok) == (
        5, 6)


def _received(pubsub: Any) -> list[dict[str, Any]]:
    messages, deadline = [], time.monotonic() + 2
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            body = json.loads(message["data"])
            body.pop("v")  # the message's number (quotas/invalidation.py)
            messages.append(body)
    return messages


def test_prices_aliases_and_default_prices_are_edited_in_admin_and_reach_the_gateways(
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw-123-secret"))
    gpt4o = ModelSpec.objects.get(name="gpt-4o")
    pubsub = get_engine().client.pubsub()
    pubsub.subscribe(INVALIDATION_CHANNEL)
    pubsub.get_message(timeout=1)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/admin/gateway/modelalias/add/",
                               {"alias": "gpt-4o-2024-08-06", "model": gpt4o.pk})
        assert response.status_code == 302, response.content[:2000]
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/admin/gateway/modelprice/add/", {
            "model": "gpt-4o", "input_micros_per_mtok": 7_500_000,
            "output_micros_per_mtok": 30_000_000, "valid_from_0": "2026-11-01",
            "valid_from_1": "00:00:00"})
        assert response.status_code == 302, response.content[:2000]
    # A price for an alias is refused by the form, not silently ignored later.
    response = client.post("/admin/gateway/modelprice/add/", {
        "model": "gpt-4o-2024-08-06", "input_micros_per_mtok": 1, "output_micros_per_mtok": 1,
        "valid_from_0": "2026-11-01", "valid_from_1": "00:00:00"})
    assert response.status_code == 200 and b"price its catalog model" in response.content
    messages = _received(pubsub)
    pubsub.close()
    assert messages.count({"kind": "catalog", "id": None}) == 2
    assert ModelAlias.objects.get(alias="gpt-4o-2024-08-06").model == gpt4o
    assert load_catalog().price("gpt-4o-2024-08-06", NOW) == Price(7_500_000, 30_000_000)
    for page in ("/admin/gateway/modelprice/", "/admin/gateway/modelalias/",
                 "/admin/gateway/providerkey/add/"):
        assert client.get(page).status_code == 200, page
    assert b"default_input_price_micros_per_mtok" in client.get(
        "/admin/gateway/providerkey/add/").content


def test_a_provider_key_change_reloads_the_catalog_with_its_default_prices() -> None:
    reloaded: list[str] = []

    async def reload_pool() -> None:
        reloaded.append("pool")

    async def reload_catalog() -> None:
        reloaded.append("catalog")

    runtime = SimpleNamespace(reload_pool=reload_pool, reload_catalog=reload_catalog)
    asyncio.run(_apply(runtime, INVALIDATION_CHANNEL, json.dumps({"kind": "providers", "id": None})))  # type: ignore[arg-type]
    assert reloaded == ["pool", "catalog"]


# --- admission, with a recording engine ---------------------------------------------------------


class RecordingEngine:
    """Admits everything and remembers what it was asked to reserve."""

    def __init__(self) -> None:
        self.requests: list[ReserveRequest] = []

    async def reserve(self, request: ReserveRequest, sent: Any = None) -> Reservation:
        self.requests.append(request)
        return Reservation(admitted=True, request_id=request.request_id, granted=request.amount,
                           counters=(), refused=None, server_time_ms=0, hold=None)


def _admit(catalog: Catalog, model: str, **key_options: Any) -> tuple[RecordingEngine, Any]:
    from gateway.auth import load_key_context

    tenant = create_tenant(f"t-{uuid.uuid4().hex[:8]}", plan_name="free", actor="test")
    issued = issue_key(create_project(tenant, "app", actor="test"), actor="test", **key_options)
    ctx = load_key_context(parse_key(issued.plaintext))
    engine = RecordingEngine()
    # The runtime's reserve is the engine's (plus the rebuild of lost counters, not needed here).
    runtime = SimpleNamespace(catalog=catalog, engine=engine, reserve=engine.reserve)
    parsed = parse_body(Endpoint.CHAT, json.dumps({"model": model, "messages": HI,
                                                   "max_tokens": 10}).encode())
    checked = check(runtime, ctx, parsed)  # type: ignore[arg-type]
    admission = asyncio.run(admit(runtime, ctx, checked, "req_1"))  # type: ignore[arg-type]
    return engine, admission


def test_admission_holds_and_records_the_resolved_price_under_the_canonical_model() -> None:
    gpt4o = ModelSpec.objects.get(name="gpt-4o")
    save_alias(ModelAlias(alias="gpt-4o-2024-08-06", model=gpt4o))
    save_price(ModelPrice(model="gpt-4o", input_micros_per_mtok=TRIPLE.input_micros_per_mtok,
                          output_micros_per_mtok=TRIPLE.output_micros_per_mtok,
                          valid_from=datetime.now(UTC) - timedelta(hours=1)))
    engine, admission = _admit(load_catalog(), "gpt-4o-2024-08-06")
    [request] = engine.requests
    assert (request.price_in, request.price_out) == (3_000_000, 6_000_000)
    assert request.input_tokens == admission.estimate.prompt_tokens > 0
    assert request.money_amount == TRIPLE.bound(request.amount)
    assert admission.estimate.price == TRIPLE  # what the settle charges (gateway/forward.py)
    assert admission.model == "gpt-4o-2024-08-06"  # forwarded as the client named it
    assert admission.estimate.info.name == "gpt-4o"  # gpt-4o's caps and tokenizer
    scopes = {limit.scope for limit in request.limits}
    assert quota_keys.model_scope("gpt-4o") in scopes
    assert quota_keys.model_scope("gpt-4o-2024-08-06") not in scopes


def test_an_unpriced_model_is_refused_before_anything_is_reserved() -> None:
    catalog = Catalog.of([], PriceBook.of(list_prices={"gpt-4o": LIST}))
    with pytest.raises(GatewayError) as info:
        _admit(catalog, "gpt-4o-2099-01-01")
    error = info.value
    assert (error.status, error.code, error.param) == (403, "model_not_priced", "model")
    body = json.loads(error.response().content)
    assert body["error"]["code"] == "model_not_priced"
    assert "gpt-4o-2099-01-01" in body["error"]["message"]
    runtime = SimpleNamespace(catalog=Catalog.of([], PriceBook.of(
        defaults=[DefaultPrice(Price(1, 2), frozenset())])))
    assert priced(runtime, "gpt-4o-2099-01-01",  # type: ignore[arg-type]
                  Endpoint.CHAT) == Price(1, 2)


# --- reconciliation ----------------------------------------------------------------------------


def test_reconciliation_compares_a_snapshot_as_its_model(tmp_path: Path) -> None:
    day = date(2026, 11, 20)
    tenant = create_tenant("acme", plan_name="free", actor="test")
    secret = "sk-reconcile-aliases-01"
    key = create_provider_key("upstream", base_url="https://upstream.test/v1", secret=secret,
                              tenant=tenant)
    save_alias(ModelAlias(alias="gpt-4o-2024-08-06", model=ModelSpec.objects.get(name="gpt-4o")))
    moment = datetime.combine(day, datetime.min.time(), tzinfo=UTC) + timedelta(hours=12)
    for rid, model in (("a", "gpt-4o"), ("b", "gpt-4o-2024-08-06")):
        UsageRecord.objects.create(request_id=rid, tenant=tenant, provider_key=key, model=model,
                                   served_model=model, input_tokens=100, output_tokens=50,
                                   status="settled", started_at=moment, ended_at=moment)
    bill = tmp_path / "bill.csv"
    # The upstream bills the snapshot's name for all of it (as OpenAI's usage API does).
    bill.write_text("day,api_key_id,model,input_tokens,output_tokens,requests,cost_usd\n"
                    f"{day},{api_key_id(secret)},gpt-4o-2024-08-06,200,100,2,\n")
    run = reconcile(day, CsvBill(bill), provider_key=key)
    [row] = run.rows.all()
    assert run.status == ReconciliationRun.Status.OK
    assert (row.model, row.ours_input, row.theirs_input, row.flagged, row.note) == (
        "gpt-4o", 200, 200, False, "")


# --- end to end: a gateway of this module's own ------------------------------------------------


@dataclass(frozen=True)
class Models:
    priced: str  # list price LIST, a price period at TRIPLE
    snapshot: str  # an alias of `priced`
    free: str  # priced 0 by an operator


@pytest.fixture(scope="module")
def models(django_db_blocker: Any, provider_key: str) -> Iterator[Models]:
    tag = uuid.uuid4().hex[:8]
    names = Models(f"px-{tag}", f"px-{tag}-2024-08-06", f"free-{tag}")

    def spec(name: str, price: Price) -> ModelSpec:
        return ModelSpec.objects.create(
            name=name, tokenizer="o200k_base", context_window=128_000, default_output_tokens=1_000,
            max_output_tokens=4_000, input_price_micros_per_mtok=price.input_micros_per_mtok,
            output_price_micros_per_mtok=price.output_micros_per_mtok)

    def create() -> None:
        px = spec(names.priced, LIST)
        spec(names.free, Price(0, 0))
        save_price(ModelPrice(model=names.priced, input_micros_per_mtok=3_000_000,
                              output_micros_per_mtok=6_000_000,
                              valid_from=datetime.now(UTC) - timedelta(hours=1)))
        save_alias(ModelAlias(alias=names.snapshot, model=px))

    committed(django_db_blocker, create)
    yield names

    def remove() -> None:
        ModelPrice.objects.filter(model=names.priced).delete()
        ModelSpec.objects.filter(name__in=[names.priced, names.free]).delete()  # and the alias

    committed(django_db_blocker, remove)


@pytest.fixture(scope="module")
def priced_gateway(models: Models,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("priced-gateway"), workers=2)
    yield server
    server.stop()


def _spend(engine: QuotaEngine, t: TenantKey) -> Any:
    # The spend budget's window is the tenant's cycle (daily on the free plan).
    return engine.counter(t.tag, quota_keys.tenant_scope(), WindowKind.MONTH, unit=Unit.MICROS,
                          schedule=t.schedule)


@pytest.mark.e2e
def test_a_price_period_three_times_the_list_price_is_what_the_budget_and_the_ledger_charge(
    priced_gateway: GatewayServer, models: Models, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(monthly_spend_budget_micros=10**9)
    completion = client_for(priced_gateway, t.plaintext).chat.completions.create(
        model=models.priced, max_tokens=20, messages=HI)
    expected = TRIPLE.cost(completion.usage.prompt_tokens, completion.usage.completion_tokens)
    assert expected == 3 * LIST.cost(completion.usage.prompt_tokens,
                                     completion.usage.completion_tokens) > 0
    spend = _spend(engine, t)
    assert (spend.used, spend.pending) == (expected, 0)
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    row = committed(django_db_blocker, lambda: UsageRecord.objects.get(tenant_id=t.tenant_id))
    assert row.cost_micros == expected


def _exhaust_spend_budget(engine: QuotaEngine, t: TenantKey, budget: int) -> None:
    """Spend the tenant's whole budget of its cycle, as calls before this one would have."""
    limit = ScopeLimit(quota_keys.tenant_scope(), WindowKind.MONTH, budget, Unit.MICROS)
    hold = engine.reserve(ReserveRequest(t.tag, f"req_spent_{uuid.uuid4().hex}", 1, (limit,),
                                         money_amount=budget, schedule=t.schedule)).hold
    assert hold is not None
    engine.settle(hold, 1, "", budget)
    spend = _spend(engine, t)
    assert (spend.limit, spend.used, spend.pending) == (budget, budget, 0)


@pytest.mark.e2e
def test_an_unknown_dated_model_or_an_alias_cannot_pass_an_exhausted_spend_budget(
    priced_gateway: GatewayServer, models: Models, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    t = make_tenant(monthly_spend_budget_micros=1_000)
    _exhaust_spend_budget(engine, t, 1_000)
    client = client_for(priced_gateway, t.plaintext)
    # Not in the catalog, no alias: priced by the mock provider key's default price.
    for model in ("gpt-4o-2099-12-31", models.snapshot):
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, max_tokens=1, messages=HI)
        assert info.value.code == "insufficient_quota", model
    assert engine.open_hold_ids(t.tag) == []
    assert _spend(engine, t).used == 1_000


@pytest.mark.e2e
def test_a_spend_budget_of_zero_refuses_even_a_call_priced_zero(
    priced_gateway: GatewayServer, models: Models, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    t = make_tenant(monthly_spend_budget_micros=0)
    client = client_for(priced_gateway, t.plaintext)
    for model in (models.free, "gpt-4o-2099-12-31"):
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, max_tokens=1, messages=HI)
        assert info.value.code == "insufficient_quota", model
    assert engine.open_hold_ids(t.tag) == []
    # A budget with room admits the call priced 0 and charges it nothing.
    t = make_tenant(monthly_spend_budget_micros=1_000)
    client_for(priced_gateway, t.plaintext).chat.completions.create(
        model=models.free, max_tokens=1, messages=HI)
    assert (_spend(engine, t).used, _spend(engine, t).pending) == (0, 0)


@pytest.mark.e2e
def test_an_alias_is_its_model_for_allowed_lists_per_model_limits_and_the_ledger(
    priced_gateway: GatewayServer, models: Models, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(key_options={"allowed_models": [models.priced]},
                    model_tokens_per_day={models.priced: 10**6})
    completion = client_for(priced_gateway, t.plaintext).chat.completions.create(
        model=models.snapshot, max_tokens=5, messages=HI)
    assert completion.model == models.snapshot  # forwarded under the name the client used
    per_model = engine.counter(t.tag, quota_keys.model_scope(models.priced))
    assert (per_model.limit, per_model.used) == (10**6, completion.usage.total_tokens)
    assert engine.counter(t.tag, quota_keys.model_scope(models.snapshot)).limit is None
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    row = committed(django_db_blocker, lambda: UsageRecord.objects.get(tenant_id=t.tenant_id))
    assert row.model == models.snapshot
    assert row.cost_micros == TRIPLE.cost(completion.usage.prompt_tokens,
                                          completion.usage.completion_tokens)
    # Not the other way round: a key allowed only the snapshot may not call the model.
    only_snapshot = make_tenant(key_options={"allowed_models": [models.snapshot]})
    with pytest.raises(openai.PermissionDeniedError) as info:
        client_for(priced_gateway, only_snapshot.plaintext).chat.completions.create(
            model=models.priced, max_tokens=1, messages=HI)
    assert info.value.code == "model_not_allowed"


@pytest.mark.e2e
def test_a_new_alias_reaches_running_gateways(
    priced_gateway: GatewayServer, models: Models, make_tenant: MakeTenant,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(key_options={"allowed_models": [models.priced]})
    client = client_for(priced_gateway, t.plaintext)
    newer = f"{models.priced}-2025-01-01"

    def allowed() -> bool:
        try:
            client.chat.completions.create(model=newer, max_tokens=1, messages=HI)
        except openai.PermissionDeniedError:
            return False
        return True

    assert not allowed()
    committed(django_db_blocker, lambda: save_alias(ModelAlias(
        alias=newer, model=ModelSpec.objects.get(name=models.priced))))
    # Both workers, whichever serves each call: several successes in a row.
    assert wait_until(lambda: all(allowed() for _ in range(4)), timeout=10)


@pytest.mark.e2e
def test_the_mock_provider_keys_default_price_meters_fault_injection_models(
    priced_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    t = make_tenant(monthly_spend_budget_micros=10**9)
    completion = client_for(priced_gateway, t.plaintext).chat.completions.create(
        model="gpt-4o@output_tokens=7", max_tokens=20, messages=HI)
    default = Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)
    expected = default.cost(completion.usage.prompt_tokens, completion.usage.completion_tokens)
    assert _spend(engine, t).used == expected > 0
