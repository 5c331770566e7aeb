"""The mock upstream as a bare ASGI callable; see the package docstring for the behaviour."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import math
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send, "RequestHeaders"], Awaitable[None]]

MODELS: tuple[str, ...] = (
    "gpt-4o",
    "gpt-4o-mini",
    "gpt-4.1",
    "gpt-4.1-mini",
    "gpt-3.5-turbo",
    "gpt-3.5-turbo-instruct",
    "text-embedding-3-small",
    "text-embedding-3-large",
)
DEFAULT_OUTPUT_TOKENS = 16
MAX_OUTPUT_TOKENS = 100_000
DEFAULT_EMBEDDING_DIMENSIONS = 8
MAX_EMBEDDING_DIMENSIONS = 4096
MAX_BODY_BYTES = 32 * 1024 * 1024
# Far longer than any client timeout, yet finite so a forgotten connection does not pin a task forever.
HANG_SECONDS = 3600.0
DAY = 86_400
# Common English words that are one token each (with their leading space) in cl100k/o200k, so a
# gateway that falls back to counting received text with tiktoken lands near completion_tokens.
WORD_CYCLE: tuple[str, ...] = (
    "mock", "reply", "the", "quick", "brown", "fox", "jumps", "over",
    "a", "lazy", "dog", "and", "runs", "back", "home", "again",
)
TOOL_ARGUMENT_PIECES: tuple[str, ...] = ('{"city":', ' "Paris"}')
TOOL_ARGUMENTS = "".join(TOOL_ARGUMENT_PIECES)
# The function name counts as one completion token, plus one per argument word.
TOOL_CALL_TOKENS = 1 + len(TOOL_ARGUMENTS.split())

_ID_PREFIX = os.urandom(3).hex()
_ids = itertools.count(1)
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _next_id(kind: str) -> str:
    # A counter is far cheaper than uuid4 and the random prefix keeps workers apart.
    return f"{kind}{_ID_PREFIX}{next(_ids):010x}"


class BadRequest(Exception):
    """A client error, answered in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code


