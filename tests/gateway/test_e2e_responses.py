"""OpenAI's Responses API end to end: the official openai SDK against a gateway running under
uvicorn (real Redis, real PostgreSQL) and the mock upstream.

Every call is checked for money: its ledger row (one per request, found by the request id) equals
what the mock billed for it, token for token and class by class (cached input, cache writes,
reasoning), its cost is the model's price of each class, and the tenant's counter holds nothing
pending afterwards.

The module starts its own gateway after committing its catalog models, so every worker loads
their prices at start (no wait for a catalog reload). The models carry the mock's fault options in
their names (`...@cached_tokens=7`): the mock applies them whichever provider key serves the call,
and bills the call under the name before the first "@", a name no other test uses. The helpers
here are shared with test_e2e_messages.py and test_e2e_agents.py.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import httpx
import httpx2
import openai
import pytest

from gateway.mock_upstream import MockUpstream
from gateway.prices import Price
from gateway.usage import Usage
from quotas.engine import QuotaEngine
from quotas.windows import WindowKind
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    TenantKey,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}
# Distinct prices per class (micro-dollars per million tokens), so a cost computed with a class
# at the wrong price cannot come out equal.
CLASS_PRICE = Price(2_000_000, 8_000_000, cached_input_micros_per_mtok=500_000,
                    cache_write_micros_per_mtok=2_500_000, reasoning_micros_per_mtok=12_000_000)


# -- shared helpers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A catalog model this module created: its name as sent, and its price."""

    name: str
    price: Price

    @property
    def billed_as(self) -> str:
        """The name the mock bills it under (its fault options stripped)."""
        return self.name.split("@")[0]


def priced_models(django_db_blocker: Any, prefix: str, suffixes: dict[str, str],
                  tokenizer: str) -> dict[str, Model]:
    """Commit one catalog model per entry of `suffixes` (label -> the mock's fault options, "" for
    none), each with a unique base name and CLASS_PRICE."""
    from gateway.models import ModelSpec
    from gateway.prices import save_model_spec

    # Short names: the audit trail keeps at most 32 characters of a catalog row's name.
    models = {label: Model(f"{prefix}-{uuid.uuid4().hex[:8]}{options}", CLASS_PRICE)
              for label, options in suffixes.items()}

    def create() -> None:
        for model in models.values():
            save_model_spec(ModelSpec(
                name=model.name, tokenizer=tokenizer, context_window=128_000,
                default_output_tokens=1_000, max_output_tokens=16_000,
                input_price_micros_per_mtok=CLASS_PRICE.input_micros_per_mtok,
                output_price_micros_per_mtok=CLASS_PRICE.output_micros_per_mtok,
                cached_input_micros_per_mtok=CLASS_PRICE.cached_input_micros_per_mtok,
                cache_write_micros_per_mtok=CLASS_PRICE.cache_write_micros_per_mtok,
                reasoning_micros_per_mtok=CLASS_PRICE.reasoning_micros_per_mtok), actor="test")

    committed(django_db_blocker, create)
    return models


def drop_models(django_db_blocker: Any, models: dict[str, Model]) -> None:
    from gateway.models import ModelSpec
    from gateway.prices import delete_model_spec

    committed(django_db_blocker, lambda: [
        delete_model_spec(spec, actor="test")
        for spec in ModelSpec.objects.filter(name__in=[m.name for m in models.values()])])


@dataclass(frozen=True)
class Bill:
    """What the mock billed (all provider keys together) for one model name."""

    input: int = 0
    output: int = 0
    cached: int = 0
    cache_write: int = 0
    reasoning: int = 0
    requests: int = 0

    def __sub__(self, other: Bill) -> Bill:
        return Bill(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def usage(self) -> Usage:
        return Usage(self.input, self.output, self.cached, self.cache_write, self.reasoning)


def billed(mock: MockUpstream, model: str) -> Bill:
    name = model.split("@")[0]
    total = Bill()
    for row in httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]:
        if row["model"] == name:
            total = Bill(total.input + row["prompt_tokens"],
                         total.output + row["completion_tokens"],
                         total.cached + row["input_cached_tokens"],
                         total.cache_write + row["input_cache_write_tokens"],
                         total.reasoning + row["output_reasoning_tokens"],
                         total.requests + row["requests"])
    return total


