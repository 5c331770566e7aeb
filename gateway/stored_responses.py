"""The Responses API's stored objects through the gateway: a stored response's retrieve, delete,
cancel and input items, and conversations (create, retrieve, update, delete).

They pass through to the provider key that stores the object, for the tenant that made it only:

- A stored response, or a conversation, is reachable only when the gateway remembers it in the
  caller's tenant slot (quotas/answers.py: remembered when a call through the gateway created it,
  for TOLLGATE_RESPONSES_TTL_SECONDS). Anything else (made elsewhere, by another tenant, expired
  here, deleted, or an id outside [A-Za-z0-9_-]{1,128}) is a 404 in OpenAI's shape, code
  `response_not_found` / `conversation_not_found`, and no upstream is contacted: an id is not
  proof of ownership, and asking an upstream would tell one tenant about another's objects.
- Found: the request goes to that provider key (its base_url + the same path and query string,
  its secret as Bearer) through other_endpoints.send_unmetered; the upstream's 2xx status and
  body come back as they are, its errors in Tollgate's words (a 4xx keeps its status, type, code
  and param, never the provider's message; a 5xx, an unreachable or refused key is a 502, a 429
  a 429, no answer in time a 504).
- Not metered: no tokens are produced, so nothing is held or charged and no ledger row is
  written; they are authenticated like /v1/responses and bounded by GATEWAY_CALL_DEADLINE_SECONDS.
- A DELETE the upstream confirms (2xx), or a 404 from the upstream (the object is gone there),
  also forgets the id, so a later `previous_response_id` / `conversation` is refused as unseen.

Conversations are created on an OpenAI-kind provider key the tenant may use (keys dedicated to
the tenant first, then by priority; a key serving every model before one with a model list, since
every later turn of the conversation must go to that key whatever its model; one that cannot take
it, unreachable, rate limited, refused or failing, passes it to the next), and remembered with
the context of their initial `items` (estimated with the heuristic tokenizer: the conversation
has no model yet), so the first turn holds for them. Each turn then remembers the conversation's
new size (gateway/responses_context.py). Conversation items (/v1/conversations/{id}/items) are not
served: adding items the gateway cannot count would break the hold for the next turn.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from gateway.auth import KeyContext
from gateway.bodies import check_response_references, load_json
from gateway.errors import (
    Api,
    GatewayError,
    bad_request,
    quota_store_unavailable,
    upstream_error,
    new_request_id,
)
from gateway.models import ProviderKind
from gateway.observe import other_endpoint
from gateway.other_endpoints import (
    UpstreamAnswer,
    send_unmetered,
    unknown_url,
    unsupported,
    unsupported_endpoint,
    upstream_request,
)
from gateway.providers import Upstream
from gateway.runtime import GatewayRuntime
from gateway.tokens import HEURISTIC, estimate_responses_input, is_large, off_loop
from gateway.views import (
    _authenticate,
    _method_not_allowed,
    _read_body,
    _runtime,
    _with_request_id,
)
from quotas.answers import AnswerKind, StoredAnswer, forget, recall, remember
from quotas.engine import QuotaError

log = logging.getLogger(__name__)

# What the gateway accepts as a stored object's id: the ids end up in Redis keys.
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_RESPONSE_ROUTES = {("", "GET"), ("", "DELETE"), ("cancel", "POST"), ("input_items", "GET")}
_CONVERSATION_ITEM_METHODS = ("GET", "POST", "DELETE")


def not_found(kind: AnswerKind, object_id: str) -> GatewayError:
    noun = "Response" if kind is AnswerKind.RESPONSE else "Conversation"
    return GatewayError(404, f"{noun} with id '{object_id[:128]}' not found.",
                        "invalid_request_error", f"{kind.value}_not_found", None)


def _refused(error: GatewayError) -> HttpResponse:
    """A refusal decided by the path or method alone, before any key is checked."""
    request_id = new_request_id()
    response = error.response(request_id=request_id)
    _with_request_id(response, request_id, Api.OPENAI)
    return response


def _valid_id(raw: str) -> str | None:
    return raw if _ID.fullmatch(raw) else None


# -- the upstream -------------------------------------------------------------------------------


def _send(runtime: GatewayRuntime, upstreams: list[Upstream], method: str, path: str,
          query: str, body: bytes | None, request_id: str) -> Awaitable[UpstreamAnswer]:
    """The request to the first of `upstreams` that answers it, unmetered and within the call
    deadline (other_endpoints.send_unmetered: its failures as the /v1 forwarder reports them)."""
    def build(upstream: Upstream) -> httpx.Request:
        return upstream_request(runtime, upstream, method, path,
                                {"Authorization": f"Bearer {upstream.secret}"}, request_id,
                                body, query)

    return send_unmetered(runtime, upstreams, build)


def _relay(answer: UpstreamAnswer) -> HttpResponse:
    return HttpResponse(answer.body, status=answer.status, content_type=answer.content_type)


async def _owned(runtime: GatewayRuntime, ctx: KeyContext, kind: AnswerKind,
                 raw_id: str) -> tuple[str, Upstream]:
    """The object's id and the provider key storing it, when this tenant made it through the
    gateway; else 404 (nothing is sent upstream)."""
    object_id = _valid_id(raw_id)
    if object_id is None:
        raise not_found(kind, raw_id)
    try:
        stored = await recall(runtime.engine.client, ctx.tenant_tag, kind, object_id)
    except (QuotaError, RedisError, OSError):
        raise quota_store_unavailable() from None
    if stored is None:
        raise not_found(kind, object_id)
    upstream = runtime.pool.get(stored.provider_key_id)
    if upstream is None or not upstream.usable_by(ctx.tenant_id) \
            or not upstream.speaks(ProviderKind.OPENAI.value):
        # Disabled, deleted, reloading or re-assigned: only that key knows the object.
        raise GatewayError(503, f"The provider key that stores {kind.value} '{object_id}' is not "
                           "available now; retry later.", "server_error",
                           "provider_key_unavailable", None, 5)
    return object_id, upstream


async def _forget(runtime: GatewayRuntime, ctx: KeyContext, kind: AnswerKind,
                  object_id: str) -> None:
    try:
        await forget(runtime.engine.client, ctx.tenant_tag, kind, object_id)
    except (QuotaError, RedisError, OSError) as exc:
        # The upstream's object is gone either way; a later continuation of it gets the
        # upstream's 4xx instead of the gateway's 400.
        log.warning("%s %s not forgotten (%s)", kind.value, object_id, type(exc).__name__)


async def _pass_owned(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest,
                      kind: AnswerKind, object_id: str, upstream: Upstream, path: str,
                      body: bytes | None, request_id: str, deleting: bool) -> HttpResponse:
    try:
        answer = await _send(runtime, [upstream], request.method or "GET", path,
                             request.META.get("QUERY_STRING", ""), body, request_id)
    except GatewayError as error:
        if error.status == 404:  # only an upstream's answer is a 404 here
            await _forget(runtime, ctx, kind, object_id)  # gone upstream: gone here too
        raise
    if deleting:
        await _forget(runtime, ctx, kind, object_id)
    return _relay(answer)


# -- the views ----------------------------------------------------------------------------------

Handler = Callable[[GatewayRuntime, KeyContext, HttpRequest, str], Awaitable[HttpResponse]]


async def _serve(request: HttpRequest, handler: Handler) -> HttpResponse:
    """Authenticate, run `handler`, answer in OpenAI's shape with an x-request-id whatever
    fails (as views._proxy does)."""
    request_id = new_request_id()
    try:
        runtime = await _runtime()
        ctx = await _authenticate(runtime, request)
        response = await handler(runtime, ctx, request, request_id)
    except GatewayError as error:
        response = error.response(request_id=request_id)
    except (QuotaError, RedisError):
        log.error("quota store unusable: refusing request %s", request_id)
        response = quota_store_unavailable().response(request_id=request_id)
    except Exception:  # noqa: BLE001 - a bug must still answer in the API's shape
        log.exception("request %s failed", request_id)
        response = GatewayError(500, "The gateway failed to handle the request.",
                                "server_error", "internal_error").response(request_id=request_id)
    return _with_request_id(response, request_id, Api.OPENAI)  # type: ignore[return-value]


@other_endpoint("responses/{id}")
@csrf_exempt
async def response_item(request: HttpRequest, rest: str) -> HttpResponse:
    """GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
    GET /v1/responses/{id}/input_items. /v1/responses/compact and /v1/responses/input_tokens
    are endpoints this gateway does not serve: 404 unsupported_endpoint, whatever the method."""
    prefix = unsupported_endpoint(request.path)
    if prefix is not None:
        return _refused(unsupported(request, prefix))
    raw_id, _, sub = rest.partition("/")
    methods = sorted(method for route, method in _RESPONSE_ROUTES if route == sub)
    if not methods or "/" in sub:
        return _refused(unknown_url(request))
    if request.method not in methods:
        return _method_not_allowed(request, ", ".join(methods))

    async def handle(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest,
                     request_id: str) -> HttpResponse:
        object_id, upstream = await _owned(runtime, ctx, AnswerKind.RESPONSE, raw_id)
        path = f"responses/{object_id}" + (f"/{sub}" if sub else "")
        # Cancel takes no body: nothing of the client's is passed on.
        return await _pass_owned(runtime, ctx, request, AnswerKind.RESPONSE, object_id, upstream,
                                 path, b"" if request.method == "POST" else None, request_id,
                                 deleting=request.method == "DELETE")

    return await _serve(request, handle)


@other_endpoint("conversations/{id}")
@csrf_exempt
async def conversation_item(request: HttpRequest, rest: str) -> HttpResponse:
    """GET /v1/conversations/{id} (retrieve), POST (update its metadata), DELETE."""
    raw_id, slash, sub = rest.partition("/")
    if slash:
        if sub == "items" or sub.startswith("items/"):
            return _refused(GatewayError(
                404, "Conversation items (/v1/conversations/{id}/items) are not served by this "
                "gateway: items it cannot count would break the hold for the next turn. Send new "
                "items as the 'input' of a response with 'conversation'.",
                "invalid_request_error", "unsupported_endpoint"))
        return _refused(unknown_url(request))
    if request.method not in _CONVERSATION_ITEM_METHODS:
        return _method_not_allowed(request, ", ".join(_CONVERSATION_ITEM_METHODS))

    async def handle(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest,
                     request_id: str) -> HttpResponse:
        body = None
        if request.method == "POST":
            body = _read_body(request)
            _metadata_only(body)
        object_id, upstream = await _owned(runtime, ctx, AnswerKind.CONVERSATION, raw_id)
        return await _pass_owned(runtime, ctx, request, AnswerKind.CONVERSATION, object_id,
                                 upstream, f"conversations/{object_id}", body, request_id,
                                 deleting=request.method == "DELETE")

    return await _serve(request, handle)


def _metadata_only(raw: bytes) -> None:
    """An update changes only `metadata` (what OpenAI's API allows): anything else is a 400
    before the upstream is asked."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - {"metadata"})
    if unknown:
        raise bad_request(f"Unknown parameter: '{unknown[0]}'. Only 'metadata' can be updated.",
                          unknown[0], "unknown_parameter")
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata: Any) -> None:
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object of string values.", "metadata")


