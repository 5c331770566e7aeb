"""Parsing and validating /v1 request bodies (chat completions, completions, embeddings,
OpenAI's Responses API and Anthropic's Messages API).

Only what the gateway needs to meter is checked strictly (model, messages/prompt/input, output
caps, n, streaming options, and for the two newer APIs the fields that decide what the upstream
adds to the prompt: previous_response_id, conversation, system, tools, thinking); every other
field passes through untouched, so new provider parameters work without a gateway release.
Unknown input item and content block types pass too (the estimate counts them by their JSON).
What the gateway cannot meter, or must not pass on, is refused (400 unsupported_tool /
unsupported_parameter): built-in tools the upstream bills per call, Anthropic's 1-hour prompt
cache, and references to objects stored at the provider (files by id, stored prompts, vector
stores, containers, item references outside a continuation). A bad body is a 400 naming the
field, before any reservation is made.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.conf import settings

from gateway.errors import GatewayError, bad_request
from gateway.prices import MODEL_NAME_RULE, is_model_name

# An output cap above this is a typo or an attack, whatever the model.
ABSURD_MAX_TOKENS = 10_000_000
MAX_CHOICES = 128


class Endpoint(StrEnum):
    CHAT = "chat/completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"  # OpenAI's Responses API
    MESSAGES = "messages"  # Anthropic's Messages API


@dataclass(frozen=True)
class ParsedBody:
    endpoint: Endpoint
    body: dict[str, Any]  # the JSON object, forwarded upstream (after the gateway's edits)
    model: str
    stream: bool
    include_usage: bool  # the client asked for the usage chunk in a stream
    max_output: int | None  # the client's output cap per choice, if any
    choices: int  # n (times best_of for legacy completions): output is reserved per choice
    size: int = 0  # bytes of the raw body: a large one is token-counted off the event loop
    # Responses API: the earlier turns the upstream adds that the gateway does not see.
    context_ref: str | None = None  # previous_response_id
    conversation: str | None = None  # the conversation's id
    store: bool = True  # whether the upstream keeps the response (Responses API default: true)
    # Messages API: thinking.budget_tokens (it counts inside max_tokens, so it adds no hold).
    thinking_budget: int | None = None


_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _int_field(body: dict[str, Any], name: str, *, minimum: int, maximum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer.", name)
    if not minimum <= value <= maximum:
        raise bad_request(f"'{name}' must be between {minimum} and {maximum}, got {value}.", name)
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", "messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{param}' must be an object.", param)
        if message.get("role") not in _ROLES:
            raise bad_request(f"'{param}.role' must be one of {', '.join(sorted(_ROLES))}.",
                              f"{param}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"'{param}.content' must be a string or an array.",
                              f"{param}.content")


def _check_text_or_tokens(value: Any, name: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in x) for x in value):
            return
    raise bad_request(
        f"'{name}' must be a string, an array of strings, an array of tokens or an array of "
        "token arrays.", name)


def _prompt_count(prompt: Any) -> int:
    """A string or one token array is one prompt; a list of strings or of token arrays is many."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def nested_deeper_than(raw: bytes, value: Any, limit: int) -> bool:
    """Whether the parsed JSON `value` (parsed from `raw`) nests arrays and objects more than
    `limit` levels deep (the top level is 1).

    Every level needs an opening bracket in the text, so a body with at most `limit` of them
    cannot be too deep: two byte counts at C speed settle the common case, and only a body with
    more brackets is walked (iteratively: the walk itself must not recurse)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children
                       if isinstance(child, (dict, list)))
    return False


def too_deep_message(limit: int) -> str:
    return f"The JSON body is nested more than {limit} levels deep."


def load_json(raw: bytes) -> Any:
    """The JSON of a /v1 body; 400 when it is not JSON or nested deeper than JSON_MAX_DEPTH
    (Python's parser raises RecursionError on very deep nesting: a 400 too, never a 500)."""
    limit = settings.JSON_MAX_DEPTH
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(too_deep_message(limit), None, "json_too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}") from exc
    if isinstance(body, (dict, list)) and nested_deeper_than(raw, body, limit):
        raise bad_request(too_deep_message(limit), None, "json_too_deep")
    return body


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", name)
    return value


def _refuse_n(body: dict[str, Any], api: str) -> None:
    # The Responses and Messages APIs answer one output per call; an `n` would be rejected by
    # the upstream after the hold was made, so it is refused before.
    if body.get("n") is not None:
        raise bad_request(f"Unknown parameter: 'n'. The {api} returns one output per call.",
                          "n", "unknown_parameter")


# Response and conversation ids as OpenAI issues them ("resp_...", "conv_..."). The id ends up
# in a Redis key (the remembered context of a response), so its alphabet and length are bounded.
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_RESPONSE_ROLES = {"user", "assistant", "system", "developer"}
_MESSAGE_ROLES = {"user", "assistant"}
# Anthropic's documented floor for an extended-thinking budget.
MIN_THINKING_BUDGET = 1024


def _response_id(value: Any, param: str) -> str:
    if not isinstance(value, str) or not _RESPONSE_ID.fullmatch(value):
        raise bad_request(f"'{param}' must be an id of 1 to 128 letters, digits, '_' or '-'.",
                          param)
    return value


def _check_parts(content: Any, param: str) -> None:
    """A content string, or an array of parts/blocks, each an object with a string type."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array.", param)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"'{param}[{j}]' must be an object with a string 'type'.",
                              f"{param}[{j}]")


def _check_response_input(value: Any) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of input items.",
                          "input")
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{param}' must be an object.", param)
        kind = item.get("type")
        if kind is not None and not isinstance(kind, str):
            raise bad_request(f"'{param}.type' must be a string.", f"{param}.type")
        if kind is None and "role" not in item:
            raise bad_request(f"'{param}' must be a message (with a role) or have a 'type'.",
                              f"{param}.type")
        if kind in (None, "message"):
            if item.get("role") not in _RESPONSE_ROLES:
                raise bad_request(
                    f"'{param}.role' must be one of {', '.join(sorted(_RESPONSE_ROLES))}.",
                    f"{param}.role")
            _check_parts(item.get("content"), f"{param}.content")
        elif kind == "function_call":
            for name in ("name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise bad_request(f"'{param}.{name}' must be a string.", f"{param}.{name}")
        elif kind == "function_call_output":
            _check_parts(item.get("output"), f"{param}.output")
        elif kind == "item_reference":
            _response_id(item.get("id"), f"{param}.id")
        # reasoning, built-in tool calls and their outputs, and future item types pass through.


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array.", "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{i}]' must be an object.", f"tools[{i}]")


# -- What this gateway cannot meter, or must not pass on ----------------------------------------
#
# Built-in tools the upstream bills per call (a search, a container session, a generated image)
# on top of the tokens: the ledger meters tokens only, so such a call would run partly unbilled
# and its fee escape every quota. Refused until per-call fees are metered. Matched by prefix, so
# dated variants (web_search_preview_2025_03_11, web_search_20250305, ...) are caught too.
# Tools without a per-call fee (function, custom, mcp, computer use, local_shell, apply_patch,
# Anthropic's bash, text_editor, memory, web_fetch, ...) stay accepted.
RESPONSES_FEE_TOOLS: tuple[str, ...] = ("web_search", "file_search", "code_interpreter",
                                        "image_generation")
MESSAGES_FEE_TOOLS: tuple[str, ...] = ("web_search_", "code_execution_")
# Anthropic's prompt-cache lifetimes this gateway prices: the default 5 minutes (cache writes at
# the cache-write class). A 1-hour write costs 2x input, a class Tollgate does not have.
_CACHE_TTLS = frozenset({"5m"})
# Where a Messages body holds the client's own data, not Anthropic parameters: a tool call's
# input and a tool's schema may use any key, "cache_control" included.
_CLIENT_DATA_KEYS = frozenset({"input", "input_schema"})
# Why objects stored at the provider cannot be referenced: this gateway serves no /v1/files,
# vector stores, containers or stored prompts, so any such id was made outside it, by the
# operator or by another tenant sharing the provider key, and the gateway cannot tell which.
_NOT_YOURS = ("this gateway does not serve the provider's stored {what}, so such an id may "
              "belong to another tenant of the provider key")


def unsupported_parameter(message: str, param: str) -> GatewayError:
    return bad_request(message, param, "unsupported_parameter")


def _refuse_fee_tools(tools: Any, prefixes: tuple[str, ...]) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(prefixes):
            raise bad_request(
                f"The built-in tool '{kind[:64]}' is billed by the provider per call, on top of "
                "tokens, and per-call tool fees are not metered by this gateway yet; remove it "
                "from 'tools'.", f"tools[{i}]", "unsupported_tool")


def _tool_store_reference(tool: dict[str, Any]) -> str | None:
    """The field of a Responses tool that names an object stored at the provider (vector
    stores, a container or its files), None when none does. An automatic container without
    files ({"type": "auto"}) is made for the call and names nothing."""
    if tool.get("vector_store_ids"):
        return "vector_store_ids"
    if isinstance(tool.get("container"), str):  # a container's id
        return "container"
    # (A string "environment" is computer use's kind of screen, not a reference.)
    for name in ("container", "environment"):
        value = tool.get(name)
        if isinstance(value, dict):
            for field in ("container_id", "file_ids"):
                if value.get(field):
                    return f"{name}.{field}"
    return None


def check_response_references(items: Any, param: str, *, continuing: bool) -> None:
    """400 unsupported_parameter for Responses input items that name objects stored at the
    provider: input_file / input_image parts by `file_id`, and `item_reference` items unless
    the call continues a stored response or conversation (`continuing`), whose items those are.
    Also what a conversation's initial items are checked with."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "item_reference" and not continuing:
            raise unsupported_parameter(
                f"'{param}[{i}]' is an item_reference, allowed only when the call continues "
                "a stored response or conversation ('previous_response_id' or "
                "'conversation'): otherwise its id may name an item that another tenant of the "
                "provider key stored. Send the item itself instead.", f"{param}[{i}]")
        for field in ("content", "output"):
            parts = item.get(field)
            if not isinstance(parts, list):
                continue
            for j, part in enumerate(parts):
                if (isinstance(part, dict) and part.get("type") in ("input_file", "input_image")
                        and part.get("file_id") is not None):
                    raise unsupported_parameter(
                        f"'{param}[{i}].{field}[{j}].file_id' names a file stored at the "
                        "provider: " + _NOT_YOURS.format(what="files") + ". Send the file "
                        "inline ('file_data' / a data URL) or by a public URL.",
                        f"{param}[{i}].{field}[{j}].file_id")


def _check_responses_refusals(body: dict[str, Any], *, continuing: bool) -> None:
    """What a Responses body may not ask for here (see the section's comment), besides a
    stored `prompt` (refused first: without it a body may lack `input`)."""
    check_response_references(body.get("input"), "input", continuing=continuing)
    tools = body.get("tools")
    _refuse_fee_tools(tools, RESPONSES_FEE_TOOLS)
    for i, tool in enumerate(tools or ()):
        field = _tool_store_reference(tool)
        if field is not None:
            raise unsupported_parameter(
                f"'tools[{i}].{field}' names an object stored at the provider: "
                + _NOT_YOURS.format(what="vector stores, containers or files") + ".",
                f"tools[{i}].{field}")


def _parse_responses(endpoint: Endpoint, body: dict[str, Any], model: str,
                     size: int) -> ParsedBody:
    _refuse_n(body, "Responses API")
    if _bool_field(body, "background", False):
        # A background response finishes after this call returns: its usage would have to be
        # polled to settle the hold. Until that exists it is refused rather than run unmetered.
        raise bad_request("Background mode ('background': true) is not supported by this "
                          "gateway yet; send the request without it.", "background",
                          "unsupported_parameter")
    stream = _bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              "stream_options")
    context_ref = None
    if body.get("previous_response_id") is not None:
        context_ref = _response_id(body["previous_response_id"], "previous_response_id")
    conversation = None
    raw_conversation = body.get("conversation")
    if raw_conversation is not None:
        if isinstance(raw_conversation, dict):
            conversation = _response_id(raw_conversation.get("id"), "conversation.id")
        else:
            conversation = _response_id(raw_conversation, "conversation")
    if context_ref is not None and conversation is not None:
        raise bad_request("Mutually exclusive parameters: provide only one of "
                          "'previous_response_id' or 'conversation'.", "conversation",
                          "mutually_exclusive_parameters")
    if body.get("prompt") is not None:
        raise unsupported_parameter(
            "'prompt' names a prompt template stored at the provider: "
            + _NOT_YOURS.format(what="prompts") + ". Send its text in 'instructions' and "
            "'input' instead.", "prompt")
    if body.get("input") is not None:
        _check_response_input(body["input"])
    elif context_ref is None and conversation is None:
        raise bad_request("You must provide 'input' (or continue a 'previous_response_id' or "
                          "'conversation').", "input", "missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", "instructions")
    _check_tools(body)
    _check_responses_refusals(body, continuing=context_ref is not None or conversation is not None)
    max_output = _int_field(body, "max_output_tokens", minimum=1, maximum=ABSURD_MAX_TOKENS)
    store = _bool_field(body, "store", True)
    # Responses streams always end with the response.completed event, which carries the usage:
    # nothing to ask for, so include_usage stays False.
    return ParsedBody(endpoint, body, model, stream, False, max_output, 1, size,
                      context_ref=context_ref, conversation=conversation, store=store)


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or an array of text blocks.", "system")
    for i, block in enumerate(system):
        if (not isinstance(block, dict) or block.get("type") != "text"
                or not isinstance(block.get("text"), str)):
            raise bad_request(f"'system[{i}]' must be a text block "
                              '({"type": "text", "text": ...}).', f"system[{i}]")


