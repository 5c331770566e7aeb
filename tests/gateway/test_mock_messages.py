"""The mock upstream's Anthropic Messages API, served for real by uvicorn in a subprocess and
driven by the anthropic SDK."""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.mock_upstream import MockUpstream, api_key_id, start_subprocess
from gateway.mock_upstream.app import WORD_CYCLE

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather", "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_WORDS = len(json.dumps([WEATHER_TOOL]).split())


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    server = start_subprocess()
    yield server
    server.stop()


def _key() -> str:
    return f"sk-ant-{uuid.uuid4().hex}"


def _client(mock: MockUpstream, key: str) -> anthropic.Anthropic:
    # The SDK appends /v1/messages itself.
    return anthropic.Anthropic(base_url=mock.url, api_key=key, max_retries=0, timeout=10)


def expected_text(n: int) -> str:
    return " ".join(WORD_CYCLE[i % len(WORD_CYCLE)] for i in range(n))


def bill_row(mock: MockUpstream, key: str, model: str) -> dict[str, Any]:
    rows = httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]
    found = [row for row in rows if row["api_key_id"] == api_key_id(key) and row["model"] == model]
    assert len(found) == 1, rows
    return found[0]


def _hi(model: str = "claude-sonnet-4-5", **kwargs: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": "hi there"}]} | kwargs


def test_create_counts_words_and_bills(mock: MockUpstream) -> None:
    key = _key()
    message = _client(mock, key).messages.create(
        model="claude-sonnet-4-5", max_tokens=100, system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]},
                  {"role": "user", "content": [{"type": "text", "text": "one two three"}]}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "claude-sonnet-4-5"
    assert message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected_text(16)  # type: ignore[union-attr]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (8, 16)
    assert (message.usage.cache_read_input_tokens, message.usage.cache_creation_input_tokens) == (0, 0)
    row = bill_row(mock, key, "claude-sonnet-4-5")
    assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (8, 16, 1)


def test_max_tokens_stops_the_answer(mock: MockUpstream) -> None:
    message = _client(mock, _key()).messages.create(**_hi(max_tokens=5))
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.content[0].text == expected_text(5)  # type: ignore[union-attr]


def test_cache_faults_split_input_exclusive_like_anthropic(mock: MockUpstream) -> None:
    key = _key()
    content = "w " * 30
    message = _client(mock, key).messages.create(
        model="claude-haiku-4-5@cache_read_tokens=20@cache_write_tokens=6", max_tokens=50,
        messages=[{"role": "user", "content": content}])
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (4, 20, 6)
    count = _client(mock, key).messages.count_tokens(
        model="claude-haiku-4-5", messages=[{"role": "user", "content": content}])
    assert count.input_tokens == 30
    row = bill_row(mock, key, "claude-haiku-4-5")
    # The bill's input is ALL input; count_tokens is not billed.
    assert (row["prompt_tokens"], row["input_cached_tokens"], row["input_cache_write_tokens"]) == (30, 20, 6)
    assert row["requests"] == 1


def test_thinking_block_counts_as_output(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    message = client.messages.create(
        model="claude-opus-4-1@reasoning_tokens=6@output_tokens=4", max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "think"}])
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == expected_text(6)  # type: ignore[union-attr]
    assert message.content[0].signature  # type: ignore[union-attr]
    assert message.usage.output_tokens == 10
    assert message.usage.output_tokens_details is not None
    assert message.usage.output_tokens_details.thinking_tokens == 6
    # Without thinking enabled the reasoning fault is ignored.
    plain = client.messages.create(model="claude-opus-4-1@reasoning_tokens=6@output_tokens=4", max_tokens=50,
                                   messages=[{"role": "user", "content": "think"}])
    assert [block.type for block in plain.content] == ["text"] and plain.usage.output_tokens == 4
    row = bill_row(mock, key, "claude-opus-4-1")
    assert (row["completion_tokens"], row["output_reasoning_tokens"]) == (14, 6)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**_hi(max_tokens=1000, thinking={"type": "enabled", "budget_tokens": 1000}))
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**_hi(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 512}))


