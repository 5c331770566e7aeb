"""An openai-agents agent loop through the gateway: an Agent with one function tool on
OpenAIResponsesModel, whose AsyncOpenAI client points at a gateway running under uvicorn (real
Redis, real PostgreSQL, the mock upstream). Every Responses call the run makes is one ledger row
equal to the mock's bill of that call (helpers of test_e2e_responses.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

from gateway.mock_upstream import MockUpstream
from quotas.engine import QuotaEngine
from tests.gateway.conftest import GatewayServer, MakeTenant, start_gateway
from tests.gateway.test_e2e_responses import (
    Bill,
    Meter,
    Model,
    assert_nothing_pending,
    assert_row_is_the_bill,
    drop_models,
    ledger_rows,
    priced_models,
)

agents = pytest.importorskip("agents")

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module", autouse=True)
def no_tracing_export() -> Iterator[None]:
    # The SDK would otherwise try to send its traces to OpenAI.
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


@pytest.fixture(scope="module")
def models(django_db_setup: None, django_db_blocker: Any) -> Iterator[dict[str, Model]]:
    made = priced_models(django_db_blocker, "sa", {"run": "", "streamed": "",
                                                   "reasoning": "@reasoning_tokens=4"},
                         tokenizer="o200k_base")
    yield made
    drop_models(django_db_blocker, made)


@pytest.fixture(scope="module")
def server(models: dict[str, Model], provider_key: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    gateway = start_gateway(tmp_path_factory.mktemp("gateway-agents"), workers=2)
    yield gateway
    gateway.stop()


class CallLog:
    """Each gateway call of the agent as it is answered: its request id and status, and (for a
    non-streaming call, billed by the mock before it answers) the mock's bill of that call."""

    def __init__(self, meter: Meter, bill_each: bool) -> None:
        self.meter, self.bill_each = meter, bill_each
        self.calls: list[tuple[str, int, Bill | None]] = []

    async def _record(self, response: httpx2.Response) -> None:
        bill = self.meter.take() if self.bill_each else None
        self.calls.append((response.headers.get("x-request-id", ""), response.status_code, bill))

    def client(self, server: GatewayServer, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=server.base_url, api_key=key, max_retries=0, timeout=30,
            http_client=httpx2.AsyncClient(event_hooks={"response": [self._record]}))


def weather_agent(model: Model, client: openai.AsyncOpenAI, cities: list[str]) -> Any:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    return agents.Agent(
        name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model.name, openai_client=client))


@pytest.mark.parametrize("label", ["run", "reasoning"])
def test_an_agent_run_with_a_tool_is_metered_call_by_call(
    label: str, server: GatewayServer, make_tenant: MakeTenant, models: dict[str, Model],
    mock_upstream: MockUpstream, engine: QuotaEngine, django_db_blocker: Any
) -> None:
    t = make_tenant(requests_per_second=-1)
    model = models[label]
    log = CallLog(Meter(mock_upstream, model.name), bill_each=True)
    cities: list[str] = []
    result = asyncio.run(agents.Runner.run(
        weather_agent(model, log.client(server, t.plaintext), cities), QUESTION))

    assert cities == ["Paris"]  # the model asked for the tool, the SDK ran it
    assert result.final_output  # and the turn after the tool's output answered in text
    # Two model calls: the tool call, then the answer to the tool's output.
    assert [status for _, status, _ in log.calls] == [200, 200]
    assert len(result.raw_responses) == 2
    rows = ledger_rows(django_db_blocker, engine, t, 2)
    for (request_id, _, bill), answer in zip(log.calls, result.raw_responses, strict=True):
        assert bill is not None
        row = rows[request_id]
        assert_row_is_the_bill(row, bill, model.price)
        assert (row.input_tokens, row.output_tokens) == (answer.usage.input_tokens,
                                                         answer.usage.output_tokens)
        assert row.reasoning_tokens == answer.usage.output_tokens_details.reasoning_tokens
        assert row.reasoning_tokens == (4 if label == "reasoning" else 0)
    assert_nothing_pending(engine, t, result.context_wrapper.usage.total_tokens)


def test_a_streamed_agent_run_is_metered_call_by_call(
    server: GatewayServer, make_tenant: MakeTenant, models: dict[str, Model],
    mock_upstream: MockUpstream, engine: QuotaEngine, django_db_blocker: Any
) -> None:
    t = make_tenant(requests_per_second=-1)
    model = models["streamed"]
    meter = Meter(mock_upstream, model.name)
    # A stream is billed as it ends, after its headers: the calls' bill is taken for the run.
    log = CallLog(meter, bill_each=False)
    cities: list[str] = []

    async def run() -> Any:
        streamed = agents.Runner.run_streamed(
            weather_agent(model, log.client(server, t.plaintext), cities), QUESTION)
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds
        return streamed

    result = asyncio.run(run())
    bill = meter.take()
    assert cities == ["Paris"] and result.final_output
    assert len(log.calls) == 2 == len(result.raw_responses) == bill.requests
    rows = ledger_rows(django_db_blocker, engine, t, 2)
    for (request_id, status, _), answer in zip(log.calls, result.raw_responses, strict=True):
        row = rows[request_id]
        assert status == 200 and row.streamed and row.status == "settled"
        assert (row.input_tokens, row.output_tokens) == (answer.usage.input_tokens,
                                                         answer.usage.output_tokens)
        assert row.over_hold_tokens == 0
        assert row.cost_micros == model.price.cost_of(
            Bill(row.input_tokens, row.output_tokens, requests=1).usage())
    # The two rows together are the mock's bill of the run.
    assert (sum(r.input_tokens for r in rows.values()),
            sum(r.output_tokens for r in rows.values())) == (bill.input, bill.output)
    assert_nothing_pending(engine, t, bill.input + bill.output)