def _check_anthropic_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", "messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{param}' must be an object.", param)
        if message.get("role") not in _MESSAGE_ROLES:
            raise bad_request(f"'{param}.role' must be one of: assistant, user.",
                              f"{param}.role")
        _check_parts(message.get("content"), f"{param}.content")


def _thinking_budget(body: dict[str, Any], max_tokens: int) -> int | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise bad_request("'thinking' must be an object.", "thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return None
    if kind == "adaptive":
        # The model decides how much to think, inside max_tokens (Anthropic's newer models):
        # no budget to check, and the hold (max_tokens) bounds it all the same.
        if "budget_tokens" in thinking:
            raise bad_request("'thinking.budget_tokens' is not allowed with type 'adaptive'.",
                              "thinking.budget_tokens")
        return None
    if kind != "enabled":
        raise bad_request("'thinking.type' must be 'enabled', 'disabled' or 'adaptive'.",
                          "thinking.type")
    budget = thinking.get("budget_tokens")
    param = "thinking.budget_tokens"
    if budget is None:
        raise bad_request(f"'{param}' is required when thinking is enabled.", param)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise bad_request(f"'{param}' must be an integer.", param)
    if budget < MIN_THINKING_BUDGET:
        raise bad_request(f"'{param}' must be at least {MIN_THINKING_BUDGET}, got {budget}.",
                          param)
    if budget >= max_tokens:
        raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than "
                          f"'max_tokens' ({max_tokens}).", "thinking.budget_tokens")
    return budget


