"""An OpenAI-compatible mock LLM upstream: a bare ASGI app (no framework) served by uvicorn.

It stands in for the provider in tests and in the benchmark that compares direct calls with
calls through the gateway, so every response uses OpenAI's wire format (the official `openai`
SDK parses all of them) and the per-request work is kept small.

Run:   python -m gateway.mock_upstream --port 8099 [--host 127.0.0.1] [--workers 1]
From Python: `app` (the ASGI callable), `start_in_thread()`, `start_subprocess()` (both return a
`MockUpstream` with `.base_url`, `.url`, `.port`, `.stop()`, usable as a context manager).

Endpoints
---------
POST /v1/chat/completions   text answer, or a tool call (below); `stream: true` sends SSE chunks
POST /v1/completions        legacy; `prompt` is a string, list of strings, token array or list
                            of token arrays; one choice per prompt (`n` is ignored everywhere)
POST /v1/embeddings         `input` likewise; `dimensions` floats (default 8) per input, a unit
                            vector derived from sha256 of the text; `encoding_format: "base64"`
                            (the SDK's default) returns base64 of little-endian float32
GET  /v1/models, /v1/models/{id}   a fixed list; any model name is accepted in requests
GET  /v1/organization/usage/completions and .../embeddings   the bill (below)
GET  /mock/usage            totals per api_key_id and model (all days), for tests
POST /mock/reset            clears the recorded usage, the per-key faults and request counts
POST /mock/faults           faults for one bearer key (below: per provider key fault injection)
GET  /mock/faults           the per-key faults set, and inference requests per api_key_id

Auth: /v1/* needs `Authorization: Bearer <anything non-empty>`, else 401 in OpenAI's error
shape. Malformed JSON, a missing `model`, `messages`, `prompt` or `input`, or a bad fault value
gives 400 in the same shape: {"error": {"message", "type", "param", "code"}}.

Token counting (deterministic, not tiktoken)
--------------------------------------------
A "word" is an item of Python's `str.split()` (runs of whitespace separate words).
* chat prompt_tokens = words of every message's content (a string, or the `text` of each content
  part) + words of each assistant tool call's function name and arguments + if `tools` is given,
  words of `json.dumps(tools)` (Python's default separators ", " and ": ").
* completions prompt_tokens = words of each prompt string, or the length of each token array.
* embeddings prompt_tokens (= total_tokens) = the same rule over `input`.
* The answer is the words "mock reply the quick brown fox jumps over a lazy dog and runs back
  home again" repeated as needed. Wanted length = `X-Mock-Output-Tokens` / `@output_tokens=`
  if given, else 16. Emitted = min(wanted, max_completion_tokens or max_tokens); finish_reason is
  "length" when the cap cut it, else "stop". completion_tokens = words emitted (per choice,
  summed over the choices of a multi-prompt legacy completion).
* Streams send one word per chunk (with its leading space after the first).

Tool calls (chat only): when `tools` is non-empty and the last user message contains "weather"
(case-insensitive), the answer is a call of the first tool with arguments {"city": "Paris"},
`content: null`, finish_reason "tool_calls"; completion_tokens = 3 (the name plus two argument
words). tool_choice "none" disables it; "required" or a named function forces it. max_tokens does
not cut tool calls. Streamed: the first chunk carries role, id and name, then one chunk per
argument piece (`{"city":` and ` "Paris"}`), then the finish chunk.

Streams: a role chunk (chat only), one chunk per token, a chunk with finish_reason, then if and only
if `stream_options.include_usage` is true a chunk with `"choices": []` and `usage` (every other
chunk then carries `"usage": null`, as OpenAI does), then `data: [DONE]`.

Latency and fault injection
---------------------------
By header, or by model-name suffix (which survives a gateway that drops custom headers; a suffix
wins over the header). The model echoed in responses and billed is the part before the first "@".

  header                     model suffix                    effect
  X-Mock-First-Byte-Ms: 200  gpt-4o@first_byte_ms=200        wait before the response headers
  X-Mock-Chunk-Ms: 20        gpt-4o@chunk_ms=20              wait between stream chunks
  X-Mock-Status: 500         gpt-4o@status=500               that status (400-599) with an
                                                             OpenAI-shaped error, no body read
  X-Mock-Retry-After: 2      gpt-4o@status=429@retry_after=2 adds `Retry-After: 2` to the status
  X-Mock-Cut-After: 3        gpt-4o@cut=3                    streams: drop the TCP connection after
                                                             3 token chunks (no finish, usage or
                                                             [DONE]); non-streaming: send half of
                                                             the JSON body, then drop it
  X-Mock-Hang: 1             gpt-4o@hang                     never answer (one hour, or until the
                                                             client disconnects)
  X-Mock-Output-Tokens: 50   gpt-4o@output_tokens=50         answer length before max_tokens
  X-Mock-Leaky: 1            gpt-4o@status=404@leaky         an injected 4xx names an
                                                             organisation, a deployment and a
                                                             URL in its message, param "model"

  X-Mock-Reset: 1             gpt-4o@reset                    drop the connection after reading
                                                             the request, no answer (a reset)

Options combine (`gpt-4o@first_byte_ms=50@chunk_ms=5@cut=3`). Headers apply to every /v1
inference endpoint and /v1/models; an unknown X-Mock-* header or suffix option is a 400 so typos
do not pass silently. A cut stream makes uvicorn log "ASGI callable returned without completing
response": that is the intended abnormal end.

Per provider key fault injection
--------------------------------
A gateway sends its provider key as the bearer key, so faults can be set per key, for tests where
one provider key fails while another serves, then heals:

  POST /mock/faults  {"key": "sk-key-a", "faults": {"status": 503}}
  POST /mock/faults  {"key": "sk-key-a", "model": "gpt-4o", "faults": {"reset": true}}
  POST /mock/faults  {"key": "sk-key-a", "faults": {}}          heals it (for every model)

`faults` takes the model-suffix options above (`status`, `retry_after`, `first_byte_ms`,
`chunk_ms`, `cut`, `hang`, `reset`, `output_tokens`, `leaky`), validated when set (a bad one is a
400). `model` defaults to "*" (every model); a model's faults add to (and win over) the key's
all-model ones, and both win over headers and suffixes. GET /mock/faults answers
{"faults": [{"api_key_id", "model", "faults"}], "requests": {api_key_id: inference requests
received, faulted or not}}. Like the bill, this state is per worker process.

The bill
--------
Usage is recorded per (api_key_id, model, UTC day) when a response is produced: the full usage for
a non-streaming answer (even when cut: the tokens were generated), and for a stream the tokens
actually sent when it is cut or the client leaves. Injected errors and hangs record nothing.
api_key_id = "key_" + the first 12 hex digits of sha256(bearer key).

GET /v1/organization/usage/completions?start_time=<unix>[&end_time=<unix>]&bucket_width=1d
    [&group_by=api_key_id&group_by=model][&api_key_ids=..][&models=..][&limit=7][&page=..]
returns OpenAI's page shape: {"object": "page", "data": [{"object": "bucket", "start_time",
"end_time", "results": [{"object": "organization.usage.completions.result", "input_tokens",
"output_tokens", "num_model_requests", "api_key_id", "model", ...}]}], "has_more", "next_page"}.
Buckets are UTC days from the day containing start_time to the one containing end_time - 1 (only
bucket_width=1d); fields not grouped by are null. /v1/organization/usage/embeddings is the same
with "organization.usage.embeddings.result" (no output tokens).

The ledger lives in the worker's memory: with `--workers` > 1 each worker bills only the requests
it served, so the bill endpoint and /mock/usage are accurate only with `--workers 1` (the default).
"""
from __future__ import annotations

from gateway.mock_upstream.app import MODELS, api_key_id, app, ledger
from gateway.mock_upstream.server import (
    MockUpstream,
    free_port,
    run,
    start_in_thread,
    start_subprocess,
    wait_until_ready,
)

__all__ = [
    "MODELS",
    "MockUpstream",
    "api_key_id",
    "app",
    "free_port",
    "ledger",
    "run",
    "start_in_thread",
    "start_subprocess",
    "wait_until_ready",
]
