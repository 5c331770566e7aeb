"""Parsing Responses API and Messages API bodies: the happy shapes parse into ParsedBody, every
refusal is a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.bodies import ABSURD_MAX_TOKENS, Endpoint, ParsedBody, parse_body
from gateway.errors import GatewayError


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def responses(**fields: Any) -> ParsedBody:
    return parse_body(Endpoint.RESPONSES, _raw({"model": "gpt-4o", **fields}))


def messages(**fields: Any) -> ParsedBody:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 1024,
            "messages": [{"role": "user", "content": "Hello there"}]}
    body.update(fields)
    return parse_body(Endpoint.MESSAGES, _raw({k: v for k, v in body.items() if v is not ...}))


def refused(parse: Any, **fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        parse(**fields)
    error = caught.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    return error


# --- Responses API: happy shapes -------------------------------------------------------------

RESPONSE_ITEMS: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer briefly."},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture and this file?"},
        {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"},
        {"type": "input_file", "file_url": "https://x.test/report.pdf"},
        {"type": "input_file", "filename": "a.txt", "file_data": "data:text/plain;base64,aGk="},
    ]},
    {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "A cat.", "annotations": []},
        {"type": "refusal", "refusal": "I cannot read that file."},
    ]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Think."}]},
    {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    {"role": "system", "content": "Be kind."},
]


def test_a_string_input_parses_with_the_defaults():
    parsed = responses(input="Tell me a joke")
    assert parsed.endpoint is Endpoint.RESPONSES
    assert parsed.model == "gpt-4o"
    assert (parsed.stream, parsed.include_usage, parsed.max_output, parsed.choices) == (
        False, False, None, 1)
    assert (parsed.context_ref, parsed.conversation, parsed.store, parsed.thinking_budget) == (
        None, None, True, None)


def test_every_item_shape_parses_and_the_body_is_kept_as_sent():
    tools = [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "custom", "name": "run_sql"},
        {"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
         "environment": "browser"},
        {"type": "mcp", "server_label": "x", "server_url": "https://mcp.test"},
        {"type": "local_shell"}, {"type": "apply_patch"},
    ]
    body = {"model": "gpt-4o", "input": RESPONSE_ITEMS, "instructions": "Be brief.",
            "tools": tools, "max_output_tokens": 500, "stream": True,
            "stream_options": {"include_obfuscation": False}, "store": False,
            "background": False, "temperature": 0.2}
    parsed = parse_body(Endpoint.RESPONSES, _raw(body))
    assert parsed.body == body
    assert (parsed.stream, parsed.include_usage, parsed.max_output, parsed.store) == (
        True, False, 500, False)


def test_previous_response_id_and_conversation_are_recorded():
    assert responses(input="and then?", previous_response_id="resp_abc-123").context_ref == (
        "resp_abc-123")
    assert responses(input="more", conversation="conv_1").conversation == "conv_1"
    assert responses(input="more", conversation={"id": "conv_2"}).conversation == "conv_2"


def test_a_continuation_needs_no_input():
    assert responses(previous_response_id="resp_1").context_ref == "resp_1"
    assert responses(conversation="conv_1").conversation == "conv_1"


def test_an_item_reference_is_accepted_only_in_a_continuation():
    reference = [{"type": "item_reference", "id": "msg_123"}]
    assert responses(input=reference, previous_response_id="resp_1").context_ref == "resp_1"
    assert responses(input=reference, conversation={"id": "conv_1"}).conversation == "conv_1"
    error = refused(responses, input=[{"role": "user", "content": "hi"}, *reference])
    assert (error.param, error.code) == ("input[1]", "unsupported_parameter")
    assert "previous_response_id" in error.message and "another tenant" in error.message


# --- Responses API: refusals -----------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 42}, "input"),
    ({"input": ["just a string"]}, "input[0]"),
    ({"input": [{"content": "no role"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": ["text"]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"text": "no type"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": 5}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
     "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "bad id!"}]}, "input[0].id"),
    ({"input": "x", "instructions": ["not", "a", "string"]}, "instructions"),
    ({"input": "x", "tools": {"type": "web_search"}}, "tools"),
    ({"input": "x", "tools": ["web_search"]}, "tools[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": ABSURD_MAX_TOKENS + 1}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "100"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "stream_options": {}}, "stream_options"),
    ({"input": "x", "stream": True, "stream_options": []}, "stream_options"),
    ({"input": "x", "store": "no"}, "store"),
    ({"input": "x", "previous_response_id": "resp with spaces"}, "previous_response_id"),
    ({"input": "x", "previous_response_id": "r" * 129}, "previous_response_id"),
    ({"input": "x", "previous_response_id": 12}, "previous_response_id"),
    ({"input": "x", "conversation": {"name": "no id"}}, "conversation.id"),
    ({"input": "x", "conversation": "conv/../x"}, "conversation"),
    ({"input": "x", "prompt": "pmpt_1"}, "prompt"),
    ({"input": "x", "background": "true"}, "background"),
])
def test_a_bad_responses_body_is_a_400_naming_the_field(fields: dict[str, Any], param: str):
    assert refused(responses, **fields).param == param


def test_background_mode_is_refused_as_unsupported():
    error = refused(responses, input="x", background=True)
    assert (error.param, error.code) == ("background", "unsupported_parameter")
    assert "background mode" in error.message.lower()
    assert "not supported" in error.message


def test_n_is_not_accepted():
    error = refused(responses, input="x", n=2)
    assert (error.param, error.code) == ("n", "unknown_parameter")


def test_previous_response_id_and_conversation_together_are_refused():
    error = refused(responses, input="x", previous_response_id="resp_1", conversation="conv_1")
    assert error.code == "mutually_exclusive_parameters"
    assert "previous_response_id" in error.message and "conversation" in error.message


@pytest.mark.parametrize("model", [None, "", "bad model name!"])
def test_the_model_rules_are_those_of_chat(model: Any):
    assert refused(responses, input="x", model=model).param == "model"
    assert refused(messages, model=model).param == "model"


# --- What the gateway cannot meter or must not pass on (Responses API) ---------------------

@pytest.mark.parametrize("tool", [
    {"type": "web_search"}, {"type": "web_search_preview"},
    {"type": "web_search_preview_2025_03_11"}, {"type": "web_search_2025_08_26"},
    {"type": "file_search"}, {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation", "quality": "low"},
])
def test_a_tool_billed_per_call_is_refused(tool: dict[str, Any]):
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    error = refused(responses, input="x", tools=[function, tool])
    assert (error.param, error.code) == ("tools[1]", "unsupported_tool")
    assert f"'{tool['type']}'" in error.message
    assert "per-call tool fees are not metered" in error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "read"}, {"type": "input_file", "file_id": "file-a"}]}]},
     "input[0].content[1].file_id"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "file_id": "file-b", "detail": "low"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_file", "file_id": "file-c"}]}]}, "input[0].output[0].file_id"),
    ({"input": "x", "prompt": {"id": "pmpt_1", "variables": {"city": "Paris"}}}, "prompt"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "prompt": "pmpt_1"}, "prompt"),
    ({"input": "x", "tools": [{"type": "mcp", "server_label": "s",
                               "vector_store_ids": ["vs_1"]}]}, "tools[0].vector_store_ids"),
    ({"input": "x", "tools": [{"type": "shell", "container": "cntr_1"}]}, "tools[0].container"),
    ({"input": "x", "tools": [{"type": "shell", "environment": {
        "type": "container_reference", "container_id": "cntr_1"}}]},
     "tools[0].environment.container_id"),
    ({"input": "x", "tools": [{"type": "shell", "container": {
        "type": "auto", "file_ids": ["file-1"]}}]}, "tools[0].container.file_ids"),
])
def test_an_object_stored_at_the_provider_is_refused_naming_it(fields: dict[str, Any],
                                                                param: str):
    error = refused(responses, **fields)
    assert (error.param, error.code) == (param, "unsupported_parameter")
    assert "another tenant" in error.message


def test_files_by_url_or_inline_and_an_automatic_container_stay_accepted():
    parts = [{"type": "input_image", "image_url": "https://x.test/a.png"},
             {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
             {"type": "input_file", "file_url": "https://x.test/a.pdf"},
             {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;"
                                                                     "base64,JVBERi0="}]
    tools = [{"type": "shell", "environment": {"type": "container_auto"}},
             {"type": "mcp", "server_label": "s", "server_url": "https://mcp.test"}]
    parsed = responses(input=[{"role": "user", "content": parts}], tools=tools)
    assert parsed.body["input"][0]["content"] == parts


# --- Messages API: happy shapes --------------------------------------------------------------

ANTHROPIC_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": [
        {"type": "text", "text": "What is in this image and this document?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "A short document."}},
    ]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me look.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "search_result", "source": "https://x.test", "title": "t",
         "content": [{"type": "text", "text": "found"}]},
    ]},
]


def test_a_minimal_messages_body_parses():
    parsed = messages()
    assert parsed.endpoint is Endpoint.MESSAGES
    assert (parsed.stream, parsed.include_usage, parsed.max_output, parsed.choices) == (
        False, False, 1024, 1)
    assert parsed.thinking_budget is None and parsed.store is True


def test_every_block_shape_parses_and_the_body_is_kept_as_sent():
    body = {"model": "claude-sonnet-4-5", "max_tokens": 4096, "messages": ANTHROPIC_MESSAGES,
            "system": [{"type": "text", "text": "Be brief.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "get_weather", "description": "Weather",
                       "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral", "ttl": "5m"}},
                      {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2},
                      {"type": "bash_20250124", "name": "bash"},
                      {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                      {"type": "memory_20250818", "name": "memory"}],
            "thinking": {"type": "enabled", "budget_tokens": 2048}, "stream": True,
            "stop_sequences": ["\n\nHuman:"], "temperature": 1, "metadata": {"user_id": "u"}}
    parsed = parse_body(Endpoint.MESSAGES, _raw(body))
    assert parsed.body == body
    assert (parsed.stream, parsed.max_output, parsed.thinking_budget) == (True, 4096, 2048)


def test_a_string_system_and_disabled_or_adaptive_thinking_parse():
    assert messages(system="You are terse.").thinking_budget is None
    assert messages(thinking={"type": "disabled"}).thinking_budget is None
    assert messages(thinking={"type": "adaptive"}).thinking_budget is None


# --- Messages API: refusals ------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": ...}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": ABSURD_MAX_TOKENS + 1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"messages": ...}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
     "messages[0].content[0]"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"system": [{"type": "text", "text": 3}]}, "system[0]"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [3]}, "tools[0]"),
    ({"stream": 1}, "stream"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"stop_sequences": ["ok", 3]}, "stop_sequences"),
    ({"thinking": True}, "thinking"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": {}}, "thinking.type"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "2000"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"n": 2}, "n"),
])
def test_a_bad_messages_body_is_a_400_naming_the_field(fields: dict[str, Any], param: str):
    assert refused(messages, **fields).param == param


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
    {"type": "web_search_20260209", "name": "web_search"},
    {"type": "code_execution_20250522", "name": "code_execution"},
    {"type": "code_execution_20250825", "name": "code_execution"},
])
def test_a_messages_server_tool_billed_per_call_is_refused(tool: dict[str, Any]):
    custom = {"name": "web_search", "input_schema": {"type": "object"}}  # the client's own
    error = refused(messages, tools=[custom, tool])
    assert (error.param, error.code) == ("tools[1]", "unsupported_tool")
    assert f"'{tool['type']}'" in error.message and "not metered" in error.message


ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"system": [{"type": "text", "text": "Be brief.", "cache_control": ONE_HOUR}]},
     "system[0].cache_control.ttl"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "again",
                                         "cache_control": ONE_HOUR}]}]},
     "messages[0].content[1].cache_control.ttl"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "r", "cache_control": ONE_HOUR}]}]}]},
     "messages[0].content[0].content[0].cache_control.ttl"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": ONE_HOUR}]},
     "tools[0].cache_control.ttl"),
    ({"cache_control": ONE_HOUR}, "cache_control.ttl"),
    ({"cache_control": {"type": "ephemeral", "ttl": "24h"}}, "cache_control.ttl"),
])
def test_a_one_hour_cache_ttl_is_refused_naming_its_place(fields: dict[str, Any], param: str):
    error = refused(messages, **fields)
    assert (error.param, error.code) == (param, "unsupported_parameter")
    assert "default 5-minute cache" in error.message
    if fields.get("cache_control", ONE_HOUR) is ONE_HOUR:
        assert error.message.startswith("A 1-hour cache TTL")


def test_the_default_cache_and_client_data_named_cache_control_stay_accepted():
    five = {"type": "ephemeral", "ttl": "5m"}
    tool = {"name": "cache", "input_schema": {"type": "object", "properties": {
        "cache_control": {"type": "object", "ttl": "1h"}}}}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "cache",
                                           "input": {"cache_control": {"ttl": "1h"}}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "ok", "cache_control": five}]},
    ]
    parsed = messages(messages=history, tools=[tool], cache_control={"type": "ephemeral"},
                      system=[{"type": "text", "text": "s", "cache_control": five}])
    assert parsed.body["messages"] == history


@pytest.mark.parametrize(("fields", "param"), [
    ({"container": "container_1"}, "container"),
    ({"container": {"id": "container_1", "skills": []}}, "container"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "file", "file_id": "file_1"}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "file", "file_id": "file_2"}}]}]},
     "messages[0].content[1].source"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "file_3"}}]}]}]},
     "messages[0].content[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [
        {"type": "container_upload", "file_id": "file_4"}]}]},
     "messages[0].content[0].file_id"),
])
def test_a_messages_file_or_container_stored_at_the_provider_is_refused(
        fields: dict[str, Any], param: str):
    error = refused(messages, **fields)
    assert (error.param, error.code) == (param, "unsupported_parameter")
    assert "another tenant" in error.message


def test_messages_files_by_url_or_inline_stay_accepted():
    content = [{"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
               {"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"}},
               {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                               "data": "JVBERi0="}},
               {"type": "document", "source": {"type": "content", "content": [
                   {"type": "text", "text": "inline"}]}}]
    assert messages(messages=[{"role": "user", "content": content}]).body["messages"][0][
        "content"] == content


def test_the_thinking_budget_must_be_below_max_tokens():
    # budget 1024 with max_tokens 1024 (the default above) is refused; one more token is fine.
    assert "less than 'max_tokens'" in refused(
        messages, thinking={"type": "enabled", "budget_tokens": 1024}).message
    assert messages(max_tokens=1025,
                    thinking={"type": "enabled", "budget_tokens": 1024}).thinking_budget == 1024


def test_a_missing_max_tokens_says_it_is_required():
    error = refused(messages, max_tokens=...)
    assert (error.param, error.code) == ("max_tokens", "missing_required_parameter")
    assert "required" in error.message


def test_the_chat_endpoints_parse_as_before():
    chat = parse_body(Endpoint.CHAT, _raw({"model": "gpt-4o", "n": 2, "max_tokens": 10,
                                            "messages": [{"role": "user", "content": "hi"}]}))
    assert (chat.choices, chat.max_output, chat.context_ref, chat.store) == (2, 10, None, True)