def _check_cache_ttls(body: dict[str, Any]) -> None:
    """400 for a prompt-cache breakpoint with a lifetime other than the default 5 minutes,
    wherever it is (system blocks, message content blocks, tools, the top level): Anthropic bills
    a 1-hour cache write at 2x input, a price class this gateway does not meter."""
    pending: list[tuple[Any, str]] = [(body, "")]
    while pending:
        node, param = pending.pop()
        if isinstance(node, dict):
            control = node.get("cache_control")
            if isinstance(control, dict) and control.get("ttl") is not None \
                    and control["ttl"] not in _CACHE_TTLS:
                where = f"{param}.cache_control.ttl" if param else "cache_control.ttl"
                ttl = control["ttl"]
                what = ("A 1-hour cache TTL" if ttl == "1h"
                        else f"The cache TTL {json.dumps(ttl)[:32]}")
                raise unsupported_parameter(
                    f"{what} ('{where}') is not supported yet; use the default 5-minute cache "
                    "(omit 'ttl' or set it to '5m').", where)
            pending.extend((value, f"{param}.{key}" if param else key)
                           for key, value in node.items()
                           if isinstance(value, (dict, list)) and key not in _CLIENT_DATA_KEYS)
        else:
            pending.extend((value, f"{param}[{i}]") for i, value in enumerate(node)
                           if isinstance(value, (dict, list)))