# ---------------------------------------------------------------------------------------------
# Usage ledger (the "bill")
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=65_536)
def api_key_id(key: str) -> str:
    """The stable id the bill reports for a bearer key (never the key itself)."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]


class UsageLedger:
    """Token usage per (UTC day, api_key_id, model), kept in this process's memory.

    A lock because tests may run the server in a thread and read the ledger from another one;
    uncontended it costs well under a microsecond.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (day_start, key_id, model) -> [input_tokens, output_tokens, requests, input_cached_tokens,
        # input_cache_write_tokens, output_reasoning_tokens]; the classes are PART of the totals.
        self.completions: dict[tuple[int, str, str], list[int]] = {}
        # (day_start, key_id, model) -> [input_tokens, requests]
        self.embeddings: dict[tuple[int, str, str], list[int]] = {}

    def record_completion(self, key_id: str, model: str, prompt: int, completion: int,
                          now: float | None = None, cached: int = 0, cache_write: int = 0,
                          reasoning: int = 0) -> None:
        """`prompt` is ALL input (cached reads and cache writes included), `completion` ALL output
        (reasoning included); the three classes say how much of them was of each kind."""
        day = int(time.time() if now is None else now) // DAY * DAY
        with self._lock:
            row = self.completions.get((day, key_id, model))
            if row is None:
                self.completions[(day, key_id, model)] = [prompt, completion, 1, cached, cache_write,
                                                          reasoning]
            else:
                row[0] += prompt
                row[1] += completion
                row[2] += 1
                row[3] += cached
                row[4] += cache_write
                row[5] += reasoning

    def record_embedding(self, key_id: str, model: str, prompt: int, now: float | None = None) -> None:
        day = int(time.time() if now is None else now) // DAY * DAY
        with self._lock:
            row = self.embeddings.get((day, key_id, model))
            if row is None:
                self.embeddings[(day, key_id, model)] = [prompt, 1]
            else:
                row[0] += prompt
                row[1] += 1

    def reset(self) -> None:
        with self._lock:
            self.completions.clear()
            self.embeddings.clear()

    def totals(self) -> dict[str, list[dict[str, Any]]]:
        """All days summed, per (api_key_id, model): the shape of GET /mock/usage."""
        completions: dict[tuple[str, str], list[int]] = {}
        embeddings: dict[tuple[str, str], list[int]] = {}
        with self._lock:
            for (_, key_id, model), values in self.completions.items():
                acc = completions.setdefault((key_id, model), [0] * len(values))
                for i, value in enumerate(values):
                    acc[i] += value
            for (_, key_id, model), (inp, req) in self.embeddings.items():
                acc = embeddings.setdefault((key_id, model), [0, 0])
                acc[0] += inp
                acc[1] += req
        return {
            "completions": [
                {"api_key_id": k, "model": m, "prompt_tokens": i, "completion_tokens": o,
                 "total_tokens": i + o, "requests": r, "input_cached_tokens": ci,
                 "input_cache_write_tokens": cw, "output_reasoning_tokens": rs}
                for (k, m), (i, o, r, ci, cw, rs) in sorted(completions.items())
            ],
            "embeddings": [
                {"api_key_id": k, "model": m, "prompt_tokens": i, "total_tokens": i, "requests": r}
                for (k, m), (i, r) in sorted(embeddings.items())
            ],
        }

    def rows(self, kind: str) -> list[tuple[int, str, str, list[int]]]:
        with self._lock:
            source = self.completions if kind == "completions" else self.embeddings
            return [(day, key_id, model, list(values)) for (day, key_id, model), values in source.items()]


ledger = UsageLedger()


# ---------------------------------------------------------------------------------------------
# Requests: headers, faults, body
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestHeaders:
    authorization: bytes | None
    mock: dict[bytes, bytes]
    # Anthropic's Messages API: the key travels in x-api-key, and these two are required/passed.
    api_key: bytes | None = None
    anthropic_version: bytes | None = None
    anthropic_beta: bytes | None = None


@dataclass(slots=True)
class Faults:
    first_byte_ms: float = 0.0
    chunk_ms: float = 0.0
    status: int | None = None
    retry_after: str | None = None
    cut_after: int | None = None
    hang: bool = False
    output_tokens: int | None = None
    leaky: bool = False  # an injected 4xx's message names an organisation, deployment and URL
    reset: bool = False  # drop the connection after reading the request, before any answer
    # Token classes: how many of the input tokens were cache reads / cache writes, and how many
    # of the output tokens were reasoning (each within the total it is part of).
    cached_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None


_HEADER_FAULTS: dict[bytes, str] = {
    b"x-mock-first-byte-ms": "first_byte_ms",
    b"x-mock-chunk-ms": "chunk_ms",
    b"x-mock-status": "status",
    b"x-mock-retry-after": "retry_after",
    b"x-mock-cut-after": "cut_after",
    b"x-mock-hang": "hang",
    b"x-mock-output-tokens": "output_tokens",
    b"x-mock-leaky": "leaky",
    b"x-mock-reset": "reset",
    b"x-mock-cached-tokens": "cached_tokens",
    b"x-mock-cache-read-tokens": "cache_read_tokens",
    b"x-mock-cache-write-tokens": "cache_write_tokens",
    b"x-mock-reasoning-tokens": "reasoning_tokens",
}
_MODEL_FAULTS: dict[str, str] = {
    "first_byte_ms": "first_byte_ms",
    "chunk_ms": "chunk_ms",
    "status": "status",
    "retry_after": "retry_after",
    "cut": "cut_after",
    "cut_after": "cut_after",
    "hang": "hang",
    "output_tokens": "output_tokens",
    "leaky": "leaky",
    "reset": "reset",
    "cached_tokens": "cached_tokens",
    "cache_read_tokens": "cache_read_tokens",
    "cache_write_tokens": "cache_write_tokens",
    "reasoning_tokens": "reasoning_tokens",
}
_TOKEN_CLASS_FAULTS = ("cached_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")


def _set_fault(faults: Faults, field: str, raw: str, source: str) -> None:
    try:
        if field in ("first_byte_ms", "chunk_ms"):
            value = float(raw)
            if not math.isfinite(value) or value < 0:
                raise ValueError
            setattr(faults, field, value)
        elif field == "status":
            status = int(raw)
            if not 400 <= status <= 599:
                raise ValueError
            faults.status = status
        elif field == "retry_after":
            if float(raw) < 0:
                raise ValueError
            faults.retry_after = raw
        elif field == "cut_after":
            cut = int(raw)
            if cut < 0:
                raise ValueError
            faults.cut_after = cut
        elif field in ("hang", "leaky", "reset"):
            setattr(faults, field, raw.lower() not in ("0", "false", "no", "off"))
        elif field == "output_tokens" or field in _TOKEN_CLASS_FAULTS:
            tokens = int(raw)
            if not 0 <= tokens <= MAX_OUTPUT_TOKENS:
                raise ValueError
            setattr(faults, field, tokens)
    except ValueError:
        raise BadRequest(f"Invalid mock fault value {raw!r} for {source}.", param="model") from None


class KeyFaults:
    """Faults set through POST /mock/faults for one bearer key (all models, or one), and the
    inference requests each key sent (GET /mock/faults), so tests can make one provider key fail
    while another serves, then heal it. Kept by api_key_id, never the key itself."""

    ANY_MODEL = "*"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.faults: dict[tuple[str, str], dict[str, str]] = {}
        self.requests: dict[str, int] = {}

    def set(self, key_id: str, model: str, fields: dict[str, str]) -> None:
        with self._lock:
            if fields:
                self.faults[(key_id, model)] = fields
            else:
                self.faults.pop((key_id, model), None)

    def count(self, key_id: str) -> None:
        with self._lock:
            self.requests[key_id] = self.requests.get(key_id, 0) + 1

    def applying(self, key_id: str, model: str) -> list[dict[str, str]]:
        """The faults for this key: all-model ones first, then the model's (which win)."""
        if not self.faults:
            return []
        with self._lock:
            found = [self.faults.get((key_id, self.ANY_MODEL)), self.faults.get((key_id, model))]
        return [fields for fields in found if fields]

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.requests.clear()

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"faults": [{"api_key_id": key_id, "model": model, "faults": fields}
                               for (key_id, model), fields in sorted(self.faults.items())],
                    "requests": dict(self.requests)}


