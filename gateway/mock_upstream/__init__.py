"""A mock LLM upstream speaking OpenAI's and Anthropic's APIs: a bare ASGI app (no framework)
served by uvicorn.

It stands in for the provider in tests and in the benchmark that compares direct calls with
calls through the gateway, so every response uses the provider's wire format (the official
`openai`, `openai-agents` and `anthropic` SDKs parse all of them) and the per-request work is kept
small. Everything is offline and deterministic.

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
POST /v1/responses          OpenAI's Responses API (below), streamed or not
GET|DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items
POST /v1/conversations, GET|POST|DELETE /v1/conversations/{id}   (below; no /items)
POST /v1/moderations        OpenAI's shape, nothing flagged (every score 1e-06); not billed
POST /v1/messages           Anthropic's Messages API (below), streamed or not
POST /v1/messages/count_tokens   {"input_tokens": N} by the Messages rule; not billed
GET  /v1/models, /v1/models/{id}   a fixed list; any model name is accepted in requests
GET  /v1/organization/usage/completions and .../embeddings   the bill (below)
GET  /mock/usage            totals per api_key_id and model (all days), for tests
POST /mock/reset            clears the recorded usage, the per-key faults and request counts,
                            the stored responses and conversation contexts
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

Token classes (faults below): `cached_tokens=N` makes N of the input tokens cached reads
(prompt_tokens_details.cached_tokens, at most prompt_tokens); `reasoning_tokens=N` adds N
reasoning tokens before the answer (completion_tokens includes them, and
completion_tokens_details.reasoning_tokens says N). The cap (max_tokens) eats the visible answer
first, then the reasoning: completion_tokens never exceeds it (tool calls are not cut).

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
  X-Mock-Cached-Tokens: 5     gpt-4o@cached_tokens=5          5 input tokens are cache reads
  X-Mock-Cache-Read-Tokens: 5 claude@cache_read_tokens=5      the same for /v1/messages (falls
                                                             back to cached_tokens)
  X-Mock-Cache-Write-Tokens:2 claude@cache_write_tokens=2     2 input tokens are cache writes
                                                             (/v1/messages only: the Responses
                                                             API reports no cache writes, as
                                                             OpenAI's does not; ignored there)
  X-Mock-Reasoning-Tokens: 8  o4-mini@reasoning_tokens=8      8 reasoning tokens (chat,
                                                             responses; messages only when
                                                             thinking is enabled)

Each token class is clamped to the total it is part of (cache reads first, then writes).

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
`chunk_ms`, `cut`, `hang`, `reset`, `output_tokens`, `leaky`, `cached_tokens`,
`cache_read_tokens`, `cache_write_tokens`, `reasoning_tokens`), validated when set (a bad one is a
400). `model` defaults to "*" (every model); a model's faults add to (and win over) the key's
all-model ones, and both win over headers and suffixes. GET /mock/faults answers
{"faults": [{"api_key_id", "model", "faults"}], "requests": {api_key_id: inference, moderation,
token-count, stored-response and conversation requests received, faulted or not}}. Calls on
stored responses and conversations get the key's all-model faults. Like the bill, this state is per worker process.

The Responses API (POST /v1/responses)
--------------------------------------
input_tokens = words of `instructions` + words of every text in `input` (a string, or items:
messages whose content is a string or parts input_text/output_text/refusal; function_call name +
arguments; function_call_output output; reasoning summary texts; other item types count 0) +
words of json.dumps(tools) + the context of the turn it continues: `previous_response_id` adds
that response's input_tokens + output_tokens (the real upstream re-sends earlier turns), an unknown
or unfinished one (or one of another key, or made with `store: false`) is a 400 with param
"previous_response_id", code "previous_response_not_found"; `conversation` (an id string or
{"id": ...}) adds the context accumulated in that conversation by this key. Leniency: the mock
does not require a conversation to have been created first; an unseen id starts at 0. Both at
once is a 400. No `input` (and neither of the two) is a 400, param "input".
POST /v1/conversations {"items", "metadata"} creates one for the key ({"id": "conv_...",
"object": "conversation", "created_at", "metadata"}); its items' words (the input rule) are its
first turn's context. GET returns it, POST {"metadata"} updates it, DELETE answers
{"id", "object": "conversation.deleted", "deleted": true}; another key's, a deleted one, or one
only used leniently is a 404. Items are not kept: /v1/conversations/{id}/items is a 404.

Output: the chat rules: the answer words, length `output_tokens` (default 16), `max_output_tokens`
caps it (status "incomplete", incomplete_details {"reason": "max_output_tokens"}); with
`reasoning_tokens=N` a reasoning item (summary [], the reasoning stays hidden) comes first and N
counts in output_tokens and output_tokens_details.reasoning_tokens (within the cap);
`cached_tokens` fills input_tokens_details.cached_tokens; there is no cache-write figure
(OpenAI reports none: the `cache_write_tokens` fault does not apply, nothing is billed as one).
Function tools ({"type": "function", "name", ...}) follow chat's rule (tool_choice "none",
"required", {"type": "function", "name"}, else "weather" in the last user text): the answer is a
function_call item (call_id, name, arguments {"city": "Paris"}; 3 output tokens); when a
function_call_output item comes after the last user message the answer is text.

Streams (`stream: true`) send `event: <type>` + `data:` with sequence_number 0, 1, ...:
response.created, response.in_progress, [reasoning: output_item.added, output_item.done],
output_item.added, content_part.added, one response.output_text.delta per word, output_text.done,
content_part.done, output_item.done (for a tool call: output_item.added, two
function_call_arguments.delta, function_call_arguments.done, output_item.done), then
response.completed, or response.incomplete when capped. No response.failed: injected errors come
before the stream starts, and a cut drops the connection.

Responses are stored per bearer key (another key gets 404, as OpenAI answers) unless
`store: false`, in memory, the oldest dropped beyond 20,000 per worker. GET returns it, DELETE
answers {"id", "object": "response", "deleted": true}, GET .../input_items the stored input items
({"object": "list", "data", "first_id", "last_id", "has_more"}; `order` desc by default, `limit`,
`after`). `background: true` answers status "queued" at once and completes after chunk_ms x
output tokens (billed then); POST .../cancel before that makes it "cancelled" and bills nothing
(OpenAI bills what was generated), after that returns it unchanged; cancelling a response that is
not a background one is a 400. Background responses cannot stream (400).

The Messages API (POST /v1/messages)
------------------------------------
Auth: `x-api-key`, else `Authorization: Bearer` (the anthropic SDK 2.x sends its api_key so);
missing: 401. `anthropic-version` is required (400). This key is the one faults and the bill use.
Validation as Anthropic's: model, max_tokens (an integer >= 1), messages (non-empty, roles user /
assistant), system (a string or text blocks), thinking ({"type": "enabled", "budget_tokens"} with
1024 <= budget < max_tokens, or "disabled"), tools (each with a name), tool_choice (auto, any,
tool, none). Every error, injected ones too, is {"type": "error", "error": {"type", "message"},
"request_id"}: 400 invalid_request_error, 401 authentication_error, 403 permission_error, 404
not_found_error, 413 request_too_large, 429 rate_limit_error, 529 overloaded_error, other 5xx
api_error (retry-after when the retry_after fault is set).

Total input = words of system + of every block (text, tool_use input JSON, tool_result content,
thinking text, text documents) + words of json.dumps(tools). Anthropic reports input_tokens
EXCLUSIVE of the cache: usage.input_tokens = total - cache reads - cache writes,
cache_read_input_tokens and cache_creation_input_tokens by the faults. Output: a thinking block of
`reasoning_tokens` words (only when thinking is enabled; none without the fault), then the text
block (the chat words), or a tool_use block (input {"city": "Paris"}, 3 tokens, the chat tool
rule on the last user turn's text blocks, so after a turn of tool_result blocks the answer is
text). output_tokens = thinking + text (usage.output_tokens_details.thinking_tokens, the anthropic
SDK's field, says how much was thinking, in answers and in message_delta); stop_reason end_turn, max_tokens (the cap eats the text,
then the thinking) or tool_use. Streams: message_start (usage with the input side and
output_tokens 1), content_block_start, ping (after the first block start), content_block_delta
(thinking_delta per word then signature_delta, text_delta per word, input_json_delta per argument
piece), content_block_stop, message_delta (stop_reason, usage.output_tokens = the total),
message_stop. count_tokens answers the total input, is not billed, and takes no max_tokens.

Cuts on these two APIs: `cut=N` drops the stream before the (N+1)-th token-carrying event (a text,
thinking or argument delta; the start of a tool call, which carries its name; a reasoning item,
which carries its N tokens), or right after the last one; the bill gets what was sent.

The bill
--------
Usage is recorded per (api_key_id, model, UTC day) when a response is produced (chat, legacy
completions, responses and messages all in the completions bill; embeddings apart): the full usage for
a non-streaming answer (even when cut: the tokens were generated), and for a stream the tokens
actually sent when it is cut or the client leaves. Injected errors and hangs record nothing.
api_key_id = "key_" + the first 12 hex digits of sha256(bearer key).

GET /v1/organization/usage/completions?start_time=<unix>[&end_time=<unix>]&bucket_width=1d
    [&group_by=api_key_id&group_by=model][&api_key_ids=..][&models=..][&limit=7][&page=..]
returns OpenAI's page shape: {"object": "page", "data": [{"object": "bucket", "start_time",
"end_time", "results": [{"object": "organization.usage.completions.result", "input_tokens",
"output_tokens", "input_cached_tokens", "input_cache_write_tokens", "output_reasoning_tokens",
"num_model_requests", "api_key_id", "model", ...}]}], "has_more", "next_page"}. input_tokens is ALL
input (cached reads and cache writes included, even for Anthropic, whose answers exclude them),
output_tokens ALL output (reasoning included); the three class fields say how much of those
totals was of each class (0 when no fault asked for one). GET /mock/usage rows carry the same
three fields beside prompt_tokens, completion_tokens, total_tokens and requests.
Buckets are UTC days from the day containing start_time to the one containing end_time - 1 (only
bucket_width=1d); fields not grouped by are null. /v1/organization/usage/embeddings is the same
with "organization.usage.embeddings.result" (no output tokens).

The ledger lives in the worker's memory: with `--workers` > 1 each worker bills only the requests
it served, so the bill endpoint and /mock/usage are accurate only with `--workers 1` (the default).
The same holds for stored responses and conversations: with several workers a follow-up call
(retrieve, previous_response_id, conversation) may reach a worker that never saw the first one.
"""
from __future__ import annotations

from gateway.mock_upstream import messages, responses
from gateway.mock_upstream.app import MODELS, PREFIX_ROUTES, RESETS, ROUTES, api_key_id, app, ledger
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

# Here rather than in app.py so that app.py never imports the modules built on it.
messages.register(ROUTES)
responses.register(ROUTES, PREFIX_ROUTES, RESETS)