def check_messages_references(body: dict[str, Any]) -> None:
    """400 unsupported_parameter for a Messages body that names objects stored at Anthropic: a
    top-level `container`, and document or image blocks whose source is a file (`file_id`),
    also inside tool results and content documents. URL and inline sources stay accepted. Also
    what count_tokens checks: counting another tenant's file would tell its size."""
    if body.get("container") is not None:
        raise unsupported_parameter(
            "'container' names a container stored at the provider: "
            + _NOT_YOURS.format(what="containers") + ".", "container")
    pending: list[tuple[Any, str]] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        pending.extend((message.get("content"), f"messages[{i}].content")
                       for i, message in enumerate(messages) if isinstance(message, dict))
    while pending:
        blocks, param = pending.pop()
        if not isinstance(blocks, list):
            continue
        for j, block in enumerate(blocks):
            if not isinstance(block, dict):
                continue
            where = f"{param}[{j}]"
            source = block.get("source")
            if block.get("file_id") is not None:
                where += ".file_id"
            elif isinstance(source, dict) and (source.get("type") == "file"
                                               or source.get("file_id") is not None):
                where += ".source"
            else:
                pending.append((block.get("content"), f"{where}.content"))
                if isinstance(source, dict):
                    pending.append((source.get("content"), f"{where}.source.content"))
                continue
            raise unsupported_parameter(
                f"'{where}' names a file stored at the provider: "
                + _NOT_YOURS.format(what="files") + ". Send it inline (a base64 or text "
                "source) or by a public URL.", where)