key_faults = KeyFaults()


def parse_faults(headers: RequestHeaders, model: str | None,
                 key: str | None = None) -> tuple[str | None, Faults]:
    """Faults from X-Mock-* headers, then from `model@opt=value` suffixes, then those set for the
    bearer `key` through POST /mock/faults (each later source wins). Counts the key's request."""
    faults = Faults()
    for name, value in headers.mock.items():
        field = _HEADER_FAULTS.get(name)
        if field is None:
            raise BadRequest(f"Unknown mock header {name.decode('latin-1')!r}.")
        _set_fault(faults, field, value.decode("latin-1").strip(), name.decode("latin-1"))
    base = model
    if model is not None and "@" in model:
        base, *options = model.split("@")
        for option in options:
            name, sep, raw = option.partition("=")
            field = _MODEL_FAULTS.get(name)
            if field is None or (not sep and field not in ("hang", "leaky", "reset")):
                raise BadRequest(f"Unknown mock model option {option!r} in {model!r}.",
                                 param="model")
            _set_fault(faults, field, raw if sep else "1", f"model option {name!r}")
        if not base:
            raise BadRequest("The model name before '@' is empty.", param="model")
    if key is not None:
        key_id = api_key_id(key)
        key_faults.count(key_id)
        for fields in key_faults.applying(key_id, base or KeyFaults.ANY_MODEL):
            for field, raw in fields.items():
                _set_fault(faults, field, raw, f"fault {field!r} of {key_id}")
    return base, faults


def _parse_headers(scope: Scope) -> RequestHeaders:
    authorization: bytes | None = None
    api_key: bytes | None = None
    anthropic_version: bytes | None = None
    anthropic_beta: bytes | None = None
    mock: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value
        elif name.startswith(b"x-mock-"):
            mock[name] = value
        elif name == b"x-api-key":
            api_key = value
        elif name == b"anthropic-version":
            anthropic_version = value
        elif name == b"anthropic-beta":
            anthropic_beta = value
    return RequestHeaders(authorization, mock, api_key, anthropic_version, anthropic_beta)


def _bearer_key(headers: RequestHeaders) -> str:
    raw = headers.authorization
    if raw is None:
        raise BadRequest(
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            status=401,
        )
    scheme, _, key = raw.decode("latin-1").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise BadRequest("Incorrect API key provided.", status=401, code="invalid_api_key")
    return key


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest("Request body too large.", status=413)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _read_json(receive: Receive) -> dict[str, Any] | None:
    body = await _read_body(receive)
    if body is None:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
            "using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ) from None
    if not isinstance(payload, dict):
        raise BadRequest("The request body must be a JSON object.")
    return payload


def _required_model(payload: dict[str, Any]) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")
    return model


def _output_budget(payload: dict[str, Any], faults: Faults) -> tuple[int, int | None]:
    """(words the model wants to say, the client's max_tokens cap or None)."""
    cap: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = payload.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"Invalid '{name}': expected an integer >= 1.", param=name)
        cap = value
        break
    wanted = DEFAULT_OUTPUT_TOKENS if faults.output_tokens is None else faults.output_tokens
    return wanted, cap


def _emitted(wanted: int, cap: int | None) -> tuple[int, str]:
    if cap is not None and cap < wanted:
        return cap, "length"
    return wanted, "stop"


def split_output(wanted: int, reasoning: int, cap: int | None) -> tuple[int, int, bool]:
    """(reasoning tokens, visible tokens, cut by the cap): the model reasons first, so the cap
    eats into the visible answer before the reasoning."""
    if cap is None:
        return reasoning, wanted, False
    kept_reasoning = min(reasoning, cap)
    visible = min(wanted, cap - kept_reasoning)
    return kept_reasoning, visible, kept_reasoning + visible < reasoning + wanted


def cached_part(faults: Faults, total_input: int) -> int:
    """Cached input tokens by the `cached_tokens` fault, within the input they are part of."""
    return min(faults.cached_tokens or 0, total_input)


# ---------------------------------------------------------------------------------------------
# Token counting and generated content
# ---------------------------------------------------------------------------------------------


def _words(text: Any) -> int:
    return len(text.split()) if isinstance(text, str) else 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"] for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def count_chat_prompt(messages: list[Any], tools: Any) -> int:
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("Each message must be an object.", param="messages")
        content = message.get("content")
        total += _words(content) if isinstance(content, str) else _words(_content_text(content))
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            for call in tool_calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    total += _words(function.get("name")) + _words(function.get("arguments"))
    if tools:
        total += len(json.dumps(tools).split())
    return total


