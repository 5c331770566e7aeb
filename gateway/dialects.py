"""How each client API is spoken to the upstream and read back: one dialect per /v1 endpoint.

The forwarder (gateway/forward.py) is the same for every API: reserve, send, relay, settle. What
differs is here: the body sent upstream (the output cap the hold imposes, the stream's usage), the
upstream path and its authentication, where the usage is in an answer and in a stream, and which
text is output (counted when the usage never arrives). Adding an API is adding a dialect.

- OpenAI-compatible (chat completions, completions, embeddings): `usage.prompt_tokens` /
  `completion_tokens` (with `prompt_tokens_details.cached_tokens` and
  `completion_tokens_details.reasoning_tokens`); streams end with a usage chunk the gateway always
  asks for (`stream_options.include_usage`) and removes when the client did not ask for it.
- OpenAI Responses: `usage.input_tokens` (cached ones in `input_tokens_details.cached_tokens`),
  `output_tokens` (reasoning in `output_tokens_details.reasoning_tokens`); in streams the usage is
  in the terminal event (`response.completed`, `response.incomplete`, `response.failed`). The cap is
  `max_output_tokens`.
- Anthropic Messages: `usage.input_tokens` EXCLUDES cache reads and writes
  (`cache_read_input_tokens`, `cache_creation_input_tokens`), so the billed input is their sum;
  `output_tokens` includes extended thinking (`output_tokens_details.thinking_tokens`, its share);
  streams give the input side in `message_start` and the cumulative `output_tokens` in each
  `message_delta`. The cap is `max_tokens` (required); a thinking budget must stay below it.

Readers never raise on odd JSON: an answer that cannot be read is counted from its text.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.bodies import Endpoint, ParsedBody
from gateway.errors import Api
from gateway.models import ProviderKind
from gateway.usage import Usage, token_count

# The Messages API's version when the client names none (the SDKs always send one).
DEFAULT_ANTHROPIC_VERSION = "2023-06-01"
# Client headers passed on to an Anthropic upstream (the API's own versioning).
ANTHROPIC_PASSED_HEADERS = ("anthropic-version", "anthropic-beta")

OPENAI_KIND = ProviderKind.OPENAI.value
ANTHROPIC_KIND = ProviderKind.ANTHROPIC.value


_count = token_count


def _int(value: Any) -> int:
    """A token count, 0 when absent or nonsense."""
    return token_count(value) or 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _event_data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an SSE event's data lines, None when there is none."""
    payload = b"".join(line[5:].strip() for line in event.split(b"\n")
                       if line.startswith(b"data:"))
    if not payload or payload == b"[DONE]":
        return None
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return ""


# -- OpenAI-compatible (chat completions, completions, embeddings) ------------------------------