class Meter:
    """The mock's bill for one model, one request at a time: `with meter.call() as bill:` around
    a call leaves the call's own bill in `bill.value`."""

    def __init__(self, mock: MockUpstream, model: str) -> None:
        self.mock, self.model = mock, model
        self.last = billed(mock, model)

    def take(self) -> Bill:
        """The bill since the previous take (or since the meter was made)."""
        now = billed(self.mock, self.model)
        delta, self.last = now - self.last, now
        return delta


class RequestIds:
    """Every gateway request id a client's HTTP client saw, in order (a response hook, so it
    works for the openai, anthropic and agents SDKs alike, streaming or not). The SDKs speak
    through httpx2, so the hooked clients are httpx2's."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def _record(self, response: httpx2.Response) -> None:
        self.seen.append((response.headers.get("x-request-id", ""), response.status_code))

    async def _arecord(self, response: httpx2.Response) -> None:
        self._record(response)

    def client(self, **options: Any) -> httpx2.Client:
        return httpx2.Client(event_hooks={"response": [self._record]}, **options)

    def async_client(self, **options: Any) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(event_hooks={"response": [self._arecord]}, **options)

    @property
    def last(self) -> str:
        return self.seen[-1][0]


def ledger_rows(django_db_blocker: Any, engine: QuotaEngine, t: TenantKey,
                count: int) -> dict[str, Any]:
    """The tenant's ledger rows by request id, once its `count` usage events are drained; there
    must be exactly `count` of them (one per request that reached the hold)."""
    from billing.ledger import drain_tenant
    from billing.models import UsageRecord

    assert wait_until(lambda: len(usage_events(engine, t.tag)) >= count), usage_events(engine,
                                                                                         t.tag)
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    rows = committed(django_db_blocker,
                     lambda: list(UsageRecord.objects.filter(tenant_id=t.tenant_id)))
    assert len(rows) == count, [(r.request_id, r.status, r.detail) for r in rows]
    return {row.request_id: row for row in rows}


def assert_row_is_the_bill(row: Any, bill: Bill, price: Price) -> None:
    """A ledger row equals the mock's bill of its call, token for token and class by class, and
    costs each class at its price."""
    assert bill.requests == 1
    assert (row.input_tokens, row.output_tokens, row.cached_input_tokens, row.cache_write_tokens,
            row.reasoning_tokens) == (bill.input, bill.output, bill.cached, bill.cache_write,
                                      bill.reasoning)
    assert row.cost_micros == price.cost_of(bill.usage())
    assert row.over_hold_tokens == 0


def assert_nothing_pending(engine: QuotaEngine, t: TenantKey, used: int) -> None:
    counter = engine.counter(t.tag, "tenant", WindowKind.DAY)
    assert (counter.used, counter.pending) == (used, 0)
    assert engine.open_hold_ids(t.tag) == []


def default_price() -> Price:
    """The price of a model outside the catalog: the shared mock provider key's default price."""
    from tests.gateway.conftest import MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE

    return Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# -- this module's gateway -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(django_db_setup: None, django_db_blocker: Any) -> Iterator[dict[str, Model]]:
    made = priced_models(django_db_blocker, "sr", {
        "plain": "", "stream": "", "helper": "", "cut": "", "tool": "", "chain": "",
        "cached": "@cached_tokens=7", "reasoning": "@reasoning_tokens=5",
        "long": "@output_tokens=200"}, tokenizer="o200k_base")
    yield made
    drop_models(django_db_blocker, made)