def _prompt_items(value: Any, param: str) -> list[int]:
    """Token count of each input of /v1/completions or /v1/embeddings (str, [str], [int], [[int]])."""
    if isinstance(value, str):
        return [_words(value)]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [len(value)]
        counts: list[int] = []
        for item in value:
            if isinstance(item, str):
                counts.append(_words(item))
            elif isinstance(item, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in item):
                counts.append(len(item))
            else:
                raise BadRequest(f"Invalid '{param}': expected a string, a list of strings, "
                                 "a token array or a list of token arrays.", param=param)
        return counts
    raise BadRequest(f"'{param}' is required: a non-empty string, list of strings or token arrays.",
                     param=param)


@lru_cache(maxsize=1024)
def answer_words(n: int) -> tuple[str, ...]:
    """The first n generated words; each stream chunk carries one (with its leading space)."""
    return tuple(itertools.islice(itertools.cycle(WORD_CYCLE), n))


@lru_cache(maxsize=1024)
def answer_text(n: int) -> str:
    return " ".join(answer_words(n))


@lru_cache(maxsize=1024)
def _stream_pieces(n: int) -> tuple[str, ...]:
    words = answer_words(n)
    return tuple(word if i == 0 else " " + word for i, word in enumerate(words))


def _last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


def _tool_to_call(payload: dict[str, Any], messages: list[Any]) -> str | None:
    """The function name to call, or None to answer with text."""
    tools = payload.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    names = [
        tool["function"]["name"] for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    ]
    if not names:
        raise BadRequest("Each tool needs function.name.", param="tools")
    choice = payload.get("tool_choice", "auto")
    forced = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        forced = choice["function"].get("name")
    return tool_rule(names, choice if isinstance(choice, str) else "auto",
                     forced if isinstance(forced, str) else None, _last_user_text(messages))


def tool_rule(names: list[str], mode: str, forced: str | None, last_user_text: str) -> str | None:
    """The tool every endpoint calls: a named (forced) one; none for "none"; the first for
    "required"; else the first when the last user text mentions the weather."""
    if mode == "none" or not names:
        return None
    if forced:
        return forced
    if mode == "required":
        return names[0]
    return names[0] if "weather" in last_user_text.lower() else None


@lru_cache(maxsize=65_536)
def _embedding_vector(text: str, dimensions: int) -> tuple[float, ...]:
    """A unit vector derived from sha256 of the input, rounded to float32 so that the float and
    base64 encodings decode to exactly the same numbers."""
    raw = b""
    counter = 0
    while len(raw) < 4 * dimensions:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    ints = struct.unpack(f"<{dimensions}I", raw[: 4 * dimensions])
    values = [v / 2_147_483_648.0 - 1.0 for v in ints]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return struct.unpack(f"<{dimensions}f", struct.pack(f"<{dimensions}f", *(v / norm for v in values)))


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_DONE = b"data: [DONE]\n\n"


