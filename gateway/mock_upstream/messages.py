"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) for the mock upstream; the
rules are in the package docstring ("The Messages API")."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.mock_upstream.app import (
    DEFAULT_OUTPUT_TOKENS,
    TOOL_ARGUMENT_PIECES,
    TOOL_ARGUMENTS,
    TOOL_CALL_TOKENS,
    BadRequest,
    Faults,
    Handler,
    Receive,
    RequestHeaders,
    Scope,
    Send,
    _apply_faults,
    _dumps,
    _next_id,
    _read_json,
    _send_body,
    _send_error,
    _stream_pieces,
    _words,
    answer_text,
    api_key_id,
    ledger,
    parse_faults,
    send_json,
    split_output,
    stream_tokens,
    tool_rule,
)

MIN_THINKING_BUDGET = 1024
ROLES = ("user", "assistant")
# Deterministic, and plainly not a real signature.
SIGNATURE = "mock-signature-not-verifiable"
TOOL_INPUT: dict[str, Any] = json.loads(TOOL_ARGUMENTS)


def _api_key(headers: RequestHeaders) -> str:
    """The key from x-api-key, else from `Authorization: Bearer` (how the anthropic SDK 2.x sends
    an api_key, and how OAuth tokens travel)."""
    if headers.api_key is not None and headers.api_key.strip():
        return headers.api_key.decode("latin-1").strip()
    if headers.authorization is not None:
        scheme, _, key = headers.authorization.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    raise BadRequest("x-api-key header is required", status=401)


def _require_version(headers: RequestHeaders) -> None:
    if headers.anthropic_version is None or not headers.anthropic_version.strip():
        raise BadRequest("anthropic-version: header is required")


# ---------------------------------------------------------------------------------------------
# Validation and token counting
# ---------------------------------------------------------------------------------------------


def _block_text(block: Any, where: str) -> str:
    """The words a content block carries: its text, a tool call's input JSON, a tool result's
    content, thinking text, a text document; images and redacted thinking carry none here."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequest(f"{where}: each content block must be an object with a type")
    kind = block["type"]
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise BadRequest(f"{where}.text: Field required")
        return str(block["text"])
    if kind == "tool_use":
        if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
            raise BadRequest(f"{where}: a tool_use block needs id and name")
        return json.dumps(block.get("input", {}))
    if kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            raise BadRequest(f"{where}.tool_use_id: Field required")
        content = block.get("content", "")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return " ".join(_block_text(part, f"{where}.content") for part in content)
        raise BadRequest(f"{where}.content: expected a string or content blocks")
    if kind == "thinking":
        return str(block.get("thinking", ""))
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text":
            return str(source.get("data", ""))
        if isinstance(source, dict) and source.get("type") == "content" and isinstance(source.get("content"), list):
            return " ".join(_block_text(part, f"{where}.source.content") for part in source["content"])
        return ""
    return ""


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(_block_text(block, f"{where}.{i}") for i, block in enumerate(content))
    raise BadRequest(f"{where}.content: expected a string or an array of content blocks")


def _only_text(content: Any) -> str:
    """The text blocks of a user turn (a turn of tool results has none: the tool rule then
    answers with text)."""
    if isinstance(content, str):
        return content
    return " ".join(block["text"] for block in content
                    if isinstance(block, dict) and block.get("type") == "text"
                    and isinstance(block.get("text"), str))


@dataclass(slots=True)
class Request:
    model: str
    max_tokens: int | None
    total_input: int
    last_user_text: str
    tool_names: list[str]
    tool_mode: str
    forced_tool: str | None
    thinking: bool
    stream: bool


def parse_request(payload: dict[str, Any], counting: bool) -> Request:
    """Validate like Anthropic and count the input; count_tokens needs no max_tokens."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: Field required")
    max_tokens = payload.get("max_tokens")
    if counting:
        max_tokens = None
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens: Field required (an integer >= 1)" if max_tokens is None
                         else "max_tokens: Input should be an integer >= 1")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: at least one message is required")
    total = 0
    last_user_text = ""
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"{where}.role: Input should be 'user' or 'assistant'")
        total += _words(_content_text(message.get("content"), where))
        if message["role"] == "user":
            last_user_text = _only_text(message["content"])
    system = payload.get("system")
    if system is not None:
        if isinstance(system, str):
            total += _words(system)
        elif isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                              and isinstance(b.get("text"), str) for b in system):
            total += sum(_words(b["text"]) for b in system)
        else:
            raise BadRequest("system: Input should be a string or an array of text blocks")
    thinking = payload.get("thinking")
    enabled = False
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise BadRequest("thinking.type: Input should be 'enabled' or 'disabled'")
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
                raise BadRequest(f"thinking.enabled.budget_tokens: Input should be greater than or "
                                 f"equal to {MIN_THINKING_BUDGET}")
            if max_tokens is not None and budget >= max_tokens:
                raise BadRequest("`max_tokens` must be greater than `thinking.budget_tokens`.")
            enabled = True
    tools = payload.get("tools")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools: Input should be a valid list")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
                raise BadRequest(f"tools.{i}.name: Field required")
            # Server tools (web search...) have a type; the mock only calls custom tools.
            if tool.get("type") in (None, "custom"):
                names.append(tool["name"])
        if tools:
            total += len(json.dumps(tools).split())
    mode, forced = _tool_choice(payload.get("tool_choice"))
    return Request(model, max_tokens, total, last_user_text, names, mode, forced, enabled,
                   payload.get("stream") is True)


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise BadRequest("tool_choice.name: Field required")
        return "auto", choice["name"]
    return {"auto": "auto", "any": "required", "none": "none"}[choice["type"]], None


