"""The rest of /v1: every path that is not one of the metered inference endpoints.

- `GET /v1/models` and `GET /v1/models/{id}`: the catalog models this key may use and that a
  provider key of the caller's API serves (the openai SDK: OpenAI's shape and openai-kind keys; an
  Anthropic client, told by its `anthropic-version` or `x-api-key` header: Anthropic's shape,
  paginated like Anthropic's, and anthropic-kind keys).
- `POST /v1/moderations` (OpenAI) and `POST /v1/messages/count_tokens` (Anthropic): passed to a
  provider key of their API and NOT metered, because the upstreams do not bill them: no hold, no
  ledger row, no quota or rate limit counted. Authenticated, the key's model allow-list applies,
  bounded by the call deadline (GATEWAY_CALL_DEADLINE_SECONDS).
- The endpoints this gateway does not serve yet (UNSUPPORTED_ENDPOINTS): 404 with code
  `unsupported_endpoint`, before authentication, so a client learns at once that the gateway,
  not its key, is the reason.
- Any other /v1 path: a JSON 404 (`unknown_url`) in the caller's API shape, never Django's HTML
  page, without authentication (a 404 tells nothing about keys).
- An endpoint's path without /v1 (BASE_URL_MISTAKES: `/chat/completions`, `/messages`, ...,
  what an SDK whose base URL lacks /v1 calls): a JSON 404 in the caller's API shape saying
  which path was meant and which base URL to set, not Django's HTML page.

`send_unmetered` sends one request that costs no tokens to the first provider key that answers;
it is what these pass-throughs share, and what any other unmetered pass-through can use.
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from gateway.admission import allows, refuse_before_reading
from gateway.auth import KeyContext
from gateway.bodies import Endpoint, check_messages_references, load_json
from gateway.deadlines import deadline_in
from gateway.dialects import ANTHROPIC_KIND, OPENAI_KIND, dialect_for
from gateway.errors import (
    Api,
    GatewayError,
    bad_request,
    model_not_allowed,
    upstream_client_error,
    upstream_error,
    new_request_id,
)
from gateway.observe import OTHER_ENDPOINT, other_endpoint
from gateway.prices import MODEL_NAME_RULE, is_model_name
from gateway.providers import Upstream
from gateway.runtime import GatewayRuntime
from gateway.upstream_http import read_answer
from gateway.views import (
    _authenticate,
    _count_if_refusal,
    _read_body,
    _runtime,
    _with_request_id,
)

log = logging.getLogger(__name__)

# Endpoints of the OpenAI and Anthropic APIs this gateway does not serve yet: each entry is a
# path and everything under it (the README lists them). Checked before authentication.
UNSUPPORTED_ENDPOINTS: tuple[str, ...] = (
    "/v1/audio",
    "/v1/images",
    "/v1/files",
    "/v1/uploads",
    "/v1/batches",
    "/v1/fine_tuning",
    "/v1/vector_stores",
    "/v1/assistants",
    "/v1/threads",
    "/v1/realtime",
    "/v1/messages/batches",
    # Under /v1/responses/ (routed to gateway/stored_responses.py, which checks these first):
    # compaction and the input token count are OpenAI endpoints of their own, not response ids.
    "/v1/responses/compact",
    "/v1/responses/input_tokens",
)
SERVED = ("/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/messages, "
          "/v1/messages/count_tokens, /v1/models and /v1/moderations")

# The model a moderation without one goes to when a provider key serves it (OpenAI's default).
DEFAULT_MODERATION_MODEL = "omni-moderation-latest"

# Anthropic's model list pages: `limit` defaults to 20 and may be 1 to 1000.
ANTHROPIC_PAGE_DEFAULT = 20
ANTHROPIC_PAGE_MAX = 1000

# A path echoed in a 404 is cut to this length: the answer must stay small whatever was asked.
_PATH_ECHO_MAX = 200
_MODELS_PREFIX = "models/"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def caller_api(request: HttpRequest) -> Api:
    """Anthropic's shape for a request that looks like an Anthropic client's (its SDK always
    sends `anthropic-version`, and its key in `x-api-key`; or a path of the Messages API), else
    OpenAI's."""
    headers = request.headers
    if "anthropic-version" in headers or "x-api-key" in headers:
        return Api.ANTHROPIC
    return Api.ANTHROPIC if _under(request.path, "/v1/messages") else Api.OPENAI


def unsupported_endpoint(path: str) -> str | None:
    """The UNSUPPORTED_ENDPOINTS entry `path` falls under, None when none."""
    for prefix in UNSUPPORTED_ENDPOINTS:
        if _under(path, prefix):
            return prefix
    return None