def _error_body(status: int, message: str, param: str | None = None, error_type: str | None = None,
                code: str | None = None) -> bytes:
    if error_type is None:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
    return _dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()


ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error shape; its type follows from the status as Anthropic documents it."""
    error_type = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return _dumps({"type": "error", "error": {"type": error_type, "message": message},
                   "request_id": _next_id("req_")}).encode()


async def send_json(send: Send, status: int, body: bytes,
                    extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [_JSON, (b"content-length", str(len(body)).encode()),
               (b"x-request-id", _next_id("req_").encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: BadRequest, anthropic: bool = False) -> None:
    if anthropic:
        await send_json(send, error.status, anthropic_error_body(error.status, error.message))
        return
    await send_json(send, error.status,
                    _error_body(error.status, error.message, error.param, error.error_type, error.code))


LEAKY_ORGANIZATION = "org-Qx7LeakyOrgId4242"
LEAKY_URL = "https://upstream.internal.example/deployments/acme-prod-eastus2"
_INJECTED: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Mock injected bad request."),
    401: ("invalid_request_error", "invalid_api_key", "Mock injected authentication failure."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Mock injected forbidden."),
    404: ("invalid_request_error", "model_not_found", "Mock injected not found."),
    429: ("requests", "rate_limit_exceeded", "Mock injected rate limit: please try again later."),
}


async def _until_disconnect(receive: Receive) -> None:
    # Handlers that take no body (GET) have not consumed the request message yet.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _apply_faults(faults: Faults, receive: Receive, send: Send, anthropic: bool = False) -> bool:
    """Delay, hang or fail as asked (errors in Anthropic's shape for the Messages API); True when
    the response has been dealt with."""
    if faults.first_byte_ms:
        await asyncio.sleep(faults.first_byte_ms / 1000.0)
    if faults.reset:
        _drop_connection(send)
        return True
    if faults.hang:
        # Waiting on receive() ends as soon as the client gives up, so hung requests do not pile up.
        try:
            await asyncio.wait_for(_until_disconnect(receive), HANG_SECONDS)
        except TimeoutError:
            pass
        # Dropped silently by the server when the client is gone (the usual case).
        await _send_error(send, BadRequest("Mock hang elapsed.", status=504, error_type="server_error"),
                          anthropic)
        return True
    if faults.status is not None:
        status = faults.status
        error_type, code, message = _INJECTED.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None,
                     f"Mock injected HTTP {status}.")
        )
        extra = [(b"retry-after", faults.retry_after.encode())] if faults.retry_after is not None else None
        param = None
        if faults.leaky and status < 500:
            # What real providers put in their errors, which a gateway must not pass on.
            message = (f"{message} The deployment 'acme-prod-eastus2' of organization "
                       f"{LEAKY_ORGANIZATION} does not allow this; see {LEAKY_URL}.")
            param, code = "model", code or "invalid_value"
        body = (anthropic_error_body(status, message) if anthropic
                else _error_body(status, message, param, error_type, code))
        await send_json(send, status, body, extra)
        return True
    return False


def _drop_connection(send: Send) -> None:
    """Abort the TCP connection with no answer at all: a reset as the client sees it. ASGI has
    no message for that; uvicorn's `send` is a method of its request cycle, which holds the
    asyncio transport (both its httptools and h11 protocols)."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise RuntimeError("the reset fault needs uvicorn (no transport to abort)")
    transport.abort()


async def _send_body(send: Send, body: bytes, faults: Faults) -> None:
    """A JSON 200, or with a cut fault only half of it before dropping the connection."""
    if faults.cut_after is None:
        await send_json(send, 200, body)
        return
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
    # Returning with the body incomplete makes uvicorn close the socket: the client sees a short read.


async def _stream(send: Send, receive: Receive, faults: Faults, events: list[bytes],
                  content_start: int, content_end: int, settle: Callable[[int], None]) -> None:
    """Send SSE events one by one; events[content_start:content_end] carry one token each.

    settle(tokens_sent) is called exactly once, before the tail events so that the usage is
    already in the ledger when the client reads [DONE], or when the stream is cut or abandoned.
    """
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_SSE_HEADERS, (b"x-request-id", _next_id("req_").encode())]})
    delay = faults.chunk_ms / 1000.0
    # A cut beyond the last token still drops the stream before its finish chunk.
    cut_index = min(content_start + faults.cut_after, content_end) if faults.cut_after is not None else -1
    watcher: asyncio.Future[Message] | None = asyncio.ensure_future(receive()) if delay else None
    settled = False
    try:
        last = len(events) - 1
        for i, event in enumerate(events):
            if i == cut_index:
                settle(i - content_start)
                settled = True
                # Returning without the final body message makes uvicorn drop the connection.
                return
            if i == content_end:
                settle(content_end - content_start)
                settled = True
            if delay and i:
                assert watcher is not None
                done, _ = await asyncio.wait((watcher,), timeout=delay)
                if done:  # The client left: the tokens it got are what was generated.
                    if not settled:
                        settle(max(0, min(i, content_end) - content_start))
                        settled = True
                    return
            await send({"type": "http.response.body", "body": event, "more_body": i != last})
    finally:
        if watcher is not None:
            watcher.cancel()


async def stream_tokens(send: Send, receive: Receive, faults: Faults, events: list[tuple[bytes, int]],
                        settle: Callable[[int], None]) -> None:
    """Send SSE events whose token payloads are interleaved with other events (the Responses and
    Messages APIs wrap each output item in start/stop events); each event comes with the tokens it
    carries. A cut of N drops the connection before the (N+1)-th token-carrying event, or right
    after the last one; settle(tokens_sent) is called exactly once, right after the last
    token-carrying event (before the closing events), on a cut, or when the client leaves."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_SSE_HEADERS, (b"x-request-id", _next_id("req_").encode())]})
    delay = faults.chunk_ms / 1000.0
    carrying = [i for i, (_, tokens) in enumerate(events) if tokens]
    content_end = carrying[-1] + 1 if carrying else len(events) - 1
    cut_index = -1
    if faults.cut_after is not None:
        cut_index = carrying[faults.cut_after] if faults.cut_after < len(carrying) else content_end
    watcher: asyncio.Future[Message] | None = asyncio.ensure_future(receive()) if delay else None
    sent = 0
    settled = False
    try:
        last = len(events) - 1
        for i, (event, tokens) in enumerate(events):
            if i == cut_index:
                settle(sent)
                settled = True
                # Returning without the final body message makes uvicorn drop the connection.
                return
            if i == content_end and not settled:
                settle(sent)
                settled = True
            if delay and tokens and i:
                assert watcher is not None
                done, _ = await asyncio.wait((watcher,), timeout=delay)
                if done:  # The client left: the tokens it got are what was generated.
                    if not settled:
                        settle(sent)
                        settled = True
                    return
            await send({"type": "http.response.body", "body": event, "more_body": i != last})
            sent += tokens
    finally:
        if watcher is not None:
            watcher.cancel()


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _chunk_envelope(obj_id: str, obj: str, created: int, model: str, include_usage: bool,
                    chat: bool) -> tuple[str, str]:
    """The text around a chunk's choices, built once per stream rather than once per chunk."""
    fingerprint = ',"system_fingerprint":null' if chat else ""
    head = (f'data: {{"id":"{obj_id}","object":"{obj}","created":{created},'
            f'"model":{_dumps(model)}{fingerprint},"choices":[')
    tail = '],"usage":null}\n\n' if include_usage else "]}\n\n"
    return head, tail