# ---------------------------------------------------------------------------------------------
# The answer
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    total_input: int
    cache_read: int
    cache_write: int
    thinking: int
    visible: int  # words of the text block, or TOOL_CALL_TOKENS for a tool call
    tool_name: str | None
    stop_reason: str

    @property
    def output_tokens(self) -> int:
        return self.thinking + self.visible

    def input_usage(self) -> dict[str, Any]:
        # Anthropic's input_tokens EXCLUDE cache reads and writes.
        return {"input_tokens": self.total_input - self.cache_read - self.cache_write,
                "cache_creation_input_tokens": self.cache_write,
                "cache_read_input_tokens": self.cache_read,
                "cache_creation": {"ephemeral_5m_input_tokens": self.cache_write,
                                   "ephemeral_1h_input_tokens": 0}}

    def usage(self, output_tokens: int) -> dict[str, Any]:
        return {**self.input_usage(), "output_tokens": output_tokens,
                "output_tokens_details": {"thinking_tokens": min(self.thinking, output_tokens)},
                "service_tier": "standard"}


def plan_answer(request: Request, faults: Faults) -> Plan:
    total = request.total_input
    # cache_read_tokens, else the OpenAI-named cached_tokens, so one fault set serves both APIs.
    read = faults.cache_read_tokens if faults.cache_read_tokens is not None else faults.cached_tokens
    cache_read = min(read or 0, total)
    cache_write = min(faults.cache_write_tokens or 0, total - cache_read)
    reasoning = (faults.reasoning_tokens or 0) if request.thinking else 0
    tool_name = tool_rule(request.tool_names, request.tool_mode, request.forced_tool,
                          request.last_user_text)
    assert request.max_tokens is not None
    wanted = DEFAULT_OUTPUT_TOKENS if faults.output_tokens is None else faults.output_tokens
    if tool_name is not None:
        kept, _, _ = split_output(0, reasoning, request.max_tokens)
        return Plan(total, cache_read, cache_write, kept, TOOL_CALL_TOKENS, tool_name, "tool_use")
    kept, visible, capped = split_output(wanted, reasoning, request.max_tokens)
    return Plan(total, cache_read, cache_write, kept, visible, None, "max_tokens" if capped else "end_turn")