def _parse_conversation(raw: bytes) -> list[Any]:
    """The initial items of a conversation create (validated as far as the count needs)."""
    body = load_json(raw) if raw.strip() else {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    items = body.get("items")
    if items is None:
        items = []
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise bad_request("'items' must be an array of input items.", "items")
    # Files by id and item references name objects stored at the provider, maybe another
    # tenant's (as in a response's input); a new conversation continues nothing.
    check_response_references(items, "items", continuing=False)
    _check_metadata(body.get("metadata"))
    return items


def conversation_tokens(items: list[Any]) -> int:
    """The context a conversation's initial items add to its first turn: the heuristic count
    (the model is not known yet)."""
    if not items:
        return 0
    return estimate_responses_input({"input": items}, model="", tokenizer=HEURISTIC)


def conversation_keys(runtime: GatewayRuntime, ctx: KeyContext) -> list[Upstream]:
    """OpenAI-kind keys to create a tenant's conversation on, best first: those serving every
    model (any later turn's model can go there), then the others, each in the pool's order."""
    usable = runtime.pool.candidates(None, ctx.tenant_id, time.time(),
                                     kind=ProviderKind.OPENAI.value)
    return [u for u in usable if not u.models] + [u for u in usable if u.models]


@other_endpoint("conversations")
@csrf_exempt
async def conversations(request: HttpRequest) -> HttpResponse:
    """POST /v1/conversations: create a conversation (optional `items`, `metadata`)."""
    if request.method != "POST":
        return _method_not_allowed(request, "POST")

    async def handle(runtime: GatewayRuntime, ctx: KeyContext, request: HttpRequest,
                     request_id: str) -> HttpResponse:
        raw = _read_body(request)
        items = _parse_conversation(raw)
        tokens = (await off_loop(conversation_tokens, items) if is_large(len(raw))
                  else conversation_tokens(items))
        keys = conversation_keys(runtime, ctx)
        if not keys:
            raise upstream_error(502, "No upstream provider for conversations could be reached.")
        answer = await _send(runtime, keys, "POST", "conversations", "", raw or b"{}",
                             request_id)
        await _remember_conversation(runtime, ctx, answer, tokens)
        return _relay(answer)

    return await _serve(request, handle)


async def _remember_conversation(runtime: GatewayRuntime, ctx: KeyContext,
                                 answer: UpstreamAnswer, tokens: int) -> None:
    """Remember a created conversation before the client has its id (so its first turn is
    admitted and pinned to this key)."""
    try:
        created = json.loads(answer.body)
    except ValueError:
        created = None
    conversation_id = created.get("id") if isinstance(created, dict) else None
    if not isinstance(conversation_id, str) or _valid_id(conversation_id) is None:
        raise upstream_error(502, "The upstream provider answered a conversation without a "
                             "usable id.")
    try:
        await remember(runtime.engine.client, ctx.tenant_tag,
                       [(AnswerKind.CONVERSATION, conversation_id)],
                       StoredAnswer(answer.upstream.id, tokens),
                       settings.TOLLGATE_RESPONSES_TTL_SECONDS)
    except (QuotaError, RedisError, OSError):
        # Not remembered, it could not be used through the gateway: say so rather than hand
        # out an id every turn would be refused with (the upstream's copy is left unused).
        log.error("conversation %s created but not remembered: Redis unreachable",
                  conversation_id)
        raise quota_store_unavailable() from None