async def chat_completions(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    model, faults = parse_faults(headers, _required_model(payload), key)
    assert model is not None
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty array.", param="messages")
    prompt_tokens = count_chat_prompt(messages, payload.get("tools"))
    wanted, cap = _output_budget(payload, faults)
    tool_name = _tool_to_call(payload, messages)
    stream = payload.get("stream") is True
    include_usage = stream and _include_usage(payload)
    if await _apply_faults(faults, receive, send):
        return
    key_id = api_key_id(key)
    obj_id = _next_id("chatcmpl-")
    created = int(time.time())
    cached = cached_part(faults, prompt_tokens)

    if tool_name is not None:
        # max_tokens does not cut tool calls (see the docstring), nor the reasoning before them.
        reasoning, n_tokens, finish = faults.reasoning_tokens or 0, TOOL_CALL_TOKENS, "tool_calls"
    else:
        reasoning, n_tokens, capped = split_output(wanted, faults.reasoning_tokens or 0, cap)
        finish = "length" if capped else "stop"

    if not stream:
        if tool_name is not None:
            message: dict[str, Any] = {
                "role": "assistant", "content": None, "refusal": None, "annotations": [],
                "tool_calls": [{"id": _next_id("call_"), "type": "function",
                                "function": {"name": tool_name, "arguments": TOOL_ARGUMENTS}}],
            }
        else:
            message = {"role": "assistant", "content": answer_text(n_tokens), "refusal": None,
                       "annotations": []}
        body = _dumps({
            "id": obj_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(prompt_tokens, reasoning + n_tokens, cached, reasoning),
            "service_tier": "default", "system_fingerprint": None,
        }).encode()
        ledger.record_completion(key_id, model, prompt_tokens, reasoning + n_tokens, cached=cached,
                                 reasoning=reasoning)
        await _send_body(send, body, faults)
        return

    head, tail = _chunk_envelope(obj_id, "chat.completion.chunk", created, model, include_usage, True)
    if tool_name is not None:
        first_delta: dict[str, Any] = {
            "role": "assistant", "content": None, "refusal": None,
            "tool_calls": [{"index": 0, "id": _next_id("call_"), "type": "function",
                            "function": {"name": tool_name, "arguments": ""}}],
        }
        deltas = [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                  for piece in TOOL_ARGUMENT_PIECES]
        # The name went out in the first chunk; each argument piece is one more token.
        base_tokens = 1
    else:
        first_delta = {"role": "assistant", "content": "", "refusal": None}
        deltas = [{"content": piece} for piece in _stream_pieces(n_tokens)]
        base_tokens = 0
    events = [(head + _dumps({"index": 0, "delta": first_delta, "logprobs": None,
                              "finish_reason": None}) + tail).encode()]
    events.extend((head + '{"index":0,"delta":' + _dumps(d) + ',"logprobs":null,"finish_reason":null}'
                   + tail).encode() for d in deltas)
    content_end = len(events)
    events.append((head + '{"index":0,"delta":{},"logprobs":null,"finish_reason":"' + finish + '"}'
                   + tail).encode())
    if include_usage:
        events.append((head + "]," + '"usage":'
                       + _dumps(_usage(prompt_tokens, reasoning + n_tokens, cached, reasoning))
                       + "}\n\n").encode())
    events.append(_DONE)

    def settle(sent: int) -> None:
        # The reasoning was generated before the first chunk went out.
        ledger.record_completion(key_id, model, prompt_tokens, reasoning + base_tokens + sent,
                                 cached=cached, reasoning=reasoning)

    await _stream(send, receive, faults, events, 1, content_end, settle)


async def completions(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    model, faults = parse_faults(headers, _required_model(payload), key)
    assert model is not None
    prompt_counts = _prompt_items(payload.get("prompt"), "prompt")
    prompt_tokens = sum(prompt_counts)
    wanted, cap = _output_budget(payload, faults)
    n_tokens, finish = _emitted(wanted, cap)
    stream = payload.get("stream") is True
    include_usage = stream and _include_usage(payload)
    if await _apply_faults(faults, receive, send):
        return
    key_id = api_key_id(key)
    obj_id = _next_id("cmpl-")
    created = int(time.time())
    n_choices = len(prompt_counts)
    completion_tokens = n_tokens * n_choices

    if not stream:
        text = answer_text(n_tokens)
        body = _dumps({
            "id": obj_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}
                        for i in range(n_choices)],
            "usage": _usage(prompt_tokens, completion_tokens), "system_fingerprint": None,
        }).encode()
        ledger.record_completion(key_id, model, prompt_tokens, completion_tokens)
        await _send_body(send, body, faults)
        return

    head, tail = _chunk_envelope(obj_id, "text_completion", created, model, include_usage, False)
    events: list[bytes] = []
    pieces = _stream_pieces(n_tokens)
    for i in range(n_choices):
        events.extend((head + '{"text":' + _dumps(piece) + f',"index":{i},"logprobs":null,'
                       '"finish_reason":null}' + tail).encode() for piece in pieces)
    content_end = len(events)
    events.extend((head + f'{{"text":"","index":{i},"logprobs":null,"finish_reason":"{finish}"}}'
                   + tail).encode() for i in range(n_choices))
    if include_usage:
        events.append((head + '],"usage":' + _dumps(_usage(prompt_tokens, completion_tokens))
                       + "}\n\n").encode())
    events.append(_DONE)

    def settle(sent: int) -> None:
        ledger.record_completion(key_id, model, prompt_tokens, sent)

    await _stream(send, receive, faults, events, 0, content_end, settle)