def _echo(request: HttpRequest) -> str:
    path = request.path
    if len(path) > _PATH_ECHO_MAX:
        path = path[:_PATH_ECHO_MAX] + "..."
    return f"{request.method} {path}"


def unknown_url(request: HttpRequest) -> GatewayError:
    return GatewayError(404, f"Unknown request URL: {_echo(request)}. Please check the URL for "
                        f"typos; this gateway serves {SERVED}.", "invalid_request_error",
                        "unknown_url")


def unsupported(request: HttpRequest, prefix: str) -> GatewayError:
    return GatewayError(404, f"This gateway does not serve {prefix} yet ({_echo(request)}); it "
                        f"serves {SERVED}.", "invalid_request_error", "unsupported_endpoint")


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model '{model}' does not exist or you do not have access to "
                        "it.", "invalid_request_error", "model_not_found")


def _answer(error: GatewayError, api: Api, request_id: str) -> HttpResponse:
    response = error.response(api=api, request_id=request_id)
    _with_request_id(response, request_id, api)
    return response


def _not_allowed(request: HttpRequest, allowed: str, api: Api, request_id: str) -> HttpResponse:
    response = _answer(GatewayError(405, f"Method {request.method} is not allowed here; use "
                                    f"{allowed}.", "invalid_request_error", "method_not_allowed"),
                       api, request_id)
    response["Allow"] = allowed
    return response