def _parse_messages(endpoint: Endpoint, body: dict[str, Any], model: str,
                    size: int) -> ParsedBody:
    _refuse_n(body, "Messages API")
    max_tokens = _int_field(body, "max_tokens", minimum=1, maximum=ABSURD_MAX_TOKENS)
    if max_tokens is None:
        raise bad_request("'max_tokens' is required.", "max_tokens",
                          "missing_required_parameter")
    _check_anthropic_messages(body.get("messages"))
    _check_system(body.get("system"))
    _check_tools(body)
    _refuse_fee_tools(body.get("tools"), MESSAGES_FEE_TOOLS)
    check_messages_references(body)
    _check_cache_ttls(body)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list)
                                  and all(isinstance(s, str) for s in stops)):
        raise bad_request("'stop_sequences' must be an array of strings.", "stop_sequences")
    budget = _thinking_budget(body, max_tokens)
    stream = _bool_field(body, "stream", False)
    # Messages streams always carry usage (message_start, message_delta): include_usage False.
    return ParsedBody(endpoint, body, model, stream, False, max_tokens, 1, size,
                      thinking_budget=budget)


def parse_body(endpoint: Endpoint, raw: bytes) -> ParsedBody:
    body = load_json(raw)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("You must provide a model parameter.", "model")
    if not is_model_name(model):
        # Before anything is reserved or forwarded: such a name never reaches a quota key,
        # the upstream or the ledger (and finance's reports).
        raise bad_request(f"Invalid model name. {MODEL_NAME_RULE}.", "model", "invalid_model")
    if endpoint is Endpoint.RESPONSES:
        return _parse_responses(endpoint, body, model, len(raw))
    if endpoint is Endpoint.MESSAGES:
        return _parse_messages(endpoint, body, model, len(raw))

    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    stream = bool(stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              "stream_options")
        include_usage = bool(options.get("include_usage", False))

    choices = _int_field(body, "n", minimum=1, maximum=MAX_CHOICES) or 1
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
        for name in ("tools", "functions"):
            if body.get(name) is not None and not isinstance(body[name], list):
                raise bad_request(f"'{name}' must be an array.", name)
        caps = [_int_field(body, name, minimum=1, maximum=ABSURD_MAX_TOKENS)
                for name in ("max_completion_tokens", "max_tokens")]
        max_output = min((c for c in caps if c is not None), default=None)
    elif endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise bad_request("You must provide a prompt.", "prompt")
        _check_text_or_tokens(body["prompt"], "prompt")
        max_output = _int_field(body, "max_tokens", minimum=1, maximum=ABSURD_MAX_TOKENS)
        best_of = _int_field(body, "best_of", minimum=1, maximum=MAX_CHOICES) or 1
        # Each prompt of a batch gets its own n (or best_of) completions.
        choices = max(choices, best_of) * _prompt_count(body["prompt"])
    else:
        if "input" not in body:
            raise bad_request("You must provide an input.", "input")
        _check_text_or_tokens(body["input"], "input")
        if stream:
            raise bad_request("Embeddings cannot be streamed.", "stream")
        max_output = None
    return ParsedBody(endpoint, body, model, stream, include_usage, max_output, choices,
                      len(raw))
