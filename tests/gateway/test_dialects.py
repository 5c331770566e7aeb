"""The dialects (gateway/dialects.py): what each API's answers and streams say about usage, what
text is output, what goes upstream; and the Anthropic shapes of errors and rate headers."""
from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.bodies import Endpoint, parse_body
from gateway.dialects import (
    DEFAULT_ANTHROPIC_VERSION,
    MessagesStreamReader,
    OpenAIStreamReader,
    ResponsesStreamReader,
    dialect_for,
    messages_usage,
    openai_usage,
    provider_kind,
    responses_usage,
)
from gateway.errors import Api, GatewayError, bad_request, quota_store_unavailable
from gateway.prices import Price
from gateway.usage import Usage


def _sse(kind: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {kind}\n".encode() if kind else b""
    return head + b"data: " + json.dumps(data).encode()


# -- usage by token class ------------------------------------------------------------------------


def test_openai_usage_reads_cached_and_reasoning_classes() -> None:
    usage = openai_usage({"prompt_tokens": 100, "completion_tokens": 40,
                          "prompt_tokens_details": {"cached_tokens": 60},
                          "completion_tokens_details": {"reasoning_tokens": 25}})
    assert usage == Usage(100, 40, cached_input_tokens=60, reasoning_tokens=25)
    assert usage.total == 140


@pytest.mark.parametrize("usage", [None, {}, {"prompt_tokens": -1, "completion_tokens": 2},
                                   {"prompt_tokens": "3"}, {"prompt_tokens": True}])
def test_openai_usage_refuses_nonsense(usage: Any) -> None:
    assert openai_usage(usage) is None


def test_openai_usage_clamps_classes_into_their_totals() -> None:
    usage = openai_usage({"prompt_tokens": 10, "completion_tokens": 4,
                          "prompt_tokens_details": {"cached_tokens": 99},
                          "completion_tokens_details": {"reasoning_tokens": 50}})
    assert usage == Usage(10, 4, cached_input_tokens=10, reasoning_tokens=4)


def test_responses_usage() -> None:
    usage = responses_usage({"input_tokens": 328, "input_tokens_details": {"cached_tokens": 128},
                             "output_tokens": 52,
                             "output_tokens_details": {"reasoning_tokens": 20},
                             "total_tokens": 380})
    assert usage == Usage(328, 52, cached_input_tokens=128, reasoning_tokens=20)


def test_messages_usage_adds_cache_reads_and_writes_to_the_input() -> None:
    # Anthropic's input_tokens exclude cache reads and writes: the bill counts all three.
    usage = messages_usage({"input_tokens": 50, "cache_read_input_tokens": 1000,
                            "cache_creation_input_tokens": 200, "output_tokens": 30})
    assert usage == Usage(1250, 30, cached_input_tokens=1000, cache_write_tokens=200)


def test_class_prices_charge_each_class() -> None:
    # Claude-like: input 3 $/M, output 15 $/M, cache read 0.30 $/M, cache write 3.75 $/M.
    price = Price(3_000_000, 15_000_000, cached_input_micros_per_mtok=300_000,
                  cache_write_micros_per_mtok=3_750_000)
    usage = Usage(1250, 30, cached_input_tokens=1000, cache_write_tokens=200)
    # 50 * 3 + 1000 * 0.3 + 200 * 3.75 + 30 * 15 = 150 + 300 + 750 + 450 = 1650 micro-dollars
    assert price.cost_of(usage) == 1650
    # The hold's money bound is at the dearest class.
    assert price.bound(1000) == 15_000


# -- streams -------------------------------------------------------------------------------------


def test_responses_stream_reader_takes_usage_and_id_from_the_terminal_event() -> None:
    reader = ResponsesStreamReader()
    created = _sse("response.created", {"type": "response.created",
                                        "response": {"id": "resp_1", "usage": None}})
    delta = _sse("response.output_text.delta", {"type": "response.output_text.delta",
                                                "delta": "Hello there"})
    done = _sse("response.completed", {"type": "response.completed", "response": {
        "id": "resp_1", "usage": {"input_tokens": 12, "output_tokens": 2,
                                  "output_tokens_details": {"reasoning_tokens": 0}}}})
    assert reader.inspect(created) == created
    assert reader.inspect(delta) == delta
    assert reader.usage is None and reader.response_id == "resp_1"
    assert reader.inspect(done) == done
    assert reader.usage == Usage(12, 2)
    assert reader.text_events == [delta]
    assert reader.event_text(json.loads(delta.split(b"data: ")[1])) == "Hello there"


@pytest.mark.parametrize("kind", ["response.incomplete", "response.failed"])
def test_responses_stream_reader_other_terminal_events(kind: str) -> None:
    reader = ResponsesStreamReader()
    reader.inspect(_sse(kind, {"type": kind, "response": {
        "id": "resp_2", "usage": {"input_tokens": 5, "output_tokens": 7}}}))
    assert reader.usage == Usage(5, 7)


def test_responses_stream_text_counts_tool_arguments_and_names() -> None:
    reader = ResponsesStreamReader()
    added = {"type": "response.output_item.added",
             "item": {"type": "function_call", "name": "get_weather"}}
    args = {"type": "response.function_call_arguments.delta", "delta": '{"city":"Paris"}'}
    assert reader.event_text(added) == "get_weather"
    assert reader.event_text(args) == '{"city":"Paris"}'
    assert reader.event_text({"type": "response.in_progress"}) == ""


def test_messages_stream_reader_cut_before_message_delta_keeps_the_input_side() -> None:
    reader = MessagesStreamReader()
    reader.inspect(_sse("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "usage": {"input_tokens": 40, "cache_read_input_tokens": 100,
                                 "cache_creation_input_tokens": 10, "output_tokens": 1}}}))
    # Nothing relayed yet: message_start's output_tokens (1) is a placeholder, not produced.
    assert reader.known(prompt_estimate=999, counted_output=0, worst_output=50) == Usage(
        150, 0, cached_input_tokens=100, cache_write_tokens=10)
    delta = _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": "Hi"}})
    reader.inspect(delta)
    assert reader.usage is None
    # Cut: the input side is the upstream's (exact), the output at least what was relayed.
    assert reader.known(prompt_estimate=999, counted_output=3, worst_output=50) == Usage(
        150, 3, cached_input_tokens=100, cache_write_tokens=10)
    assert reader.response_id == "msg_1"