@other_endpoint("other")
@csrf_exempt
async def v1_other(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Every /v1 path without a route of its own (`rest`: the path after "/v1/"): a model by
    id, an unsupported endpoint, else a JSON 404."""
    if rest.startswith(_MODELS_PREFIX) and len(rest) > len(_MODELS_PREFIX):
        response = await retrieve_model(request, rest[len(_MODELS_PREFIX):])
        setattr(response, OTHER_ENDPOINT, "models/{id}")  # its own label, not "other"
        return response
    api = caller_api(request)
    prefix = unsupported_endpoint(request.path)
    if prefix is not None:
        error = unsupported(request, prefix)
    elif _under(request.path, "/v1/v1"):
        # The anthropic SDK adds /v1 itself: a base URL ending in /v1 doubles it.
        base = _base(request)
        error = GatewayError(404, f"Unknown request URL: {_echo(request)}; did you mean "
                             f"{request.path[3:3 + _PATH_ECHO_MAX]}? Set the SDK's base URL to "
                             f"{base} for the anthropic SDK ({base}/v1 for the openai SDK).",
                             "invalid_request_error", "unknown_url")
    else:
        error = unknown_url(request)
    return _answer(error, api, new_request_id())


# Endpoint paths as an SDK calls them when its base URL lacks "/v1" (the openai SDK appends the
# endpoint to its base URL, which must end in /v1; the anthropic SDK adds /v1 itself, so its base
# URL is the bare host, and a base URL of host/v1 reaches /v1/v1/messages instead).
BASE_URL_MISTAKES: tuple[str, ...] = ("chat/completions", "completions", "embeddings",
                                      "responses", "messages", "messages/count_tokens",
                                      "models", "moderations")
# A Host header echoed in the hint, when it looks like one: anything else is not repeated.
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")


def _base(request: HttpRequest) -> str:
    host = request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME", "")
    return f"http://{host}" if isinstance(host, str) and _HOST.fullmatch(host) else "http://<host>"


@other_endpoint("other")
@csrf_exempt
async def missing_v1(request: HttpRequest) -> HttpResponse:
    """An endpoint's path without /v1 (BASE_URL_MISTAKES): a 404 in the caller's API shape that
    names the path meant and the base URL to set, before authentication."""
    api = Api.ANTHROPIC if _under(request.path, "/messages") else caller_api(request)
    base = _base(request)
    error = GatewayError(404, f"Unknown request URL: {_echo(request)}; did you mean "
                         f"/v1{request.path[:_PATH_ECHO_MAX]}? Set the SDK's base URL to "
                         f"{base}/v1 (the anthropic SDK: {base}).", "invalid_request_error",
                         "unknown_url")
    return _answer(error, api, new_request_id())


# -- models -------------------------------------------------------------------------------------


def _kind(api: Api) -> str:
    return ANTHROPIC_KIND if api is Api.ANTHROPIC else OPENAI_KIND


def listed_models(runtime: GatewayRuntime, ctx: KeyContext, kind: str) -> list[str]:
    """The catalog models the key may use that a provider key of `kind` usable by the tenant
    serves, sorted by name."""
    return [name for name in runtime.catalog.names()
            if ctx.allows(name) and runtime.pool.serves(name, ctx.tenant_id, kind=kind)]


def model_found(runtime: GatewayRuntime, ctx: KeyContext, model: str, kind: str) -> bool:
    """The rule of the list for one id, which may also be an alias of a catalog model."""
    return (is_model_name(model) and runtime.catalog.spec(model) is not None
            and allows(runtime, ctx, model)
            and runtime.pool.serves(model, ctx.tenant_id, kind=kind))


def _openai_model(name: str, created: int) -> dict[str, Any]:
    # The gateway does not know when a model was released: `created` is the answer's time.
    return {"id": name, "object": "model", "created": created, "owned_by": "tollgate"}


def _anthropic_model(runtime: GatewayRuntime, name: str, created_at: str) -> dict[str, Any]:
    # The catalog has no display names (the id is the name shown) and no release dates;
    # it lists enabled models only ("active"), with their context window and output limit.
    info = runtime.catalog.resolve(name)
    return {"type": "model", "id": name, "display_name": name, "created_at": created_at,
            "lifecycle": "active", "max_input_tokens": info.context_window,
            "max_tokens": info.max_output_tokens}


def _rfc3339_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _page_limit(query: Mapping[str, str]) -> int:
    raw = query.get("limit")
    if raw is None or raw == "":
        return ANTHROPIC_PAGE_DEFAULT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= ANTHROPIC_PAGE_MAX:
        raise bad_request(f"limit: must be an integer from 1 to {ANTHROPIC_PAGE_MAX}.", "limit")
    return limit


def anthropic_page(runtime: GatewayRuntime, names: list[str],
                   query: Mapping[str, str]) -> dict[str, Any]:
    """One page of Anthropic's model list over `names` (sorted): `limit`, and `after_id` or
    `before_id` as cursors (positions in the order, so an id no longer listed still works)."""
    limit = _page_limit(query)
    after, before = query.get("after_id"), query.get("before_id")
    if after and before:
        raise bad_request("Only one of before_id and after_id may be given.", "before_id")
    if before:
        end = bisect.bisect_left(names, before)
        start = max(0, end - limit)
        page, has_more = names[start:end], start > 0
    else:
        start = bisect.bisect_right(names, after) if after else 0
        page, has_more = names[start:start + limit], start + limit < len(names)
    created_at = _rfc3339_now()
    return {"data": [_anthropic_model(runtime, name, created_at) for name in page],
            "has_more": has_more, "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None}


async def _models_caller(request: HttpRequest, api: Api) -> tuple[GatewayRuntime, KeyContext]:
    runtime = await _runtime()
    return runtime, await _authenticate(runtime, request, api)


@other_endpoint("models")
@csrf_exempt
async def list_models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: the models this key may use, in the caller's API shape."""
    api = caller_api(request)
    request_id = new_request_id()
    if request.method not in ("GET", "HEAD"):
        return _not_allowed(request, "GET, HEAD", api, request_id)
    try:
        runtime, ctx = await _models_caller(request, api)
        names = listed_models(runtime, ctx, _kind(api))
        if api is Api.ANTHROPIC:
            body = anthropic_page(runtime, names, request.GET)
        else:
            now = int(time.time())
            body = {"object": "list", "data": [_openai_model(name, now) for name in names]}
    except GatewayError as error:
        return _answer(error, api, request_id)
    return _with_request_id(JsonResponse(body), request_id, api)


async def retrieve_model(request: HttpRequest, model: str) -> HttpResponse:
    """GET /v1/models/{id}: the model if it would be listed for this key, else 404."""
    api = caller_api(request)
    request_id = new_request_id()
    if request.method not in ("GET", "HEAD"):
        return _not_allowed(request, "GET, HEAD", api, request_id)
    try:
        runtime, ctx = await _models_caller(request, api)
        if not model_found(runtime, ctx, model, _kind(api)):
            raise model_not_found(model)
    except GatewayError as error:
        return _answer(error, api, request_id)
    body = (_anthropic_model(runtime, model, _rfc3339_now()) if api is Api.ANTHROPIC
            else _openai_model(model, int(time.time())))
    return _with_request_id(JsonResponse(body), request_id, api)


# -- sending one unmetered request ---------------------------------------------------------------


@dataclass(frozen=True)
class UpstreamAnswer:
    """A provider key's successful answer (status below 400), read whole."""

    upstream: Upstream
    status: int
    body: bytes
    content_type: str


def upstream_request(runtime: GatewayRuntime, upstream: Upstream, method: str, path: str,
                     auth: Mapping[str, str], request_id: str, content: bytes | None = None,
                     query: str = "") -> httpx.Request:
    """A request to `upstream` at its base URL + `path` (+ `query`), with the runtime's default
    headers and timeouts and the key's `auth` headers (the dialect's upstream_headers)."""
    headers = {**runtime.upstream_headers, **auth, "X-Request-Id": request_id}
    if content is not None:
        headers["Content-Type"] = "application/json"
    url = f"{upstream.base_url}/{path}" + (f"?{query}" if query else "")
    return httpx.Request(method, url, content=content, headers=headers,
                         extensions={"timeout": runtime.upstream_timeout})


def _retry_after(response: httpx.Response) -> int:
    try:
        return max(1, int(float(response.headers.get("retry-after", "1"))))
    except ValueError:
        return 1


async def send_unmetered(runtime: GatewayRuntime, upstreams: Sequence[Upstream],
                         build: Callable[[Upstream], httpx.Request]) -> UpstreamAnswer:
    """Send a request that costs no tokens (no hold, no ledger row) to the first of `upstreams`
    that answers it, all within the call deadline (GATEWAY_CALL_DEADLINE_SECONDS, else 504).

    Such a request is free and repeatable, so a key that is unreachable, times out, is rate
    limited (429), refuses the gateway's secret (401 / 403) or fails (5xx) passes it to the
    next; nothing here cools keys down or counts toward their breakers (those track the
    metered calls). An upstream's other 4xx is the request's fault: raised in Tollgate's words
    (upstream_client_error, never the provider's message). When no key answers: 429 with the
    upstream's Retry-After if one was rate limited, else 502 (504 when they timed out)."""
    rate_limited: httpx.Response | None = None
    refused = timed_out = False
    try:
        async with deadline_in(settings.GATEWAY_CALL_DEADLINE_SECONDS):
            for upstream in upstreams:
                try:
                    response = await runtime.transport.handle_async_request(build(upstream))
                    try:
                        body = await read_answer(response)
                    finally:
                        await response.aclose()
                except httpx.TimeoutException:
                    timed_out = True
                    log.warning("provider key %s timed out; trying the next", upstream.public_id)
                    continue
                except httpx.HTTPError as exc:
                    log.warning("provider key %s failed (%s); trying the next",
                                upstream.public_id, type(exc).__name__)
                    continue
                status = response.status_code
                if status < 400:
                    return UpstreamAnswer(upstream, status, body, response.headers.get(
                        "content-type", "application/json"))
                if status == 429:
                    rate_limited = response
                elif status in (401, 403):
                    refused = True
                    log.error("provider key %s refused by its upstream (HTTP %s)",
                              upstream.public_id, status)
                elif status >= 500:
                    log.warning("provider key %s answered HTTP %s; trying the next",
                                upstream.public_id, status)
                else:
                    raise upstream_client_error(status, body)
    except TimeoutError:
        raise upstream_error(504, "The upstream provider did not answer within the gateway's "
                             "deadline.") from None
    if rate_limited is not None:
        raise GatewayError(429, "Every upstream provider key for this request is rate limited; "
                           "retry shortly.", "requests", "rate_limit_exceeded", None,
                           _retry_after(rate_limited))
    if timed_out:
        raise upstream_error(504, "The upstream provider did not answer in time.")
    if refused:
        raise upstream_error(502, "The upstream refused the gateway's provider key; the "
                             "operators have been alerted.")
    raise upstream_error(502, "No upstream provider for this request could be reached.")


def _no_key(what: str) -> GatewayError:
    """Every key that could take the request is resting (cooling down or its breaker open)."""
    return GatewayError(503, f"Every upstream provider key for {what} is resting; the request "
                        "was not forwarded. Please retry shortly.", "server_error",
                        "upstream_unavailable", None, 1)


# -- moderations and count_tokens ------------------------------------------------------------------


Handler = Callable[[GatewayRuntime, KeyContext, HttpRequest, bytes, str], Awaitable[HttpResponse]]


async def _unmetered_call(request: HttpRequest, api: Api, handler: Handler) -> HttpResponse:
    """POST only; authenticated; every answer in the API's shape with a request id."""
    request_id = new_request_id()
    if request.method != "POST":
        return _not_allowed(request, "POST", api, request_id)
    try:
        runtime = await _runtime()
        ctx = await _authenticate(runtime, request, api)
        try:
            refuse_before_reading(ctx)
            response = await handler(runtime, ctx, request, _read_body(request), request_id)
        except GatewayError as error:
            await _count_if_refusal(runtime, ctx, error)
            raise
    except GatewayError as error:
        return _answer(error, api, request_id)
    except Exception:  # noqa: BLE001 - a bug must still answer in the API's shape
        log.exception("request %s failed", request_id)
        return _answer(GatewayError(500, "The gateway failed to handle the request.",
                                    "server_error", "internal_error"), api, request_id)
    return _with_request_id(response, request_id, api)


def _json_object(raw: bytes) -> dict[str, Any]:
    body = load_json(raw)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _model_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request("'model' is required: a model name.", "model")
    if not is_model_name(value):
        raise bad_request(f"Invalid model name. {MODEL_NAME_RULE}.", "model", "invalid_model")
    return value


def _passed_on(answer: UpstreamAnswer) -> HttpResponse:
    return HttpResponse(answer.body, status=answer.status, content_type=answer.content_type)


async def _moderate(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest, raw: bytes,
                    request_id: str) -> HttpResponse:
    body = _json_object(raw)
    if body.get("input") is None:
        raise bad_request("'input' is required: a string, or an array of strings or of "
                          "content parts.", "input")
    pool, tenant = runtime.pool, ctx.tenant_id
    model: str | None
    if body.get("model") is not None:
        model = _model_name(body["model"])
        if not allows(runtime, ctx, model):
            raise model_not_allowed(model)
        if not pool.serves(model, tenant, kind=OPENAI_KIND):
            raise model_not_found(model)
    elif pool.serves(DEFAULT_MODERATION_MODEL, tenant, kind=OPENAI_KIND):
        # Named for the upstream: a key chosen for serving it gets it explicitly, not its own
        # server's default. No allow-list check: the client named no model.
        model = DEFAULT_MODERATION_MODEL
        body["model"] = model
        raw = json.dumps(body, separators=(",", ":")).encode()
    else:
        model = None  # any openai-kind key: its server's default moderation model
    upstreams = pool.candidates(model, tenant, time.time(), kind=OPENAI_KIND)
    if not upstreams:
        if model is None and not _any_key(runtime, tenant, OPENAI_KIND):
            raise GatewayError(404, "No upstream provider of this gateway serves moderations "
                               "for your key.", "invalid_request_error", "not_found")
        raise _no_key("moderations")
    auth_for = dialect_for(Endpoint.CHAT).upstream_headers
    answer = await send_unmetered(runtime, upstreams, lambda upstream: upstream_request(
        runtime, upstream, "POST", "moderations", auth_for(upstream.secret, {}), request_id, raw))
    return _passed_on(answer)


def _any_key(runtime: GatewayRuntime, tenant_id: int, kind: str) -> bool:
    """Whether any key of `kind` is usable by the tenant, resting or not: at a "now" infinitely
    far ahead every cooldown and breaker has ended."""
    return bool(runtime.pool.candidates(None, tenant_id, float("inf"), kind=kind))


def _check_count_body(body: dict[str, Any]) -> str:
    """The model of a count_tokens body; 400 when the model or the messages are missing, or a
    file or container stored at the provider is named (the upstream checks the rest, as it does
    for a message)."""
    model = _model_name(body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object.", f"messages[{i}]")
    # Counting a file stored at the provider would tell its size, and it may be another
    # tenant's: refused as in a message.
    check_messages_references(body)
    return model


async def _count_tokens(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest,
                        raw: bytes, request_id: str) -> HttpResponse:
    model = _check_count_body(_json_object(raw))
    if not allows(runtime, ctx, model):
        raise model_not_allowed(model)
    pool, tenant = runtime.pool, ctx.tenant_id
    if not pool.serves(model, tenant, kind=ANTHROPIC_KIND):
        raise model_not_found(model)
    upstreams = pool.candidates(model, tenant, time.time(), kind=ANTHROPIC_KIND)
    if not upstreams:
        raise _no_key(f"the model '{model}'")
    messages = dialect_for(Endpoint.MESSAGES)
    client = messages.passed_headers(request.headers)
    auth_for = messages.upstream_headers
    answer = await send_unmetered(runtime, upstreams, lambda upstream: upstream_request(
        runtime, upstream, "POST", "messages/count_tokens", auth_for(upstream.secret, client),
        request_id, raw))
    return _passed_on(answer)


@other_endpoint("moderations")
@csrf_exempt
async def moderations(request: HttpRequest) -> HttpResponse:
    """POST /v1/moderations: OpenAI's moderation, unmetered (the upstream does not bill it)."""
    return await _unmetered_call(request, Api.OPENAI, _moderate)


@other_endpoint("messages/count_tokens")
@csrf_exempt
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages/count_tokens: Anthropic's token count, unmetered (free upstream)."""
    return await _unmetered_call(request, Api.ANTHROPIC, _count_tokens)