@pytest.fixture(scope="module")
def server(models: dict[str, Model], provider_key: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    gateway = start_gateway(tmp_path_factory.mktemp("gateway-responses"), workers=2)
    yield gateway
    gateway.stop()


@dataclass
class Caller:
    t: TenantKey
    ids: RequestIds
    client: openai.OpenAI


@pytest.fixture
def caller(server: GatewayServer, make_tenant: MakeTenant) -> Callable[..., Caller]:
    def make(**overrides: Any) -> Caller:
        t = make_tenant(**{"requests_per_second": -1, **overrides})
        ids = RequestIds()
        client = openai.OpenAI(base_url=server.base_url, api_key=t.plaintext, max_retries=0,
                               timeout=30, http_client=ids.client())
        return Caller(t, ids, client)

    return make


# -- the tests -----------------------------------------------------------------------------------


def test_create_is_metered_exactly(caller: Callable[..., Caller], models: dict[str, Model],
                                   mock_upstream: MockUpstream, engine: QuotaEngine,
                                   django_db_blocker: Any) -> None:
    c = caller()
    model = models["plain"]
    meter = Meter(mock_upstream, model.name)
    response = c.client.responses.create(model=model.name, instructions="be brief",
                                         input="hello there gateway", max_output_tokens=50)
    bill = meter.take()
    assert response.status == "completed" and response.output_text
    assert response._request_id == c.ids.last and response._request_id.startswith("req_")
    assert response.usage is not None
    # 2 + 3 words of instructions and input, 16 words of answer.
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5, 16)
    assert (bill.input, bill.output) == (5, 16)
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert row.request_id == response._request_id and row.endpoint == "responses"
    assert row.model == model.name and row.status == "settled" and not row.streamed
    assert_row_is_the_bill(row, bill, model.price)
    assert_nothing_pending(engine, c.t, 21)


