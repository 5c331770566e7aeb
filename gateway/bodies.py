"""Parsing and validating /v1 request bodies (chat completions, completions, embeddings).

Only what the gateway needs to meter is checked strictly (model, messages/prompt/input, output
caps, n, streaming options); every other field passes through untouched, so new OpenAI
parameters work without a gateway release. A bad body is a 400 naming the field, before any
reservation is made.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.conf import settings

from gateway.errors import bad_request
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
