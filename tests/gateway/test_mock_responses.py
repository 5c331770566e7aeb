"""The mock upstream's OpenAI Responses API and moderations, served for real by uvicorn in a
subprocess and driven by the openai SDK and the openai-agents SDK."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from gateway.mock_upstream import MockUpstream, api_key_id, start_subprocess
from gateway.mock_upstream.app import WORD_CYCLE

WEATHER_TOOL: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    server = start_subprocess()
    yield server
    server.stop()


def _key() -> str:
    # A fresh key per test keeps each test's bill rows and stored responses apart.
    return f"sk-resp-{uuid.uuid4().hex}"


def _client(mock: MockUpstream, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=mock.base_url, api_key=key, max_retries=0, timeout=10)


def expected_text(n: int) -> str:
    return " ".join(WORD_CYCLE[i % len(WORD_CYCLE)] for i in range(n))


def bill_row(mock: MockUpstream, key: str, model: str) -> dict[str, Any]:
    rows = httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]
    found = [row for row in rows if row["api_key_id"] == api_key_id(key) and row["model"] == model]
    assert len(found) == 1, rows
    return found[0]


def test_create_plain_counts_words_and_bills(mock: MockUpstream) -> None:
    key = _key()
    response = _client(mock, key).responses.create(
        model="gpt-4.1", instructions="be brief please", input="hello there  friend")
    assert isinstance(response, Response)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == "gpt-4.1"
    assert response.output_text == expected_text(16)
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (6, 16, 22)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    row = bill_row(mock, key, "gpt-4.1")
    assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (6, 16, 1)
    assert (row["input_cached_tokens"], row["input_cache_write_tokens"], row["output_reasoning_tokens"]) == (0, 0, 0)


def test_item_input_counts_every_text_and_tools(mock: MockUpstream) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "answer in French"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "three", "annotations": []},
            {"type": "refusal", "refusal": "four five"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "six"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "seven eight"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "nine ten"}]},
    ]
    response = _client(mock, _key()).responses.create(model="gpt-4o", input=items, tools=[WEATHER_TOOL])  # type: ignore[list-item]
    words = 3 + 2 + 1 + 2 + (1 + 2) + 2 + 2
    assert response.usage is not None
    assert response.usage.input_tokens == words + len(json.dumps([WEATHER_TOOL]).split())


def test_max_output_tokens_makes_it_incomplete(mock: MockUpstream) -> None:
    response = _client(mock, _key()).responses.create(model="gpt-4o", input="hi", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == expected_text(5)
    assert response.usage is not None and response.usage.output_tokens == 5


def test_reasoning_and_cached_faults_within_their_totals(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    response = client.responses.create(
        model="o4-mini@reasoning_tokens=7@cached_tokens=2@output_tokens=10", input="a b c d")
    assert response.model == "o4-mini"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == expected_text(10)
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (4, 2)
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (17, 7)
    # The cap eats the visible answer first, then the reasoning.
    capped = client.responses.create(model="o4-mini@reasoning_tokens=7@cached_tokens=99",
                                     input="a b c d", max_output_tokens=9)
    assert capped.status == "incomplete"
    assert capped.usage is not None
    assert (capped.usage.output_tokens, capped.usage.output_tokens_details.reasoning_tokens) == (9, 7)
    assert capped.usage.input_tokens_details.cached_tokens == 4
    assert capped.output_text == expected_text(2)
    row = bill_row(mock, key, "o4-mini")
    assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (8, 26, 2)
    assert (row["input_cached_tokens"], row["output_reasoning_tokens"]) == (6, 14)


def test_cache_write_fault_does_not_apply_to_responses(mock: MockUpstream) -> None:
    """The Responses API has no cache-write figure (OpenAI reports none): the fault that makes
    Messages answers carry cache writes neither shows in the usage nor reaches the bill, streamed
    or not; cache reads still do."""
    key = _key()
    client = _client(mock, key)
    model = "gpt-4.1@cache_write_tokens=2@cached_tokens=1"
    response = client.responses.create(model=model, input="a b c d")
    assert response.usage is not None
    # exclude_none: the SDK's model declares fields (cache_write_tokens among them) the answer
    # did not carry.
    assert response.usage.input_tokens_details.model_dump(exclude_none=True) == {
        "cached_tokens": 1}
    streamed = httpx.post(f"{mock.base_url}/responses", timeout=5,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "input": "a b c d", "stream": True})
    completed = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                 if line.startswith("data: ") and '"response.completed"' in line]
    assert len(completed) == 1
    assert completed[0]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    row = bill_row(mock, key, "gpt-4.1")
    assert (row["prompt_tokens"], row["requests"]) == (8, 2)
    assert (row["input_cached_tokens"], row["input_cache_write_tokens"]) == (2, 0)


def test_stream_event_sequence_and_final_response(mock: MockUpstream) -> None:
    key = _key()
    events = list(_client(mock, key).responses.create(model="gpt-4o@output_tokens=3", input="hi there",
                                                      stream=True))
    types = [event.type for event in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected_text(3)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (2, 3)
    assert final.output_text == expected_text(3)
    row = bill_row(mock, key, "gpt-4o")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2, 3)


def test_stream_helper_and_incomplete_event(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    with client.responses.stream(model="gpt-4o", input="hi", max_output_tokens=40) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == expected_text(16)
    assert final.status == "completed" and final.output_text == expected_text(16)
    # Capped, it ends like OpenAI's: response.incomplete (which the SDK's stream helper does not
    # accept as an end, so this reads the raw events).
    events = list(client.responses.create(model="gpt-4o", input="hi", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete"
    last: Any = events[-1]
    assert last.response.status == "incomplete" and last.response.output_text == expected_text(4)


def test_stream_with_reasoning_and_cut_bills_what_was_sent(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    received: list[str] = []
    with pytest.raises(openai.APIError):
        for event in client.responses.create(model="gpt-4o@reasoning_tokens=5@cut=3", input="hi",
                                             stream=True):
            received.append(event.type)
    # The reasoning item (5 tokens) then two words went out before the cut.
    assert received.count("response.output_text.delta") == 2
    assert "response.completed" not in received
    row = bill_row(mock, key, "gpt-4o")
    assert (row["completion_tokens"], row["output_reasoning_tokens"]) == (7, 5)


def test_tool_call_then_answer_after_function_output(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    first = client.responses.create(model="gpt-4o", input="What is the weather in Paris?",
                                    tools=[WEATHER_TOOL])  # type: ignore[list-item]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert first.usage is not None and first.usage.output_tokens == 3
    second = client.responses.create(
        model="gpt-4o", previous_response_id=first.id, tools=[WEATHER_TOOL],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny 21C"}])
    assert second.output_text == expected_text(16)
    tool_words = len(json.dumps([WEATHER_TOOL]).split())
    assert second.usage is not None
    assert second.usage.input_tokens == first.usage.input_tokens + 3 + 2 + tool_words
    # Streamed: the arguments arrive as deltas.
    events = list(client.responses.create(model="gpt-4o", input="weather?", tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    assert events[-1].type == "response.completed"


def test_previous_response_chain_carries_context(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    turn1 = client.responses.create(model="gpt-4o", input="one two three")
    turn2 = client.responses.create(model="gpt-4o", input="four", previous_response_id=turn1.id)
    assert turn1.usage is not None and turn2.usage is not None
    assert turn2.usage.input_tokens == 3 + 16 + 1
    assert turn2.previous_response_id == turn1.id
    turn3 = client.responses.create(model="gpt-4o", input="five six", previous_response_id=turn2.id)
    assert turn3.usage is not None and turn3.usage.input_tokens == 20 + 16 + 2
    with pytest.raises(openai.BadRequestError) as missing:
        client.responses.create(model="gpt-4o", input="x", previous_response_id="resp_nope")
    body: Any = missing.value.body
    assert body["param"] == "previous_response_id" and body["code"] == "previous_response_not_found"
    # store: false keeps nothing to continue from.
    unstored = client.responses.create(model="gpt-4o", input="x", store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-4o", input="y", previous_response_id=unstored.id)


def test_conversation_accumulates_context(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    conversation = f"conv_{uuid.uuid4().hex}"
    first = client.responses.create(model="gpt-4o", input="a b", conversation=conversation)
    second = client.responses.create(model="gpt-4o", input="c", conversation={"id": conversation})
    assert first.usage is not None and first.usage.input_tokens == 2
    assert second.usage is not None and second.usage.input_tokens == 2 + 16 + 1


def test_conversations_api_carries_its_items_into_turns(mock: MockUpstream) -> None:
    key, other = _key(), _key()
    client = _client(mock, key)
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "we plan a trip to Rome"}],
        metadata={"topic": "travel"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "travel"}
    turn = client.responses.create(model="gpt-4o", input="what to see", conversation=conversation.id)
    assert turn.usage is not None and turn.usage.input_tokens == 6 + 3
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "travel"}
    updated = client.conversations.update(conversation.id, metadata={"topic": "food"})
    assert updated.metadata == {"topic": "food"}
    with pytest.raises(openai.NotFoundError):
        _client(mock, other).conversations.retrieve(conversation.id)
    # Another key's turn in the same id does not see this key's context.
    foreign = _client(mock, other).responses.create(model="gpt-4o", input="hi", conversation=conversation.id)
    assert foreign.usage is not None and foreign.usage.input_tokens == 1
    assert client.conversations.delete(conversation.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(items="not a list")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "items"  # type: ignore[index]


def test_stored_object_calls_count_for_the_key_and_get_its_faults(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    created = client.responses.create(model="gpt-4o", input="hi")
    client.responses.retrieve(created.id)
    client.responses.input_items.list(created.id)
    report = httpx.get(f"{mock.url}/mock/faults", timeout=5).json()
    assert report["requests"][api_key_id(key)] == 3
    httpx.post(f"{mock.url}/mock/faults", json={"key": key, "faults": {"status": 503}}, timeout=5)
    with pytest.raises(openai.InternalServerError):
        client.responses.retrieve(created.id)
    httpx.post(f"{mock.url}/mock/faults", json={"key": key, "faults": {}}, timeout=5)
    assert client.responses.retrieve(created.id).id == created.id


def test_retrieve_delete_input_items_and_per_key_isolation(mock: MockUpstream) -> None:
    key, other = _key(), _key()
    client = _client(mock, key)
    created = client.responses.create(model="gpt-4o", input=[
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}])
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    items = client.responses.input_items.list(created.id)
    assert [item.content[0].text for item in items.data] == ["second", "first"]  # type: ignore[union-attr]
    ascending = client.responses.input_items.list(created.id, order="asc")
    assert [item.content[0].text for item in ascending.data] == ["first", "second"]  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        _client(mock, other).responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        _client(mock, other).responses.delete(created.id)
    with pytest.raises(openai.BadRequestError) as not_background:
        client.responses.cancel(created.id)
    assert not_background.value.status_code == 400
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_background_response_completes_or_is_cancelled(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    queued = client.responses.create(model="gpt-4o", input="hi", background=True)
    assert queued.status == "queued" and queued.usage is None
    for _ in range(100):
        done = client.responses.retrieve(queued.id)
        if done.status == "completed":
            break
        asyncio.run(asyncio.sleep(0.02))
    assert done.status == "completed" and done.output_text == expected_text(16)
    slow = client.responses.create(model="gpt-4o", input="hi", background=True,
                                   extra_headers={"X-Mock-Chunk-Ms": "1000"})
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    row = bill_row(mock, key, "gpt-4o")
    assert (row["completion_tokens"], row["requests"]) == (16, 1)


def test_injected_faults_apply(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    with pytest.raises(openai.RateLimitError) as limited:
        client.responses.create(model="gpt-4o@status=429@retry_after=3", input="hi")
    assert limited.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="gpt-4o", input="hi", stream=True, extra_headers={"X-Mock-Status": "503"})
    with pytest.raises(openai.APIConnectionError):
        client.responses.create(model="gpt-4o@reset", input="hi")
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).responses.create(model="gpt-4o@hang", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-4o@reasoning_tokens=x", input="hi")


def test_per_key_fault_applies_to_responses(mock: MockUpstream) -> None:
    key = _key()
    httpx.post(f"{mock.url}/mock/faults", json={"key": key, "faults": {"status": 500}}, timeout=5)
    with pytest.raises(openai.InternalServerError):
        _client(mock, key).responses.create(model="gpt-4o", input="hi")
    assert _client(mock, _key()).responses.create(model="gpt-4o", input="hi").status == "completed"


def test_bad_input_is_a_clear_400(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    with pytest.raises(openai.BadRequestError) as no_input:
        client.responses.create(model="gpt-4o")  # type: ignore[call-overload]
    assert no_input.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-4o", input=[{"role": "robot", "content": "x"}])  # type: ignore[list-item]
    unauthenticated = httpx.post(f"{mock.base_url}/responses", json={"model": "gpt-4o", "input": "hi"},
                                 timeout=5)
    assert unauthenticated.status_code == 401 and "error" in unauthenticated.json()
    no_json = httpx.post(f"{mock.base_url}/responses", content=b"{", timeout=5,
                         headers={"Authorization": "Bearer sk-x"})
    assert no_json.status_code == 400 and no_json.json()["error"]["type"] == "invalid_request_error"


def test_moderations_are_not_billed(mock: MockUpstream) -> None:
    key = _key()
    result = _client(mock, key).moderations.create(input=["hello", "world"])
    assert result.model == "omni-moderation-latest"
    assert len(result.results) == 2 and not any(r.flagged for r in result.results)
    assert result.results[0].categories.violence is False
    rows = httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]
    assert not [row for row in rows if row["api_key_id"] == api_key_id(key)]


def test_chat_reports_cached_and_reasoning_faults_in_the_bill(mock: MockUpstream) -> None:
    key = _key()
    client = openai.OpenAI(base_url=mock.base_url, api_key=key, max_retries=0, timeout=10)
    reply = client.chat.completions.create(model="gpt-4o@cached_tokens=1@reasoning_tokens=4", max_tokens=10,
                                           messages=[{"role": "user", "content": "a b c"}])
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details and usage.completion_tokens_details
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (3, 1)
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (10, 4)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == expected_text(6)
    row = bill_row(mock, key, "gpt-4o")
    assert (row["prompt_tokens"], row["completion_tokens"], row["input_cached_tokens"],
            row["output_reasoning_tokens"]) == (3, 10, 1, 4)
    page = httpx.get(f"{mock.base_url}/organization/usage/completions",
                     params={"start_time": int(time.time()) - 60, "group_by": "api_key_id",
                             "api_key_ids": api_key_id(key)},
                     headers={"Authorization": "Bearer admin"}, timeout=5)
    assert page.status_code == 200
    results = [result for bucket in page.json()["data"] for result in bucket["results"]]
    assert len(results) == 1
    assert {name: results[0][name] for name in ("input_tokens", "output_tokens", "input_cached_tokens",
                                                 "input_cache_write_tokens", "output_reasoning_tokens",
                                                 "num_model_requests")} == {
        "input_tokens": 3, "output_tokens": 10, "input_cached_tokens": 1, "input_cache_write_tokens": 0,
        "output_reasoning_tokens": 4, "num_model_requests": 1}
    # Streamed with usage: the same classes in the usage chunk and in the bill.
    chunks = list(client.chat.completions.create(
        model="gpt-4o@cached_tokens=2@reasoning_tokens=3@output_tokens=2", stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "a b c"}]))
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.prompt_tokens_details and streamed.completion_tokens_details
    assert (streamed.completion_tokens, streamed.completion_tokens_details.reasoning_tokens) == (5, 3)
    assert streamed.prompt_tokens_details.cached_tokens == 2
    row = bill_row(mock, key, "gpt-4o")
    assert (row["prompt_tokens"], row["completion_tokens"], row["input_cached_tokens"],
            row["output_reasoning_tokens"], row["requests"]) == (6, 15, 3, 7, 2)


def test_agents_sdk_runs_a_function_tool(mock: MockUpstream) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    key = _key()
    client = openai.AsyncOpenAI(base_url=mock.base_url, api_key=key, max_retries=0, timeout=10)
    agent = agents.Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="gpt-4o", openai_client=client))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           run_config=agents.RunConfig(tracing_disabled=True)))
    assert calls == ["Paris"]
    assert result.final_output == expected_text(16)
    row = bill_row(mock, key, "gpt-4o")
    assert row["requests"] == 2