def _content(plan: Plan, tool_id: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if plan.thinking:
        blocks.append({"type": "thinking", "thinking": answer_text(plan.thinking), "signature": SIGNATURE})
    if plan.tool_name:
        blocks.append({"type": "tool_use", "id": tool_id, "name": plan.tool_name, "input": TOOL_INPUT})
    elif plan.visible or not plan.thinking:
        blocks.append({"type": "text", "text": answer_text(plan.visible)})
    return blocks


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {_dumps(event)}\n\n".encode()


def _stream_events(plan: Plan, message: dict[str, Any], tool_id: str) -> list[tuple[bytes, int]]:
    """Anthropic's event sequence, each event with the output tokens it carries."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**plan.input_usage(), "output_tokens": 1, "service_tier": "standard"}}
    events: list[tuple[dict[str, Any], int]] = [({"type": "message_start", "message": start}, 0)]
    index = 0
    pinged = False

    def block(first: dict[str, Any], deltas: list[tuple[dict[str, Any], int]]) -> None:
        nonlocal index, pinged
        carries_name = 1 if first.get("type") == "tool_use" else 0
        events.append(({"type": "content_block_start", "index": index, "content_block": first},
                       carries_name))
        if not pinged:
            events.append(({"type": "ping"}, 0))
            pinged = True
        for delta, tokens in deltas:
            events.append(({"type": "content_block_delta", "index": index, "delta": delta}, tokens))
        events.append(({"type": "content_block_stop", "index": index}, 0))
        index += 1

    if plan.thinking:
        deltas = [({"type": "thinking_delta", "thinking": piece}, 1) for piece in _stream_pieces(plan.thinking)]
        deltas.append(({"type": "signature_delta", "signature": SIGNATURE}, 0))
        block({"type": "thinking", "thinking": "", "signature": ""}, deltas)
    if plan.tool_name:
        block({"type": "tool_use", "id": tool_id, "name": plan.tool_name, "input": {}},
              [({"type": "input_json_delta", "partial_json": piece}, _words(piece))
               for piece in TOOL_ARGUMENT_PIECES])
    elif plan.visible or not plan.thinking:
        block({"type": "text", "text": ""},
              [({"type": "text_delta", "text": piece}, 1) for piece in _stream_pieces(plan.visible)])
    events.append(({"type": "message_delta",
                    "delta": {"stop_reason": plan.stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": plan.output_tokens,
                              "output_tokens_details": {"thinking_tokens": plan.thinking}}}, 0))
    events.append(({"type": "message_stop"}, 0))
    return [(_sse(event), tokens) for event, tokens in events]


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


async def _anthropic_errors(handler: Handler, scope: Scope, receive: Receive, send: Send,
                            headers: RequestHeaders) -> None:
    try:
        await handler(scope, receive, send, headers)
    except BadRequest as error:
        await _send_error(send, error, anthropic=True)


async def _create(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _api_key(headers)
    _require_version(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    request = parse_request(payload, counting=False)
    model, faults = parse_faults(headers, request.model, key)
    assert model is not None
    plan = plan_answer(request, faults)
    if await _apply_faults(faults, receive, send, anthropic=True):
        return
    key_id = api_key_id(key)
    tool_id = _next_id("toolu_")
    message = {"id": _next_id("msg_"), "type": "message", "role": "assistant", "model": model,
               "content": _content(plan, tool_id), "stop_reason": plan.stop_reason,
               "stop_sequence": None, "usage": plan.usage(plan.output_tokens)}

    def bill(output_tokens: int) -> None:
        # The bill's input is ALL input, cache reads and writes included.
        ledger.record_completion(key_id, model, plan.total_input, output_tokens,
                                 cached=plan.cache_read, cache_write=plan.cache_write,
                                 reasoning=min(plan.thinking, output_tokens))

    if not request.stream:
        bill(plan.output_tokens)
        await _send_body(send, _dumps(message).encode(), faults)
        return
    events = _stream_events(plan, message, tool_id)
    assert sum(tokens for _, tokens in events) == plan.output_tokens
    await stream_tokens(send, receive, faults, events, bill)


async def _count_tokens(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _api_key(headers)
    _require_version(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    request = parse_request(payload, counting=True)
    _, faults = parse_faults(headers, request.model, key)
    if await _apply_faults(faults, receive, send, anthropic=True):
        return
    # Not billed: Anthropic's token counting is free.
    await send_json(send, 200, _dumps({"input_tokens": request.total_input}).encode())


async def create_message(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    await _anthropic_errors(_create, scope, receive, send, headers)


async def count_tokens(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    await _anthropic_errors(_count_tokens, scope, receive, send, headers)


def register(routes: dict[str, dict[str, Handler]]) -> None:
    routes["/v1/messages"] = {"POST": create_message}
    routes["/v1/messages/count_tokens"] = {"POST": count_tokens}