def openai_usage(usage: Any) -> Usage | None:
    """Chat / completions / embeddings usage; None when absent or nonsense (then the text is
    counted instead)."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens", 0))
    if prompt is None or completion is None:
        return None  # nonsense from the upstream: count what we saw instead
    cached = _int(_dict(usage.get("prompt_tokens_details")).get("cached_tokens"))
    reasoning = _int(_dict(usage.get("completion_tokens_details")).get("reasoning_tokens"))
    return Usage.of(prompt, completion, cached=cached, reasoning=reasoning)


def _content_text(content: Any) -> str:
    """The text of a message's `content`: a string, or a list of content parts (`{"type":
    "text", "text": ...}`, `output_text`, `refusal`, or bare strings); other parts (images,
    audio) carry no text we can count."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            for name in ("text", "refusal"):
                value = part.get(name)
                if isinstance(value, str):
                    texts.append(value)
    return "".join(texts)


def openai_text(endpoint: Endpoint, data: dict[str, Any]) -> str:
    """The output text of a chat / completions answer or stream chunk."""
    choices = data.get("choices")
    if not isinstance(choices, list):
        return ""
    parts: list[str] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if endpoint is not Endpoint.CHAT:
            parts.append(_str(choice.get("text")))
            continue
        message = choice.get("message") or choice.get("delta")
        if not isinstance(message, dict):
            continue
        parts.append(_content_text(message.get("content")))
        # Also billed as output: a refusal, and the reasoning text some servers stream.
        for name in ("refusal", "reasoning_content", "reasoning"):
            parts.append(_str(message.get(name)))
        calls = message.get("tool_calls")
        functions = [call.get("function") for call in calls if isinstance(call, dict)] \
            if isinstance(calls, list) else []
        functions.append(message.get("function_call"))  # the legacy single call
        for function in functions:
            if isinstance(function, dict):
                parts.append(_str(function.get("name")))
                parts.append(_str(function.get("arguments")))
    return "".join(parts)


def _openai_cap_field(endpoint: Endpoint, model: str, body: dict[str, Any]) -> str:
    """The field that caps output upstream: the one the client used; else `max_tokens`, which
    every OpenAI-compatible server knows, except for OpenAI's reasoning models (o1, o3, ...),
    which accept only `max_completion_tokens`."""
    if endpoint is not Endpoint.CHAT:
        return "max_tokens"
    if "max_completion_tokens" in body:
        return "max_completion_tokens"
    if "max_tokens" in body:
        return "max_tokens"
    reasoning = len(model) > 1 and model[0] == "o" and model[1].isdigit()
    return "max_completion_tokens" if reasoning else "max_tokens"


# -- OpenAI Responses ----------------------------------------------------------------------------


def responses_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    input_tokens = _count(usage.get("input_tokens"))
    output_tokens = _count(usage.get("output_tokens"))
    if input_tokens is None or output_tokens is None:
        return None
    cached = _int(_dict(usage.get("input_tokens_details")).get("cached_tokens"))
    reasoning = _int(_dict(usage.get("output_tokens_details")).get("reasoning_tokens"))
    return Usage.of(input_tokens, output_tokens, cached=cached, reasoning=reasoning)


def _responses_item_text(item: Any) -> str:
    """The output text of one Responses output item (message, function call, reasoning, ...)."""
    if not isinstance(item, dict):
        return ""
    parts = [_content_text(item.get("content")), _str(item.get("arguments"))]
    if item.get("type") in ("function_call", "custom_tool_call", "mcp_call"):
        parts.append(_str(item.get("name")))
        parts.append(_str(item.get("input")))
    summary = item.get("summary")
    for entry in summary if isinstance(summary, list) else ():
        if isinstance(entry, dict):
            parts.append(_str(entry.get("text")))
    return "".join(parts)


def responses_text(data: dict[str, Any]) -> str:
    output = data.get("output")
    if not isinstance(output, list):
        return ""
    return "".join(_responses_item_text(item) for item in output)


# Stream events whose `delta` is output text (text, refusals, tool arguments, reasoning).
_RESPONSES_DELTA_SUFFIXES = (".delta",)
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def responses_event_text(data: dict[str, Any]) -> str:
    kind = _str(data.get("type"))
    if kind.endswith(_RESPONSES_DELTA_SUFFIXES) and kind.startswith("response."):
        return _json_text(data.get("delta"))
    if kind == "response.output_item.added":
        item = _dict(data.get("item"))
        if item.get("type") in ("function_call", "custom_tool_call", "mcp_call"):
            return _str(item.get("name"))
    return ""


# -- Anthropic Messages --------------------------------------------------------------------------


@dataclass(frozen=True)
class _InputSide:
    """What a Messages call's input cost, from the usage's input fields."""

    uncached: int
    cache_read: int
    cache_write: int

    @property
    def total(self) -> int:
        return self.uncached + self.cache_read + self.cache_write


def _anthropic_input(usage: dict[str, Any]) -> _InputSide | None:
    if _count(usage.get("input_tokens")) is None:
        return None
    return _InputSide(_int(usage.get("input_tokens")), _int(usage.get("cache_read_input_tokens")),
                      _int(usage.get("cache_creation_input_tokens")))


def _anthropic_usage(side: _InputSide, output_tokens: int, thinking: int = 0) -> Usage:
    return Usage.of(side.total, output_tokens, cached=side.cache_read,
                    cache_write=side.cache_write, reasoning=thinking)


def _thinking(usage: dict[str, Any]) -> int:
    """Extended thinking's share of output_tokens (`output_tokens_details.thinking_tokens`)."""
    return _int(_dict(usage.get("output_tokens_details")).get("thinking_tokens"))


def messages_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict) or _count(usage.get("output_tokens")) is None:
        return None
    side = _anthropic_input(usage)
    if side is None:
        return None
    return _anthropic_usage(side, usage["output_tokens"], _thinking(usage))


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    parts = [_str(block.get(name)) for name in ("text", "thinking", "name")]
    if block.get("type") in ("tool_use", "server_tool_use"):
        parts.append(_json_text(block.get("input")))
    return "".join(parts)


def messages_text(data: dict[str, Any]) -> str:
    content = data.get("content")
    if not isinstance(content, list):
        return ""
    return "".join(_block_text(block) for block in content)


def messages_event_text(data: dict[str, Any]) -> str:
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = _dict(data.get("delta"))
        return "".join(_str(delta.get(name)) for name in ("text", "partial_json", "thinking"))
    if kind == "content_block_start":
        return _block_text(data.get("content_block"))
    return ""


# -- stream readers ------------------------------------------------------------------------------


class StreamReader:
    """Reads one upstream stream event by event: the usage when it comes, which events may
    carry output text (parsed only when needed: for a checkpoint or a settle without usage),
    and the answer's id. `inspect` returns the event to send to the client (None: drop it)."""

    __slots__ = ("usage", "response_id", "text_events")

    def __init__(self) -> None:
        self.usage: Usage | None = None  # the upstream's final figures
        self.response_id: str | None = None
        self.text_events: list[bytes] = []

    def inspect(self, event: bytes) -> bytes | None:
        raise NotImplementedError

    def event_text(self, data: dict[str, Any]) -> str:
        raise NotImplementedError

    def known(self, prompt_estimate: int, counted_output: int, worst_output: int) -> Usage:
        """The usage of a stream that ended without its final figures: what the upstream told
        so far, else the input estimate and the output counted from the text relayed.
        `worst_output`: the most output the hold allows (what is charged when the stream shows
        output was produced that its text does not: hidden reasoning)."""
        return Usage(prompt_estimate, counted_output)


class OpenAIStreamReader(StreamReader):
    __slots__ = ("endpoint", "include_usage")

    def __init__(self, endpoint: Endpoint, include_usage: bool) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.include_usage = include_usage

    def inspect(self, event: bytes) -> bytes | None:
        if b'"usage"' not in event or b'"usage":null' in event:
            self.text_events.append(event)
            return event
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            try:
                data = json.loads(payload)
            except ValueError:
                return event
            if not isinstance(data, dict):
                return event
            usage = openai_usage(data.get("usage"))
            if usage is not None:
                self.usage = usage
            if self.include_usage:
                if data.get("choices"):
                    self.text_events.append(event)  # counted if the usage never arrives
                return event
            if not data.get("choices"):
                return None  # the extra usage chunk the client did not ask for
            data.pop("usage", None)
            self.text_events.append(event)
            return b"data: " + json.dumps(data, separators=(",", ":")).encode()
        return event

    def event_text(self, data: dict[str, Any]) -> str:
        return openai_text(self.endpoint, data)


class ResponsesStreamReader(StreamReader):
    __slots__ = ("reasoning_seen",)

    def __init__(self) -> None:
        super().__init__()
        # A reasoning item started: the model produced reasoning tokens that the stream does
        # not show (only a summary, if asked), so a cut stream's text undercounts its output.
        self.reasoning_seen = False

    def inspect(self, event: bytes) -> bytes | None:
        if not self.reasoning_seen and b'"reasoning"' in event \
                and b"response.output_item.added" in event:
            data = _event_data(event)
            if data is not None and _dict(data.get("item")).get("type") == "reasoning":
                self.reasoning_seen = True
        if b"response.c" in event or b"response.incomplete" in event \
                or b"response.failed" in event:
            data = _event_data(event)
            kind = data.get("type") if data is not None else None
            if kind == "response.created" or kind in _RESPONSES_TERMINAL:
                response = _dict(data.get("response"))  # type: ignore[union-attr]
                self.response_id = _str(response.get("id")) or self.response_id
                usage = responses_usage(response.get("usage"))
                if usage is not None and kind in _RESPONSES_TERMINAL:
                    self.usage = usage
                return event
        self.text_events.append(event)
        return event

    def event_text(self, data: dict[str, Any]) -> str:
        return responses_event_text(data)

    def known(self, prompt_estimate: int, counted_output: int, worst_output: int) -> Usage:
        if not self.reasoning_seen:
            return Usage(prompt_estimate, counted_output)
        # How much it reasoned is told only by the terminal event: charge the most the hold
        # allows, the cap the upstream was given (reasoning counts inside max_output_tokens).
        output = max(counted_output, worst_output)
        return Usage.of(prompt_estimate, output, reasoning=output - counted_output)


class MessagesStreamReader(StreamReader):
    __slots__ = ("input_side", "output_seen", "thinking_seen")

    def __init__(self) -> None:
        super().__init__()
        self.input_side: _InputSide | None = None  # from message_start
        self.output_seen = 0  # the latest cumulative output_tokens
        self.thinking_seen = 0  # of which thinking, when the upstream tells it

    def inspect(self, event: bytes) -> bytes | None:
        if b"message_start" in event or b"message_delta" in event:
            data = _event_data(event) or {}
            kind = data.get("type")
            if kind == "message_start":
                message = _dict(data.get("message"))
                self.response_id = _str(message.get("id")) or None
                # Only the input side: message_start's output_tokens is a placeholder (1),
                # not tokens produced; message_delta's cumulative figure is the count.
                self.input_side = _anthropic_input(_dict(message.get("usage")))
                return event
            if kind == "message_delta":
                usage = _dict(data.get("usage"))
                # Newer versions repeat the input side here, cumulative like the output: merged
                # field by field, so a delta that leaves a cache field out keeps message_start's.
                side = _anthropic_input(usage)
                if side is not None:
                    start = self.input_side or _InputSide(0, 0, 0)
                    self.input_side = _InputSide(max(start.uncached, side.uncached),
                                                 max(start.cache_read, side.cache_read),
                                                 max(start.cache_write, side.cache_write))
                self.output_seen = max(self.output_seen, _int(usage.get("output_tokens")))
                self.thinking_seen = max(self.thinking_seen, _thinking(usage))
                if self.input_side is not None and _count(usage.get("output_tokens")) is not None:
                    self.usage = _anthropic_usage(self.input_side, self.output_seen,
                                                  self.thinking_seen)
                return event
        self.text_events.append(event)
        return event

    def event_text(self, data: dict[str, Any]) -> str:
        return messages_event_text(data)

    def known(self, prompt_estimate: int, counted_output: int, worst_output: int) -> Usage:
        output = max(self.output_seen, counted_output)
        if self.input_side is None:
            return Usage.of(prompt_estimate, output, reasoning=self.thinking_seen)
        return _anthropic_usage(self.input_side, output, self.thinking_seen)


# -- dialects ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    """One client API as the forwarder speaks it upstream."""

    api: Api  # the error shape and rate headers the client expects
    provider_kind: str  # the provider keys that serve it (gateway.models.ProviderKind)
    # Its answers may be stored upstream and continued later (the Responses API): remembered
    # by gateway/responses_context.py. Other APIs never pay for it.
    remembers: bool = False
    # Its upstream is told some of the client's headers (passed_headers): only then does the
    # view read them all (Django builds request.headers from the whole of META on first use).
    passes_headers: bool = False

    def payload(self, parsed: ParsedBody, model: str, cap: int | None) -> bytes:
        """The body sent upstream: the client's, with the model forwarded and the output cap
        the hold allows (None: the client's own cap stands)."""
        raise NotImplementedError

    def upstream_headers(self, secret: str, client: Mapping[str, str]) -> dict[str, str]:
        return {"Authorization": f"Bearer {secret}"}

    def passed_headers(self, client: Mapping[str, str]) -> dict[str, str]:
        """The client's request headers this API's upstream is told (upstream_headers' `client`)."""
        return {}

    def answer_usage(self, data: dict[str, Any]) -> Usage | None:
        raise NotImplementedError

    def answer_text(self, parsed: ParsedBody, data: dict[str, Any]) -> str:
        raise NotImplementedError

    def answer_id(self, data: dict[str, Any]) -> str | None:
        return None

    def stream_reader(self, parsed: ParsedBody) -> StreamReader:
        raise NotImplementedError


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True)
class OpenAICompatible(Dialect):
    def payload(self, parsed: ParsedBody, model: str, cap: int | None) -> bytes:
        body = dict(parsed.body)
        body["model"] = model
        if cap is not None:
            name = _openai_cap_field(parsed.endpoint, model, body)
            body.pop("max_tokens", None)
            body[name] = cap
        if parsed.stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return _dump(body)

    def answer_usage(self, data: dict[str, Any]) -> Usage | None:
        return openai_usage(data.get("usage"))

    def answer_text(self, parsed: ParsedBody, data: dict[str, Any]) -> str:
        return openai_text(parsed.endpoint, data)

    def stream_reader(self, parsed: ParsedBody) -> StreamReader:
        return OpenAIStreamReader(parsed.endpoint, parsed.include_usage)


@dataclass(frozen=True)
class Responses(Dialect):
    def payload(self, parsed: ParsedBody, model: str, cap: int | None) -> bytes:
        body = dict(parsed.body)
        body["model"] = model
        if cap is not None:
            body["max_output_tokens"] = cap
        return _dump(body)

    def answer_usage(self, data: dict[str, Any]) -> Usage | None:
        return responses_usage(data.get("usage"))

    def answer_text(self, parsed: ParsedBody, data: dict[str, Any]) -> str:
        return responses_text(data)

    def answer_id(self, data: dict[str, Any]) -> str | None:
        return _str(data.get("id")) or None

    def stream_reader(self, parsed: ParsedBody) -> StreamReader:
        return ResponsesStreamReader()


@dataclass(frozen=True)
class Messages(Dialect):
    def payload(self, parsed: ParsedBody, model: str, cap: int | None) -> bytes:
        body = dict(parsed.body)
        body["model"] = model
        if cap is not None:
            body["max_tokens"] = cap
            thinking = body.get("thinking")
            if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) \
                    and thinking["budget_tokens"] >= cap:
                # The thinking budget counts inside max_tokens and must stay below it: a hold
                # shrunk to the headroom shrinks the budget with it (admission never shrinks
                # such a call below the smallest budget the API accepts plus one).
                body["thinking"] = {**thinking, "budget_tokens": cap - 1}
        return _dump(body)

    def passed_headers(self, client: Mapping[str, str]) -> dict[str, str]:
        return {name: client[name] for name in ANTHROPIC_PASSED_HEADERS if name in client}

    def upstream_headers(self, secret: str, client: Mapping[str, str]) -> dict[str, str]:
        headers = {"x-api-key": secret,
                   "anthropic-version": client.get("anthropic-version")
                   or DEFAULT_ANTHROPIC_VERSION}
        beta = client.get("anthropic-beta")
        if beta:
            headers["anthropic-beta"] = beta
        return headers

    def answer_usage(self, data: dict[str, Any]) -> Usage | None:
        return messages_usage(data.get("usage"))

    def answer_text(self, parsed: ParsedBody, data: dict[str, Any]) -> str:
        return messages_text(data)

    def answer_id(self, data: dict[str, Any]) -> str | None:
        return _str(data.get("id")) or None

    def stream_reader(self, parsed: ParsedBody) -> StreamReader:
        return MessagesStreamReader()


_OPENAI = OpenAICompatible(Api.OPENAI, OPENAI_KIND)
DIALECTS: dict[Endpoint, Dialect] = {
    Endpoint.CHAT: _OPENAI,
    Endpoint.COMPLETIONS: _OPENAI,
    Endpoint.EMBEDDINGS: _OPENAI,
    Endpoint.RESPONSES: Responses(Api.OPENAI, OPENAI_KIND, remembers=True),
    Endpoint.MESSAGES: Messages(Api.ANTHROPIC, ANTHROPIC_KIND, passes_headers=True),
}


def dialect_for(endpoint: Endpoint) -> Dialect:
    return DIALECTS[endpoint]


def provider_kind(endpoint: Endpoint) -> str:
    """Which provider keys serve calls of this endpoint."""
    return DIALECTS[endpoint].provider_kind