def test_messages_stream_reader_final_usage_from_message_delta() -> None:
    reader = MessagesStreamReader()
    reader.inspect(_sse("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "usage": {"input_tokens": 40, "output_tokens": 1}}}))
    reader.inspect(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": "end_turn"},
                                          "usage": {"output_tokens": 17}}))
    assert reader.usage == Usage(40, 17)
    thinking = {"type": "content_block_delta", "delta": {"type": "thinking_delta",
                                                         "thinking": "hmm"}}
    tool = {"type": "content_block_delta", "delta": {"type": "input_json_delta",
                                                     "partial_json": '{"a":'}}
    assert reader.event_text(thinking) == "hmm"
    assert reader.event_text(tool) == '{"a":'


def test_openai_stream_reader_drops_the_usage_chunk_the_client_did_not_ask_for() -> None:
    reader = OpenAIStreamReader(Endpoint.CHAT, include_usage=False)
    usage_chunk = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    assert reader.inspect(usage_chunk) is None
    assert reader.usage == Usage(3, 2)


# -- what goes upstream --------------------------------------------------------------------------


def test_responses_payload_imposes_max_output_tokens() -> None:
    parsed = parse_body(Endpoint.RESPONSES, json.dumps(
        {"model": "gpt-4o", "input": "hi", "max_output_tokens": 500}).encode())
    body = json.loads(dialect_for(Endpoint.RESPONSES).payload(parsed, "gpt-4o", 120))
    assert body["max_output_tokens"] == 120 and "stream_options" not in body


def test_messages_payload_shrinks_the_thinking_budget_below_the_cap() -> None:
    parsed = parse_body(Endpoint.MESSAGES, json.dumps({
        "model": "claude-sonnet-4-5", "max_tokens": 4000,
        "thinking": {"type": "enabled", "budget_tokens": 3000},
        "messages": [{"role": "user", "content": "hi"}]}).encode())
    dialect = dialect_for(Endpoint.MESSAGES)
    body = json.loads(dialect.payload(parsed, "claude-sonnet-4-5", 2000))
    assert body["max_tokens"] == 2000 and body["thinking"]["budget_tokens"] == 1999
    untouched = json.loads(dialect.payload(parsed, "claude-sonnet-4-5", None))
    assert untouched["max_tokens"] == 4000 and untouched["thinking"]["budget_tokens"] == 3000


