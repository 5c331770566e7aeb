"""OpenAI's Responses API (/v1/responses and its sub-resources) and /v1/moderations for the mock
upstream; the rules are in the package docstring ("The Responses API")."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from gateway.mock_upstream.app import (
    DEFAULT_OUTPUT_TOKENS,
    TOOL_ARGUMENT_PIECES,
    TOOL_ARGUMENTS,
    TOOL_CALL_TOKENS,
    BadRequest,
    Handler,
    Receive,
    RequestHeaders,
    Scope,
    Send,
    _apply_faults,
    _bearer_key,
    _dumps,
    _next_id,
    _read_body,
    _read_json,
    _required_model,
    _send_body,
    _stream_pieces,
    _words,
    answer_text,
    api_key_id,
    cached_part,
    ledger,
    parse_faults,
    send_json,
    split_output,
    stream_tokens,
    tool_rule,
)

# Stored responses are kept in memory; the oldest go first beyond this many (per worker), so a
# long benchmark cannot grow the mock without bound.
MAX_STORED = 20_000
MAX_CONVERSATIONS = 20_000
MODERATION_MODEL = "omni-moderation-latest"
MODERATION_CATEGORIES: tuple[str, ...] = (
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
    "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions", "sexual",
    "sexual/minors", "violence", "violence/graphic",
)
# A small constant score: nothing the mock sees is harmful, and a deterministic value keeps
# tests exact.
MODERATION_SCORE = 1e-06


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    # input_tokens + output_tokens: what a follow-up turn re-sends as input.
    context: int
    background: bool = False
    timer: asyncio.TimerHandle | None = field(default=None)


@dataclass(slots=True)
class ConversationRecord:
    # The tokens a turn in this conversation re-sends: its items', then the last turn's
    # input_tokens + output_tokens.
    context: int
    # None for an id only ever used in `conversation` (the mock's leniency): no object to GET.
    created_at: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class ResponseStore:
    """Responses kept per (api_key_id, response id), and conversations per
    (api_key_id, conversation id): a key never sees another key's state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.conversations: OrderedDict[tuple[str, str], ConversationRecord] = OrderedDict()

    def get(self, key_id: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self.responses.get((key_id, response_id))

    def put(self, key_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self.responses[(key_id, stored.body["id"])] = stored
            while len(self.responses) > MAX_STORED:
                self.responses.popitem(last=False)

    def delete(self, key_id: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self.responses.pop((key_id, response_id), None)

    def conversation(self, key_id: str, conversation_id: str) -> ConversationRecord | None:
        with self._lock:
            return self.conversations.get((key_id, conversation_id))

    def context(self, key_id: str, conversation_id: str) -> int:
        record = self.conversation(key_id, conversation_id)
        return 0 if record is None else record.context

    def put_conversation(self, key_id: str, conversation_id: str, record: ConversationRecord) -> None:
        with self._lock:
            self.conversations[(key_id, conversation_id)] = record
            self.conversations.move_to_end((key_id, conversation_id))
            while len(self.conversations) > MAX_CONVERSATIONS:
                self.conversations.popitem(last=False)

    def set_conversation(self, key_id: str, conversation_id: str, context: int) -> None:
        with self._lock:
            record = self.conversations.get((key_id, conversation_id))
        if record is None:
            self.put_conversation(key_id, conversation_id, ConversationRecord(context))
        else:
            record.context = context

    def delete_conversation(self, key_id: str, conversation_id: str) -> ConversationRecord | None:
        with self._lock:
            return self.conversations.pop((key_id, conversation_id), None)

    def reset(self) -> None:
        with self._lock:
            for stored in self.responses.values():
                if stored.timer is not None:
                    stored.timer.cancel()
            self.responses.clear()
            self.conversations.clear()


store = ResponseStore()


# ---------------------------------------------------------------------------------------------
# Input: items, token counts, the tool rule
# ---------------------------------------------------------------------------------------------


def _parts_text(content: Any, param: str) -> str:
    """The text of a message's content: a string, or parts (input_text, output_text, refusal,
    summary_text...); images and files carry no words here."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"Invalid '{param}': expected a string or an array of content parts.",
                         param=param)
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            raise BadRequest(f"Invalid '{param}': each content part must be an object.", param=param)
        for name in ("text", "refusal"):
            if isinstance(part.get(name), str):
                texts.append(part[name])
    return " ".join(texts)


@dataclass(slots=True)
class ParsedInput:
    items: list[dict[str, Any]]  # as stored for GET .../input_items, each with an id
    tokens: int  # words of the items (not of instructions, tools or earlier turns)
    last_user_text: str
    after_tool_output: bool  # a function_call_output came after the last user message


def _message_item(role: str, content: Any, param: str, item_id: str | None) -> dict[str, Any]:
    if role not in ("user", "assistant", "system", "developer"):
        raise BadRequest(f"Invalid '{param}.role': expected user, assistant, system or developer.",
                         param=f"{param}.role")
    if isinstance(content, str):
        part_type = "output_text" if role == "assistant" else "input_text"
        parts: list[Any] = [{"type": part_type, "text": content}]
    else:
        _parts_text(content, f"{param}.content")  # validates
        parts = content
    return {"id": item_id or _next_id("msg_"), "type": "message", "role": role, "content": parts,
            "status": "completed"}


def parse_input(raw: Any) -> ParsedInput:
    if isinstance(raw, str):
        return ParsedInput([_message_item("user", raw, "input", None)], _words(raw), raw, False)
    if not isinstance(raw, list):
        raise BadRequest("Invalid 'input': expected a string or an array of input items.", param="input")
    items: list[dict[str, Any]] = []
    tokens = 0
    last_user_text = ""
    after_tool_output = False
    for index, item in enumerate(raw):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise BadRequest(f"Invalid '{param}': expected an object.", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        item_id = item.get("id") if isinstance(item.get("id"), str) else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise BadRequest(f"Missing required parameter: '{param}.role'.", param=f"{param}.role")
            stored = _message_item(role, item.get("content"), param, item_id)
            text = _parts_text(item.get("content"), f"{param}.content")
            tokens += _words(text)
            if role == "user":
                last_user_text, after_tool_output = text, False
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise BadRequest(f"Invalid '{param}': a function_call needs name and arguments strings.",
                                 param=param)
            tokens += _words(item["name"]) + _words(item["arguments"])
            stored = {**item, "id": item_id or _next_id("fc_")}
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"Missing required parameter: '{param}.call_id'.", param=f"{param}.call_id")
            tokens += _words(output if isinstance(output, str) else _parts_text(output, f"{param}.output"))
            stored = {**item, "id": item_id or _next_id("fco_")}
            after_tool_output = True
        elif kind == "reasoning":
            summary = item.get("summary", [])
            tokens += _words(_parts_text(summary, f"{param}.summary"))
            stored = {**item, "id": item_id or _next_id("rs_")}
        elif isinstance(kind, str):
            # Other item types (item_reference, built-in tool calls...) carry no text the mock counts.
            stored = {**item, "id": item_id or _next_id("item_")}
        else:
            raise BadRequest(f"Missing required parameter: '{param}.type'.", param=f"{param}.type")
        items.append(stored)
    return ParsedInput(items, tokens, last_user_text, after_tool_output)


def _function_tools(tools: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(the tools as echoed back, the names of the function tools)."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise BadRequest("Invalid 'tools': expected an array.", param="tools")
    echoed: list[dict[str, Any]] = []
    names: list[str] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise BadRequest(f"Invalid 'tools[{index}]': expected an object with a type.",
                             param=f"tools[{index}]")
        if tool["type"] == "function":
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise BadRequest(f"Missing required parameter: 'tools[{index}].name'.",
                                 param=f"tools[{index}].name")
            names.append(tool["name"])
            echoed.append({"type": "function", "description": None, "parameters": None,
                           "strict": True, **tool})
        else:
            echoed.append(tool)
    return echoed, names


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return "auto", choice["name"]
    if isinstance(choice, dict):
        return "auto", None  # built-in tool choices: the mock calls no built-in tool
    raise BadRequest("Invalid 'tool_choice'.", param="tool_choice")


def _int_param(payload: dict[str, Any], name: str, minimum: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"Invalid '{name}': expected an integer >= {minimum}.", param=name)
    return value


def _conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and value["id"]:
        return value["id"]
    raise BadRequest("Invalid 'conversation': expected an id or {\"id\": ...}.", param="conversation")


def _not_found(response_id: str) -> BadRequest:
    return BadRequest(f"Response with id '{response_id}' not found.", status=404)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    """What one response says, decided before anything is sent."""

    input_tokens: int
    cached: int
    reasoning: int
    visible: int  # words of the text, or TOOL_CALL_TOKENS for a tool call
    tool_name: str | None
    capped: bool

    @property
    def output_tokens(self) -> int:
        return self.reasoning + self.visible

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            # Only cache reads: the Responses API reports no cache-write figure (OpenAI's prompt
            # cache writes cost the plain input price), so the cache_write_tokens fault is Messages' only.
            "input_tokens_details": {"cached_tokens": self.cached},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _reasoning_item(item_id: str) -> dict[str, Any]:
    # The reasoning itself stays hidden (as OpenAI's does without a summary request); only its
    # token count shows, in usage.
    return {"id": item_id, "type": "reasoning", "summary": []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class Built:
    """The final output items of a plan, with the ids the stream's events share."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.reasoning_id = _next_id("rs_") if plan.reasoning else None
        self.item_id = _next_id("fc_" if plan.tool_name else "msg_")
        self.call_id = _next_id("call_") if plan.tool_name else None
        self.text = "" if plan.tool_name else answer_text(plan.visible)
        self.status = "incomplete" if plan.capped else "completed"

    def output(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.reasoning_id:
            items.append(_reasoning_item(self.reasoning_id))
        if self.plan.tool_name:
            assert self.call_id is not None
            items.append(_function_call(self.item_id, self.call_id, self.plan.tool_name,
                                        TOOL_ARGUMENTS, "completed"))
        elif self.plan.visible or not self.plan.capped:
            items.append(_message(self.item_id, self.text, self.status))
        return items


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {_dumps(event)}\n\n".encode()


def _stream_events(built: Built, started: dict[str, Any], final: dict[str, Any]) -> list[tuple[bytes, int]]:
    """The Responses API's event sequence, each event with the tokens it carries."""
    events: list[tuple[dict[str, Any], int]] = [
        ({"type": "response.created", "response": started}, 0),
        ({"type": "response.in_progress", "response": started}, 0),
    ]
    plan = built.plan
    index = 0
    if built.reasoning_id:
        item = _reasoning_item(built.reasoning_id)
        # The hidden reasoning is generated with the item: the item carries its tokens.
        events.append(({"type": "response.output_item.added", "output_index": index, "item": item},
                       plan.reasoning))
        events.append(({"type": "response.output_item.done", "output_index": index, "item": item}, 0))
        index += 1
    if plan.tool_name:
        assert built.call_id is not None
        events.append(({"type": "response.output_item.added", "output_index": index,
                        "item": _function_call(built.item_id, built.call_id, plan.tool_name, "",
                                               "in_progress")}, 1))  # it carries the name
        for piece in TOOL_ARGUMENT_PIECES:
            events.append(({"type": "response.function_call_arguments.delta", "item_id": built.item_id,
                            "output_index": index, "delta": piece}, _words(piece)))
        events.append(({"type": "response.function_call_arguments.done", "item_id": built.item_id,
                        "output_index": index, "name": plan.tool_name, "arguments": TOOL_ARGUMENTS}, 0))
        events.append(({"type": "response.output_item.done", "output_index": index,
                        "item": _function_call(built.item_id, built.call_id, plan.tool_name,
                                               TOOL_ARGUMENTS, "completed")}, 0))
    elif plan.visible or not plan.capped:
        where = {"item_id": built.item_id, "output_index": index, "content_index": 0}
        events.append(({"type": "response.output_item.added", "output_index": index,
                        "item": _message(built.item_id, None, "in_progress")}, 0))
        events.append(({"type": "response.content_part.added", **where, "part": _text_part("")}, 0))
        for piece in _stream_pieces(plan.visible):
            events.append(({"type": "response.output_text.delta", **where, "delta": piece,
                            "logprobs": []}, 1))
        events.append(({"type": "response.output_text.done", **where, "text": built.text,
                        "logprobs": []}, 0))
        events.append(({"type": "response.content_part.done", **where, "part": _text_part(built.text)}, 0))
        events.append(({"type": "response.output_item.done", "output_index": index,
                        "item": _message(built.item_id, built.text, built.status)}, 0))
    closing = "response.incomplete" if plan.capped else "response.completed"
    events.append(({"type": closing, "response": final}, 0))
    return [(_sse({**event, "sequence_number": number}), tokens)
            for number, (event, tokens) in enumerate(events)]


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


def _bill(key_id: str, model: str, plan: Plan, output_tokens: int) -> None:
    ledger.record_completion(key_id, model, plan.input_tokens, output_tokens, cached=plan.cached,
                             reasoning=min(plan.reasoning, output_tokens))


async def create_response(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    model, faults = parse_faults(headers, _required_model(payload), key)
    assert model is not None
    key_id = api_key_id(key)
    raw_input = payload.get("input")
    previous_id = payload.get("previous_response_id")
    conversation_id = _conversation_id(payload.get("conversation"))
    if previous_id is not None and not (isinstance(previous_id, str) and previous_id):
        raise BadRequest("Invalid 'previous_response_id': expected a string.", param="previous_response_id")
    if previous_id and conversation_id:
        raise BadRequest("Mutually exclusive parameters: 'previous_response_id' and 'conversation'.",
                         param="previous_response_id")
    if raw_input is None and not previous_id and not conversation_id:
        raise BadRequest("Missing required parameter: 'input'.", param="input")
    parsed = parse_input(raw_input) if raw_input is not None else ParsedInput([], 0, "", False)
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("Invalid 'instructions': expected a string.", param="instructions")
    tools, names = _function_tools(payload.get("tools"))
    mode, forced = _tool_choice(payload.get("tool_choice"))
    cap = _int_param(payload, "max_output_tokens", 1)
    stream = payload.get("stream") is True
    background = payload.get("background") is True
    stored = payload.get("store", True) is not False
    if background and not stored:
        raise BadRequest("Background responses must be stored: 'store' cannot be false.", param="store")
    if background and stream:
        raise BadRequest("The mock upstream does not stream background responses.", param="stream")

    context = 0
    if previous_id:
        previous = store.get(key_id, previous_id)
        if previous is None or previous.body.get("status") not in ("completed", "incomplete"):
            raise BadRequest(f"Previous response with id '{previous_id}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
        context = previous.context
    elif conversation_id:
        context = store.context(key_id, conversation_id)
    input_tokens = (context + _words(instructions) + parsed.tokens
                    + (len(json.dumps(payload["tools"]).split()) if payload.get("tools") else 0))
    tool_name = None if parsed.after_tool_output else tool_rule(names, mode, forced, parsed.last_user_text)
    wanted = DEFAULT_OUTPUT_TOKENS if faults.output_tokens is None else faults.output_tokens
    if tool_name is not None:
        # Like chat: the cap does not cut a tool call, nor the reasoning before it.
        reasoning, visible, capped = faults.reasoning_tokens or 0, TOOL_CALL_TOKENS, False
    else:
        reasoning, visible, capped = split_output(wanted, faults.reasoning_tokens or 0, cap)
    cached = cached_part(faults, input_tokens)
    plan = Plan(input_tokens, cached, reasoning, visible, tool_name, capped)
    if await _apply_faults(faults, receive, send):
        return

    built = Built(plan)
    created = time.time()
    base: dict[str, Any] = {
        "id": _next_id("resp_"), "object": "response", "created_at": int(created),
        "status": "in_progress", "background": background, "completed_at": None, "error": None,
        "incomplete_details": None, "instructions": instructions, "max_output_tokens": cap,
        "max_tool_calls": payload.get("max_tool_calls"), "model": model, "output": [],
        "parallel_tool_calls": payload.get("parallel_tool_calls", True) is not False,
        "previous_response_id": previous_id,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": stored,
        "temperature": payload.get("temperature", 1.0), "text": {"format": {"type": "text"}},
        "tool_choice": payload.get("tool_choice", "auto"), "tools": tools,
        "top_p": payload.get("top_p", 1.0), "truncation": payload.get("truncation", "disabled"),
        "usage": None, "user": None, "metadata": payload.get("metadata") or {},
    }
    final = {**base, "status": "incomplete" if capped else "completed", "output": built.output(),
             "completed_at": int(time.time()), "usage": plan.usage(),
             "incomplete_details": {"reason": "max_output_tokens"} if capped else None}

    def finish() -> None:
        """The response exists: bill it, keep it, carry the conversation on."""
        _bill(key_id, model, plan, plan.output_tokens)
        if stored:
            store.put(key_id, StoredResponse(final, parsed.items, plan.input_tokens + plan.output_tokens))
        if conversation_id:
            store.set_conversation(key_id, conversation_id, plan.input_tokens + plan.output_tokens)

    if background:
        queued = {**base, "status": "queued"}
        entry = StoredResponse(queued, parsed.items, 0, background=True)
        store.put(key_id, entry)

        def complete() -> None:
            entry.timer = None
            entry.body = final
            entry.context = plan.input_tokens + plan.output_tokens
            _bill(key_id, model, plan, plan.output_tokens)
            if conversation_id:
                store.set_conversation(key_id, conversation_id, entry.context)

        # As long as a stream of the same answer would take.
        delay = faults.chunk_ms / 1000.0 * plan.output_tokens
        entry.timer = asyncio.get_running_loop().call_later(delay, complete)
        await send_json(send, 200, _dumps(queued).encode())
        return

    if not stream:
        finish()
        await _send_body(send, _dumps(final).encode(), faults)
        return

    events = _stream_events(built, base, final)
    assert sum(tokens for _, tokens in events) == plan.output_tokens

    def settle(sent: int) -> None:
        if sent == plan.output_tokens:
            finish()
        else:  # Cut or abandoned: what was sent is what was generated; nothing is kept.
            _bill(key_id, model, plan, sent)

    await stream_tokens(send, receive, faults, events, settle)


def _query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"))


async def response_item(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    """GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
    GET /v1/responses/{id}/input_items."""
    key = _bearer_key(headers)
    rest = scope["path"][len("/v1/responses/"):]
    response_id, _, sub = rest.partition("/")
    method = scope["method"]
    route = (method, sub)
    if route not in (("GET", ""), ("DELETE", ""), ("POST", "cancel"), ("GET", "input_items")):
        raise BadRequest(f"Invalid URL ({method} {scope['path']})", status=404, code="unknown_url")
    if method == "POST":
        await _read_body(receive)
    # Counted for the key, and its all-model faults apply: a broken key serves nothing.
    _, faults = parse_faults(headers, None, key)
    if await _apply_faults(faults, receive, send):
        return
    key_id = api_key_id(key)
    entry = store.get(key_id, response_id)
    if entry is None:
        raise _not_found(response_id)
    if route == ("GET", ""):
        await send_json(send, 200, _dumps(entry.body).encode())
    elif route == ("DELETE", ""):
        store.delete(key_id, response_id)
        if entry.timer is not None:
            entry.timer.cancel()
        await send_json(send, 200, _dumps({"id": response_id, "object": "response",
                                           "deleted": True}).encode())
    elif route == ("POST", "cancel"):
        if not entry.background:
            raise BadRequest("Only responses created with background=true can be cancelled.")
        if entry.timer is not None:
            # Cancelled before it finished: nothing was delivered, so nothing is billed.
            entry.timer.cancel()
            entry.timer = None
            entry.body = {**entry.body, "status": "cancelled"}
        await send_json(send, 200, _dumps(entry.body).encode())
    else:
        await send_json(send, 200, _dumps(_input_items_page(entry.input_items, _query(scope))).encode())


def _conversation_body(conversation_id: str, record: ConversationRecord) -> bytes:
    return _dumps({"id": conversation_id, "object": "conversation", "created_at": record.created_at,
                   "metadata": record.metadata}).encode()


def _metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise BadRequest("Invalid 'metadata': expected an object of string values.", param="metadata")
    return value


async def create_conversation(scope: Scope, receive: Receive, send: Send,
                              headers: RequestHeaders) -> None:
    """POST /v1/conversations {"items": [...], "metadata": {...}}: its items' words are the
    context of its first turn."""
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    items = payload.get("items")
    if items is not None and not isinstance(items, list):
        raise BadRequest("Invalid 'items': expected an array of input items.", param="items")
    parsed = parse_input(items) if items is not None else ParsedInput([], 0, "", False)
    metadata = _metadata(payload.get("metadata"))
    _, faults = parse_faults(headers, None, key)
    if await _apply_faults(faults, receive, send):
        return
    conversation_id = _next_id("conv_")
    record = ConversationRecord(parsed.tokens, int(time.time()), metadata)
    store.put_conversation(api_key_id(key), conversation_id, record)
    await send_json(send, 200, _conversation_body(conversation_id, record))


async def conversation_item(scope: Scope, receive: Receive, send: Send,
                            headers: RequestHeaders) -> None:
    """GET /v1/conversations/{id}, POST (update its metadata), DELETE."""
    key = _bearer_key(headers)
    conversation_id = scope["path"][len("/v1/conversations/"):]
    method = scope["method"]
    if "/" in conversation_id or not conversation_id:
        # Conversation items are not kept by the mock (only the context they add up to).
        raise BadRequest(f"Invalid URL ({method} {scope['path']})", status=404, code="unknown_url")
    metadata: dict[str, Any] | None = None
    if method == "POST":
        payload = await _read_json(receive)
        if payload is None:
            return
        metadata = _metadata(payload.get("metadata"))
    _, faults = parse_faults(headers, None, key)
    if await _apply_faults(faults, receive, send):
        return
    key_id = api_key_id(key)
    record = store.conversation(key_id, conversation_id)
    if record is None or record.created_at is None:
        raise BadRequest(f"Conversation with id '{conversation_id}' not found.", status=404)
    if method == "DELETE":
        store.delete_conversation(key_id, conversation_id)
        await send_json(send, 200, _dumps({"id": conversation_id, "object": "conversation.deleted",
                                           "deleted": True}).encode())
        return
    if metadata is not None:
        record.metadata = metadata
    await send_json(send, 200, _conversation_body(conversation_id, record))


def _input_items_page(items: list[dict[str, Any]], query: dict[str, list[str]]) -> dict[str, Any]:
    order = query.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise BadRequest("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(query.get("limit", ["20"])[-1])
    except ValueError:
        raise BadRequest("Invalid 'limit': expected an integer.", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("Invalid 'limit': expected 1..100.", param="limit")
    ordered = list(reversed(items)) if order == "desc" else list(items)
    after = query.get("after", [""])[-1]
    if after:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise BadRequest(f"Invalid 'after': no input item '{after}'.", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def _moderation_inputs(raw: Any) -> int:
    """How many results: one per string of a list of strings, else one (a string or parts)."""
    if isinstance(raw, str):
        return 1
    if isinstance(raw, list) and raw:
        if all(isinstance(item, str) for item in raw):
            return len(raw)
        if all(isinstance(item, dict) and isinstance(item.get("type"), str) for item in raw):
            return 1
    raise BadRequest("Invalid 'input': expected a string, an array of strings or of content parts.",
                     param="input")


async def moderations(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    requested = payload.get("model", MODERATION_MODEL)
    if not isinstance(requested, str) or not requested:
        raise BadRequest("Invalid 'model': expected a string.", param="model")
    model, faults = parse_faults(headers, requested, key)
    count = _moderation_inputs(payload.get("input"))
    if await _apply_faults(faults, receive, send):
        return
    result = {
        "flagged": False,
        "categories": dict.fromkeys(MODERATION_CATEGORIES, False),
        "category_scores": dict.fromkeys(MODERATION_CATEGORIES, MODERATION_SCORE),
        "category_applied_input_types": {name: ["text"] for name in MODERATION_CATEGORIES},
    }
    # Not billed: OpenAI's moderations are free, and the bill is the reconciliation source.
    await _send_body(send, _dumps({"id": _next_id("modr-"), "model": model,
                                   "results": [result] * count}).encode(), faults)


def register(routes: dict[str, dict[str, Handler]], prefix_routes: list[tuple[str, dict[str, Handler]]],
             resets: list[Callable[[], None]]) -> None:
    routes["/v1/responses"] = {"POST": create_response}
    routes["/v1/moderations"] = {"POST": moderations}
    routes["/v1/conversations"] = {"POST": create_conversation}
    prefix_routes.append(("/v1/responses/", {"GET": response_item, "DELETE": response_item,
                                             "POST": response_item}))
    prefix_routes.append(("/v1/conversations/", {"GET": conversation_item, "DELETE": conversation_item,
                                                 "POST": conversation_item}))
    resets.append(store.reset)


__all__ = ["MAX_STORED", "register", "store"]