async def embeddings(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    key = _bearer_key(headers)
    payload = await _read_json(receive)
    if payload is None:
        return
    model, faults = parse_faults(headers, _required_model(payload), key)
    assert model is not None
    raw_input = payload.get("input")
    counts = _prompt_items(raw_input, "input")
    if isinstance(raw_input, str) or (isinstance(raw_input, list) and raw_input
                                      and isinstance(raw_input[0], int)):
        items: list[Any] = [raw_input]
    else:
        items = raw_input
    encoding = payload.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'.", param="encoding_format")
    dimensions = payload.get("dimensions", DEFAULT_EMBEDDING_DIMENSIONS)
    if (not isinstance(dimensions, int) or isinstance(dimensions, bool)
            or not 1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS):
        raise BadRequest(f"'dimensions' must be an integer in 1..{MAX_EMBEDDING_DIMENSIONS}.",
                         param="dimensions")
    if await _apply_faults(faults, receive, send):
        return
    data: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        vector = _embedding_vector(item if isinstance(item, str) else _dumps(item), dimensions)
        embedding: Any = (base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
                          if encoding == "base64" else list(vector))
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    prompt_tokens = sum(counts)
    body = _dumps({"object": "list", "data": data, "model": model,
                   "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}).encode()
    ledger.record_embedding(api_key_id(key), model, prompt_tokens)
    await _send_body(send, body, faults)


_MODEL_CREATED = 1_686_935_002
_MODELS_BODY = _dumps({
    "object": "list",
    "data": [{"id": m, "object": "model", "created": _MODEL_CREATED, "owned_by": "openai"} for m in MODELS],
}).encode()


async def list_models(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    _bearer_key(headers)
    _, faults = parse_faults(headers, None)
    if await _apply_faults(faults, receive, send):
        return
    await _send_body(send, _MODELS_BODY, faults)


async def retrieve_model(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    _bearer_key(headers)
    # Any model name works in requests, so any id is "found".
    model = scope["path"][len("/v1/models/"):].split("@")[0]
    _, faults = parse_faults(headers, None)
    if await _apply_faults(faults, receive, send):
        return
    body = _dumps({"id": model, "object": "model", "created": _MODEL_CREATED, "owned_by": "openai"}).encode()
    await _send_body(send, body, faults)


_GROUPABLE = ("project_id", "user_id", "api_key_id", "model", "batch")


def _int_param(query: dict[str, list[str]], name: str, default: int | None) -> int | None:
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise BadRequest(f"'{name}' must be an integer.", param=name) from None


def usage_page(kind: str, query_string: str, now: float | None = None) -> dict[str, Any]:
    """One page of OpenAI's organization usage API, built from the ledger.

    Buckets are UTC days (bucket_width=1d only, which is how usage is recorded): the first
    bucket is the day containing start_time, the last the day containing end_time - 1.
    """
    query = parse_qs(query_string, keep_blank_values=True)
    start_time = _int_param(query, "start_time", None)
    if start_time is None:
        raise BadRequest("'start_time' is required.", param="start_time")
    end_time = _int_param(query, "end_time", int(time.time() if now is None else now))
    assert end_time is not None
    width = query.get("bucket_width", ["1d"])[-1]
    if width != "1d":
        raise BadRequest("The mock upstream only keeps daily usage: bucket_width must be '1d'.",
                         param="bucket_width")
    group_by: list[str] = []
    for value in query.get("group_by", []) + query.get("group_by[]", []):
        for field in value.split(","):
            if field not in _GROUPABLE:
                raise BadRequest(f"Invalid group_by field {field!r}.", param="group_by")
            group_by.append(field)
    limit = _int_param(query, "limit", 7)
    assert limit is not None
    if not 1 <= limit <= 31:
        raise BadRequest("'limit' must be in 1..31 for bucket_width=1d.", param="limit")
    key_filter = set(query.get("api_key_ids", []) + query.get("api_key_ids[]", []))
    model_filter = set(query.get("models", []) + query.get("models[]", []))

    first_day = start_time // DAY * DAY
    page = query.get("page", [""])[-1]
    if page:
        try:
            first_day = int(page.removeprefix("page_"))
        except ValueError:
            raise BadRequest("Invalid 'page' cursor.", param="page") from None
    days = list(range(first_day, end_time, DAY)) if end_time > first_day else []
    shown, rest = days[:limit], days[limit:]

    by_key = "api_key_id" in group_by
    by_model = "model" in group_by
    sums: dict[tuple[int, str | None, str | None], list[int]] = {}
    for day, key_id, model, values in ledger.rows(kind):
        if key_filter and key_id not in key_filter or model_filter and model not in model_filter:
            continue
        group = (day, key_id if by_key else None, model if by_model else None)
        acc = sums.get(group)
        if acc is None:
            sums[group] = list(values)
        else:
            for i, v in enumerate(values):
                acc[i] += v

    result_object = f"organization.usage.{kind}.result"
    buckets: list[dict[str, Any]] = []
    for day in shown:
        results: list[dict[str, Any]] = []
        for (group_day, key_id, model), values in sorted(
                sums.items(), key=lambda item: (item[0][1] or "", item[0][2] or "")):
            if group_day != day:
                continue
            result: dict[str, Any] = {"object": result_object, "input_tokens": values[0]}
            if kind == "completions":
                result.update(output_tokens=values[1], input_cached_tokens=values[3],
                              input_cache_write_tokens=values[4], output_reasoning_tokens=values[5],
                              input_audio_tokens=0, output_audio_tokens=0,
                              num_model_requests=values[2], batch=None)
            else:
                result["num_model_requests"] = values[1]
            result.update(project_id=None, user_id=None, api_key_id=key_id, model=model)
            results.append(result)
        buckets.append({"object": "bucket", "start_time": day, "end_time": day + DAY, "results": results})
    return {"object": "page", "data": buckets, "has_more": bool(rest),
            "next_page": f"page_{rest[0]}" if rest else None}


def _usage_endpoint(kind: str) -> Handler:
    async def handler(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
        _bearer_key(headers)
        page = usage_page(kind, scope.get("query_string", b"").decode("latin-1"))
        await send_json(send, 200, _dumps(page).encode())

    return handler


async def mock_usage(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    await send_json(send, 200, _dumps(ledger.totals()).encode())


# What POST /mock/reset clears; the endpoint modules add their stores.
RESETS: list[Callable[[], None]] = [ledger.reset, key_faults.reset]


async def mock_reset(scope: Scope, receive: Receive, send: Send, headers: RequestHeaders) -> None:
    await _read_body(receive)
    for reset in RESETS:
        reset()
    await send_json(send, 200, b'{"ok":true}')


async def mock_faults_get(scope: Scope, receive: Receive, send: Send,
                          headers: RequestHeaders) -> None:
    await send_json(send, 200, _dumps(key_faults.report()).encode())


async def mock_faults_set(scope: Scope, receive: Receive, send: Send,
                          headers: RequestHeaders) -> None:
    """{"key": "<bearer key>", "model": "<model>" (default "*": every model), "faults": {...}}:
    the faults that key's requests get from now on; empty `faults` heals it."""
    payload = await _read_json(receive)
    if payload is None:
        return
    key, model, fields = payload.get("key"), payload.get("model", KeyFaults.ANY_MODEL), \
        payload.get("faults")
    if not isinstance(key, str) or not key.strip() or not isinstance(model, str) or not model \
            or not isinstance(fields, dict):
        raise BadRequest("Expected {\"key\": str, \"model\": str (optional), \"faults\": {}}.")
    raw = {}
    for name, value in fields.items():
        field = _MODEL_FAULTS.get(name)
        if field is None:
            raise BadRequest(f"Unknown fault {name!r}.", param="faults")
        raw[field] = str(value).lower() if isinstance(value, bool) else str(value)
        _set_fault(Faults(), field, raw[field], f"fault {name!r}")  # validated now, not per call
    key_faults.set(api_key_id(key.strip()), model, raw)
    await send_json(send, 200, _dumps({"ok": True, "api_key_id": api_key_id(key.strip()),
                                       "model": model, "faults": raw}).encode())


ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/completions": {"POST": completions},
    "/v1/embeddings": {"POST": embeddings},
    "/v1/models": {"GET": list_models},
    "/v1/organization/usage/completions": {"GET": _usage_endpoint("completions")},
    "/v1/organization/usage/embeddings": {"GET": _usage_endpoint("embeddings")},
    "/mock/usage": {"GET": mock_usage},
    "/mock/reset": {"POST": mock_reset},
    "/mock/faults": {"GET": mock_faults_get, "POST": mock_faults_set},
}
# The Responses and Messages APIs (responses.py, messages.py) build on this module's helpers, so
# the package's __init__ (which Python runs before importing this module by any name) adds their
# routes and resets to these tables: this module never imports them.
# Paths with an id in them: (prefix, handlers); the handler reads the rest of the path.
PREFIX_ROUTES: list[tuple[str, dict[str, Handler]]] = []


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI entry point."""
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        return
    path: str = scope["path"]
    methods = ROUTES.get(path)
    if methods is None and path.startswith("/v1/models/"):
        methods = {"GET": retrieve_model}
    if methods is None:
        for prefix, handlers in PREFIX_ROUTES:
            if path.startswith(prefix):
                methods = handlers
                break
    if methods is None:
        await send_json(send, 404, _error_body(404, f"Invalid URL ({scope['method']} {path})",
                                               code="unknown_url"))
        return
    handler = methods.get(scope["method"])
    if handler is None:
        await send_json(send, 405, _error_body(405, f"Method {scope['method']} not allowed for {path}.",
                                               code="method_not_allowed"))
        return
    try:
        await handler(scope, receive, send, _parse_headers(scope))
    except BadRequest as error:
        await _send_error(send, error)