def test_streaming_events_and_helpers(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    events = list(client.messages.create(**_hi("claude-sonnet-4-5@output_tokens=3"), stream=True))
    assert [event.type for event in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start: Any = events[0]
    assert start.message.usage.input_tokens == 2 and start.message.usage.output_tokens == 1
    delta: Any = events[-2]
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == 3
    assert delta.usage.output_tokens_details.thinking_tokens == 0
    raw = httpx.post(f"{mock.url}/v1/messages", json=_hi(stream=True), timeout=5,
                     headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert "event: ping\n" in raw.text and raw.text.startswith("event: message_start\n")
    with client.messages.stream(**_hi("claude-sonnet-4-5@reasoning_tokens=3", max_tokens=2000,
                                      thinking={"type": "enabled", "budget_tokens": 1024})) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected_text(16)
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == expected_text(3)  # type: ignore[union-attr]
    assert final.usage.output_tokens == 19 and final.stop_reason == "end_turn"
    assert final.usage.output_tokens_details is not None
    assert final.usage.output_tokens_details.thinking_tokens == 3
    row = bill_row(mock, key, "claude-sonnet-4-5")
    assert (row["prompt_tokens"], row["completion_tokens"], row["output_reasoning_tokens"]) == (6, 3 + 16 + 19, 3)


def test_tool_use_then_text_after_the_result(mock: MockUpstream) -> None:
    client = _client(mock, _key())
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                   messages=[question])
    assert first.stop_reason == "tool_use"
    tool_use: Any = first.content[-1]
    assert tool_use.type == "tool_use" and tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    assert first.usage.input_tokens == 6 + TOOL_WORDS and first.usage.output_tokens == 3
    second = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, tools=[WEATHER_TOOL],  # type: ignore[list-item]
        messages=[question, {"role": "assistant", "content": [tool_use.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                "content": "sunny 21C"}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == expected_text(16)  # type: ignore[union-attr]
    assert second.usage.input_tokens == 6 + len(json.dumps({"city": "Paris"}).split()) + 2 + TOOL_WORDS
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=100, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                messages=[question]) as stream:
        final = stream.get_final_message()
    streamed: Any = final.content[-1]
    assert streamed.type == "tool_use" and streamed.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 3
    none = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                  tool_choice={"type": "none"}, messages=[question])
    assert none.stop_reason == "end_turn"


@pytest.mark.parametrize(("status", "error_class", "error_type"), [
    (400, anthropic.BadRequestError, "invalid_request_error"),
    (401, anthropic.AuthenticationError, "authentication_error"),
    (403, anthropic.PermissionDeniedError, "permission_error"),
    (404, anthropic.NotFoundError, "not_found_error"),
    (429, anthropic.RateLimitError, "rate_limit_error"),
    (500, anthropic.InternalServerError, "api_error"),
    (529, anthropic.OverloadedError, "overloaded_error"),
])
def test_injected_status_maps_to_the_sdk_error(mock: MockUpstream, status: int,
                                               error_class: type[anthropic.APIStatusError],
                                               error_type: str) -> None:
    client = _client(mock, _key())
    for stream in (False, True):
        with pytest.raises(error_class) as raised:
            client.messages.create(**_hi(f"claude-sonnet-4-5@status={status}@retry_after=2"), stream=stream)
        assert raised.value.status_code == status
        body: Any = raised.value.body
        assert body["type"] == "error" and body["error"]["type"] == error_type
        assert body["request_id"].startswith("req_")
        assert raised.value.response.headers["retry-after"] == "2"


def test_auth_version_and_validation_errors(mock: MockUpstream) -> None:
    url = f"{mock.url}/v1/messages"
    no_key = httpx.post(url, json=_hi(), headers={"anthropic-version": "2023-06-01"}, timeout=5)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    no_version = httpx.post(url, json=_hi(), headers={"x-api-key": "sk-secret-x"}, timeout=5)
    assert no_version.status_code == 400
    assert no_version.json()["error"] == {"type": "invalid_request_error",
                                          "message": "anthropic-version: header is required"}
    assert "sk-secret-x" not in no_version.text
    client = _client(mock, _key())
    for bad in ({"max_tokens": 0}, {"max_tokens": None}, {"messages": []},
                {"messages": [{"role": "system", "content": "x"}]}, {"system": 5},
                {"thinking": {"type": "sometimes"}}, {"tools": [{"description": "no name"}]},
                {"model": "claude@status=abc"}):
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(**(_hi() | bad))
        assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_cut_stream_bills_what_was_sent(mock: MockUpstream) -> None:
    key = _key()
    received: list[str] = []
    with pytest.raises(Exception) as caught:
        for event in _client(mock, key).messages.create(**_hi("claude-sonnet-4-5@cut=4"), stream=True):
            received.append(event.type)
    # The anthropic SDK lets the transport's complaint about the unterminated body through.
    assert "RemoteProtocolError" in {type(caught.value).__name__, type(caught.value.__cause__).__name__}
    assert received.count("content_block_delta") == 4 and "message_stop" not in received
    row = bill_row(mock, key, "claude-sonnet-4-5")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2, 4)
    with pytest.raises(anthropic.APIConnectionError):
        _client(mock, _key()).messages.create(**_hi("claude-sonnet-4-5@cut=1"))


def test_other_faults_apply(mock: MockUpstream) -> None:
    key = _key()
    client = _client(mock, key)
    with pytest.raises(anthropic.APIConnectionError):
        client.messages.create(**_hi("claude-sonnet-4-5@reset"))
    with pytest.raises(anthropic.APITimeoutError):
        client.with_options(timeout=0.3).messages.create(**_hi("claude-sonnet-4-5@hang"))
    httpx.post(f"{mock.url}/mock/faults", json={"key": key, "faults": {"status": 529}}, timeout=5)
    with pytest.raises(anthropic.OverloadedError):
        client.messages.create(**_hi())
    with pytest.raises(anthropic.OverloadedError):
        client.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "x"}])
    httpx.post(f"{mock.url}/mock/faults", json={"key": key, "faults": {}}, timeout=5)
    slow = client.messages.create(**_hi("claude-sonnet-4-5@first_byte_ms=50@output_tokens=2"))
    assert slow.usage.output_tokens == 2