def test_messages_upstream_headers() -> None:
    dialect = dialect_for(Endpoint.MESSAGES)
    assert dialect.upstream_headers("sk-ant", {}) == {
        "x-api-key": "sk-ant", "anthropic-version": DEFAULT_ANTHROPIC_VERSION}
    headers = dialect.upstream_headers("sk-ant", {"anthropic-version": "2023-01-01",
                                                  "anthropic-beta": "prompt-caching-2024-07-31"})
    assert headers["anthropic-version"] == "2023-01-01"
    assert headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert dialect_for(Endpoint.RESPONSES).upstream_headers("sk", {}) == {
        "Authorization": "Bearer sk"}


def test_provider_kinds() -> None:
    assert provider_kind(Endpoint.MESSAGES) == "anthropic"
    assert {provider_kind(e) for e in Endpoint if e is not Endpoint.MESSAGES} == {"openai"}


# -- Anthropic's error shape ---------------------------------------------------------------------


@pytest.mark.parametrize(("error", "status", "kind"), [
    (bad_request("bad", "max_tokens"), 400, "invalid_request_error"),
    (GatewayError(401, "no key", "invalid_request_error", "invalid_api_key"), 401,
     "authentication_error"),
    (GatewayError(403, "no", "invalid_request_error", "model_not_allowed"), 403,
     "permission_error"),
    (GatewayError(404, "none", "invalid_request_error", "not_found"), 404, "not_found_error"),
    (GatewayError(429, "slow", "requests", "rate_limit_exceeded", None, 3), 429,
     "rate_limit_error"),
    (GatewayError(502, "up", "server_error", "upstream_error"), 502, "api_error"),
    (quota_store_unavailable(), 529, "overloaded_error"),
    (GatewayError(504, "late", "server_error", "upstream_error"), 504, "timeout_error"),
])
def test_anthropic_error_shape(error: GatewayError, status: int, kind: str) -> None:
    response = error.response(api=Api.ANTHROPIC, request_id="req_1")
    assert response.status_code == status
    assert json.loads(response.content) == {
        "type": "error", "error": {"type": kind, "message": error.message},
        "request_id": "req_1"}
    if error.retry_after_s is not None:
        assert response["Retry-After"] == str(error.retry_after_s)


def test_messages_usage_reads_the_thinking_share_of_the_output() -> None:
    usage = messages_usage({"input_tokens": 10, "output_tokens": 46,
                            "output_tokens_details": {"thinking_tokens": 30}})
    assert usage == Usage(10, 46, reasoning_tokens=30)
    reader = MessagesStreamReader()
    reader.inspect(_sse("message_start", {"type": "message_start", "message": {
        "id": "msg_2", "usage": {"input_tokens": 10, "output_tokens": 1}}}))
    reader.inspect(_sse("message_delta", {"type": "message_delta", "usage": {
        "output_tokens": 46, "output_tokens_details": {"thinking_tokens": 30}}}))
    assert reader.usage == Usage(10, 46, reasoning_tokens=30)


def test_a_cut_responses_stream_that_reasoned_is_charged_its_cap() -> None:
    # The reasoning tokens are told only by the terminal event: a stream cut before it, whose
    # model reasoned, is charged the most the upstream could produce (its max_output_tokens).
    reader = ResponsesStreamReader()
    reader.inspect(_sse("response.output_item.added", {
        "type": "response.output_item.added", "item": {"type": "reasoning", "summary": []}}))
    assert reader.known(prompt_estimate=20, counted_output=3, worst_output=200) == Usage(
        20, 200, reasoning_tokens=197)
    plain = ResponsesStreamReader()
    assert plain.known(prompt_estimate=20, counted_output=3, worst_output=200) == Usage(20, 3)


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 3, "completion_tokens": True},
    {"prompt_tokens": 3, "completion_tokens": -2}])
def test_boolean_or_negative_counts_are_nonsense(usage: dict[str, Any]) -> None:
    assert openai_usage(usage) is None
    assert responses_usage({"input_tokens": 3, "output_tokens": usage["completion_tokens"]}) \
        is None
    assert messages_usage({"input_tokens": 3, "output_tokens": usage["completion_tokens"]}) \
        is None


def test_a_message_delta_without_cache_fields_keeps_message_starts() -> None:
    reader = MessagesStreamReader()
    reader.inspect(_sse("message_start", {"type": "message_start", "message": {
        "id": "msg_3", "usage": {"input_tokens": 40, "cache_read_input_tokens": 100,
                                 "output_tokens": 1}}}))
    reader.inspect(_sse("message_delta", {"type": "message_delta", "usage": {
        "input_tokens": 40, "output_tokens": 9}}))
    assert reader.usage == Usage(140, 9, cached_input_tokens=100)