def test_streams_are_metered_from_the_final_event(
    caller: Callable[..., Caller], models: dict[str, Model], mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    model, helper_model, cut_model = models["stream"], models["helper"], models["cut"]
    meter = Meter(mock_upstream, model.name)
    events = list(c.client.responses.create(model=model.name, input="stream to me please",
                                            stream=True))
    streamed_bill = meter.take()
    streamed_id = c.ids.last
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 16
    final = events[-1].response
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (4, 16)

    helper_meter = Meter(mock_upstream, helper_model.name)
    with c.client.responses.stream(model=helper_model.name, input="and with the helper",
                                   max_output_tokens=30) as stream:
        text = "".join(event.delta for event in stream
                       if event.type == "response.output_text.delta")
        # The SDK's helper wants `response.completed` (an incomplete answer makes it raise).
        helper_final = stream.get_final_response()
    helper_bill = helper_meter.take()
    helper_id = c.ids.last
    assert helper_id != streamed_id
    assert helper_final.status == "completed" and len(text.split()) == 16
    assert helper_final.usage is not None and helper_final.usage.output_tokens == 16

    # A stream the cap cuts ends with `response.incomplete`, whose usage is settled the same way.
    cut_meter = Meter(mock_upstream, cut_model.name)
    cut_events = list(c.client.responses.create(model=cut_model.name, input="cut me short",
                                                max_output_tokens=9, stream=True))
    cut_bill = cut_meter.take()
    cut_id = c.ids.last
    assert cut_events[-1].type == "response.incomplete"
    cut_final = cut_events[-1].response
    assert cut_final.usage is not None and cut_final.usage.output_tokens == 9

    rows = ledger_rows(django_db_blocker, engine, c.t, 3)
    for request_id, usage, bill, priced in ((streamed_id, final.usage, streamed_bill, model),
                                            (helper_id, helper_final.usage, helper_bill,
                                             helper_model),
                                            (cut_id, cut_final.usage, cut_bill, cut_model)):
        row = rows[request_id]
        assert row.streamed and row.status == "settled"
        assert (row.input_tokens, row.output_tokens) == (usage.input_tokens, usage.output_tokens)
        assert_row_is_the_bill(row, bill, priced.price)
    assert_nothing_pending(engine, c.t, 4 + 16 + 4 + 16 + 3 + 9)


def test_function_tool_round_trip(caller: Callable[..., Caller], models: dict[str, Model],
                                  mock_upstream: MockUpstream, engine: QuotaEngine,
                                  django_db_blocker: Any) -> None:
    c = caller()
    model = models["tool"]
    meter = Meter(mock_upstream, model.name)
    first = c.client.responses.create(model=model.name, tools=[WEATHER_TOOL],
                                      input="what is the weather in Paris")
    first_bill, first_id = meter.take(), c.ids.last
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}

    # The function's result, sent back with the whole conversation (no stored state needed).
    second = c.client.responses.create(model=model.name, tools=[WEATHER_TOOL], input=[
        {"role": "user", "content": "what is the weather in Paris"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny and warm"},
    ])
    second_bill, second_id = meter.take(), c.ids.last
    assert second.status == "completed" and second.output_text
    assert not [item for item in second.output if item.type == "function_call"]

    rows = ledger_rows(django_db_blocker, engine, c.t, 2)
    assert_row_is_the_bill(rows[first_id], first_bill, model.price)
    assert_row_is_the_bill(rows[second_id], second_bill, model.price)
    assert first.usage is not None and second.usage is not None
    assert rows[second_id].input_tokens == second.usage.input_tokens
    assert_nothing_pending(engine, c.t, first.usage.total_tokens + second.usage.total_tokens)


def test_previous_response_chain_holds_for_the_earlier_turns(
    caller: Callable[..., Caller], models: dict[str, Model], mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    model = models["chain"]
    meter = Meter(mock_upstream, model.name)
    first = c.client.responses.create(model=model.name, tools=[WEATHER_TOOL],
                                      input="what is the weather in Paris")
    first_bill, first_id = meter.take(), c.ids.last
    [call] = [item for item in first.output if item.type == "function_call"]
    # Continues the stored response: the upstream adds the first turn (its input and output)
    # to this turn's input, tokens the gateway never sees in the body.
    second = c.client.responses.create(
        model=model.name, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    second_bill, second_id = meter.take(), c.ids.last
    third = c.client.responses.create(model=model.name, previous_response_id=second.id,
                                      input="thanks a lot", max_output_tokens=4)
    third_bill, third_id = meter.take(), c.ids.last
    assert first.usage and second.usage and third.usage
    assert second.status == "completed" and second.output_text
    tools_words = len(json.dumps([WEATHER_TOOL]).split())  # the mock counts them as input
    assert second.usage.input_tokens == first.usage.total_tokens + tools_words + 1
    assert third.usage.input_tokens == second.usage.total_tokens + 3

    rows = ledger_rows(django_db_blocker, engine, c.t, 3)
    for request_id, bill in ((first_id, first_bill), (second_id, second_bill),
                             (third_id, third_bill)):
        # over_hold_tokens == 0 inside: each hold covered the earlier turns it was sent with.
        assert_row_is_the_bill(rows[request_id], bill, model.price)
    assert rows[second_id].input_tokens > first.usage.total_tokens
    assert rows[second_id].held_tokens >= rows[second_id].input_tokens
    assert_nothing_pending(engine, c.t, sum(r.usage.total_tokens for r in (first, second, third)))


def test_the_output_cap_shrinks_to_the_headroom(
    caller: Callable[..., Caller], models: dict[str, Model], mock_upstream: MockUpstream,
    engine: QuotaEngine, django_db_blocker: Any
) -> None:
    # 100 tokens a day: the client's 1,000 output tokens cannot be held, so the hold shrinks to
    # what is left and the upstream gets the max_output_tokens that hold pays for. The mock wants
    # to write 200 tokens (the model's fault option): the cap stops it, "incomplete".
    c = caller(tokens_per_day=100)
    model = models["long"]
    meter = Meter(mock_upstream, model.name)
    response = c.client.responses.create(model=model.name, input="tell me a long story",
                                         max_output_tokens=1_000)
    bill = meter.take()
    assert response.max_output_tokens is not None and response.max_output_tokens < 1_000
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == response.max_output_tokens < 200
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert_row_is_the_bill(row, bill, model.price)
    assert row.held_tokens <= 100 and row.input_tokens + row.output_tokens <= 100
    assert_nothing_pending(engine, c.t, response.usage.total_tokens)


@pytest.mark.parametrize("label", ["cached", "reasoning"])
def test_token_classes_are_billed_at_their_prices(
    label: str, caller: Callable[..., Caller], models: dict[str, Model],
    mock_upstream: MockUpstream, engine: QuotaEngine, django_db_blocker: Any
) -> None:
    c = caller()
    model = models[label]
    meter = Meter(mock_upstream, model.name)
    response = c.client.responses.create(
        model=model.name, input="one two three four five six seven eight nine ten",
        max_output_tokens=40)
    bill = meter.take()
    usage = response.usage
    assert usage is not None
    if label == "cached":
        assert usage.input_tokens_details.cached_tokens == 7 == bill.cached
        assert (bill.input, bill.reasoning) == (10, 0)
    else:
        assert usage.output_tokens_details.reasoning_tokens == 5 == bill.reasoning
        assert (bill.output, bill.cached) == (16 + 5, 0)
    [row] = ledger_rows(django_db_blocker, engine, c.t, 1).values()
    assert (row.cached_input_tokens, row.reasoning_tokens) == (
        usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens)
    assert_row_is_the_bill(row, bill, model.price)
    # The classes changed the cost: all tokens at the plain prices would cost something else.
    assert row.cost_micros != model.price.cost(row.input_tokens, row.output_tokens)
    assert_nothing_pending(engine, c.t, usage.total_tokens)


# -- refusals: the SDK's exception classes, nothing forwarded, nothing held ------------------------


def test_over_quota_is_a_rate_limit_error_and_nothing_is_forwarded(
    caller: Callable[..., Caller], mock_upstream: MockUpstream, engine: QuotaEngine,
    django_db_blocker: Any
) -> None:
    c = caller(tokens_per_day=10)
    model = unique("sdk-resp-refused")
    with pytest.raises(openai.RateLimitError) as info:
        c.client.responses.create(model=model, input=" ".join(["word"] * 40))
    assert info.value.status_code == 429 and info.value.code == "insufficient_quota"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert billed(mock_upstream, model).requests == 0
    assert_nothing_pending(engine, c.t, 0)
    assert usage_events(engine, c.t.tag) == []


def test_a_model_not_allowed_is_a_permission_error(
    caller: Callable[..., Caller], mock_upstream: MockUpstream, engine: QuotaEngine
) -> None:
    allowed = unique("sdk-resp-allowed")
    c = caller(key_options={"allowed_models": [allowed]})
    other = unique("sdk-resp-other")
    with pytest.raises(openai.PermissionDeniedError) as info:
        c.client.responses.create(model=other, input="hello")
    assert info.value.code == "model_not_allowed"
    assert billed(mock_upstream, other).requests == 0
    assert_nothing_pending(engine, c.t, 0)


def test_background_mode_is_refused(caller: Callable[..., Caller], mock_upstream: MockUpstream,
                                    engine: QuotaEngine) -> None:
    c = caller()
    model = unique("sdk-resp-background")
    with pytest.raises(openai.BadRequestError) as info:
        c.client.responses.create(model=model, input="hello", background=True)
    assert info.value.code == "unsupported_parameter"
    assert info.value.param == "background"
    assert billed(mock_upstream, model).requests == 0
    assert_nothing_pending(engine, c.t, 0)


def test_an_unknown_previous_response_is_refused(
    caller: Callable[..., Caller], mock_upstream: MockUpstream, engine: QuotaEngine
) -> None:
    c = caller()
    model = unique("sdk-resp-unseen")
    with pytest.raises(openai.BadRequestError) as info:
        c.client.responses.create(model=model, input="go on",
                                  previous_response_id="resp_not_made_through_the_gateway")
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"
    assert billed(mock_upstream, model).requests == 0
    assert_nothing_pending(engine, c.t, 0)


def test_another_tenants_response_cannot_be_continued(
    caller: Callable[..., Caller], mock_upstream: MockUpstream, engine: QuotaEngine,
    django_db_blocker: Any
) -> None:
    owner, other = caller(), caller()
    model = unique("sdk-resp-owner")
    first = owner.client.responses.create(model=model, input="a private turn")
    with pytest.raises(openai.BadRequestError) as info:
        other.client.responses.create(model=model, input="go on", previous_response_id=first.id)
    assert info.value.code == "previous_response_not_found"
    assert billed(mock_upstream, model).requests == 1
    [row] = ledger_rows(django_db_blocker, engine, owner.t, 1).values()
    assert_row_is_the_bill(row, billed(mock_upstream, model), default_price())
    assert_nothing_pending(engine, other.t, 0)
