"""The /v1 endpoints: plain async Django views that parse, call the gateway's services (auth,
admission, forwarding) and render. Nothing here decides about quota.

OpenAI's APIs (chat completions, completions, embeddings, responses) and Anthropic's Messages API
go through the same path; the endpoint's dialect (gateway/dialects.py) says how the upstream is
spoken to, and in which API's shape errors and rate headers are answered.

They are not DRF views: they authenticate API keys themselves (from the worker's cache), parse
the body themselves (gateway/bodies.py) and answer Django responses in OpenAI's error shape, so
DRF's request wrapping, content negotiation and response finalising did nothing for them but
cost CPU on every call (its dispatch was 5 % of a worker's profile, docs/benchmarks.md)."""
from __future__ import annotations

import asyncio
import logging
import time

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from gateway.admission import (
    Checked,
    admit,
    checked,
    refuse_before_reading,
    reserve_request,
    unmetered,
)
from gateway.auth import KeyContext
from gateway.bodies import Endpoint
from gateway.client_address import request_client_address
from gateway.dialects import dialect_for
from gateway.errors import (
    Api,
    GatewayError,
    body_too_large,
    invalid_api_key,
    quota_store_unavailable,
    new_request_id,
)
from gateway.forward import SETTLED_BEFORE_BODY, Call, forward, prepare_upstream
from gateway import metrics, readiness, request_context
from gateway.observe import Observation
from gateway.refusals import count_refusal
from gateway.responses_context import held_context, with_context
from gateway.runtime import GatewayRuntime
from gateway.startup import get_runtime, store_problems
from quotas import durability
from quotas.engine import QuotaError, QuotaStoreUnavailable, ReserveRequest, SentReserve

log = logging.getLogger(__name__)


# The headers a call reads, from META itself: request.headers, built on first use, parses the
# name of every entry of META (about 1 % of a call's CPU).


def _bearer(request: HttpRequest) -> str | None:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _api_key(request: HttpRequest, api: Api) -> str | None:
    """The caller's Tollgate key: `Authorization: Bearer` for every API, and Anthropic's
    `x-api-key` header too for the Messages API (what its SDK sends)."""
    token = _bearer(request)
    if token is None and api is Api.ANTHROPIC:
        token = request.META.get("HTTP_X_API_KEY", "").strip() or None
    return token


def _read_body(request: HttpRequest) -> bytes:
    length = request.META.get("CONTENT_LENGTH")
    limit = settings.GATEWAY_MAX_BODY_BYTES
    if length and length.isdigit() and int(length) > limit:
        raise body_too_large(limit)
    # read(), not .body: .body applies DATA_UPLOAD_MAX_MEMORY_SIZE, the smaller limit of the
    # paths Django serves (REQUEST_MAX_BODY_BYTES); a chunked body has no Content-Length to
    # check beforehand, so one byte past the limit is read to tell.
    body = request.read(limit + 1)
    if len(body) > limit:
        raise body_too_large(limit)
    return body


async def _runtime() -> GatewayRuntime:
    """The worker's runtime; its first build reads the catalog and the provider keys, so a
    worker that starts while PostgreSQL is down answers 503 until it can."""
    try:
        return await get_runtime()
    except DatabaseError as exc:
        log.error("gateway worker cannot start: database unreachable (%s)", exc)
        raise GatewayError(503, "The gateway is starting and cannot reach its database; retry "
                           "shortly.", "server_error", "gateway_starting") from None


async def _authenticate(runtime: GatewayRuntime, request: HttpRequest,
                        api: Api = Api.OPENAI, obs: Observation | None = None) -> KeyContext:
    token = _api_key(request, api)
    if token is None:
        how = ("'x-api-key: tgk_...' or 'Authorization: Bearer tgk_...'" if api is Api.ANTHROPIC
               else "'Authorization: Bearer tgk_...'")
        raise invalid_api_key(f"You didn't provide an API key. Send it as {how}.")
    try:
        ctx = await runtime.auth.authenticate(token, lambda: request_client_address(request))
    except DatabaseError:
        # Only a key not yet cached needs the database; cached keys keep working through an
        # outage (the hot path never touches PostgreSQL).
        raise GatewayError(503, "The API key cannot be checked right now; retry shortly.",
                           "server_error", "auth_unavailable") from None
    if ctx is None:
        raise invalid_api_key()
    tenant = ctx.project.tenant
    request_context.bind_caller(tenant.public_id, ctx.api_key.public_id)
    if obs is not None:
        obs.caller(tenant.public_id, tenant.slug, ctx.api_key.public_id)
    runtime.used_keys.add(ctx.api_key.pk)
    return ctx


def _method_not_allowed(request: HttpRequest, allowed: str,
                        api: Api = Api.OPENAI) -> HttpResponse:
    response = GatewayError(405, f"Method {request.method} is not allowed here; use {allowed}.",
                            "invalid_request_error", "method_not_allowed").response(api=api)
    response["Allow"] = allowed
    return response


def _with_request_id(response: HttpResponse | StreamingHttpResponse, request_id: str,
                     api: Api) -> HttpResponse | StreamingHttpResponse:
    response["x-request-id"] = request_id
    if api is Api.ANTHROPIC:
        response["request-id"] = request_id  # where Anthropic's clients look for it
    return response


async def _proxy(endpoint: Endpoint, request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/messages:
    every answer in the endpoint's API shape with an x-request-id, whatever fails.

    The call's Observation (gateway/observe.py) goes on the request: gateway/asgi.py finishes it
    once the answer is sent or the client left; served through Django instead (no `received`
    stamp from the router), it finishes when Django closes the response."""
    api = dialect_for(endpoint).api
    received = request.__dict__.get("tollgate_received")
    obs = Observation(endpoint.value, received)
    request.tollgate_observation = obs  # type: ignore[attr-defined]
    if request.method != "POST":
        response = _method_not_allowed(request, "POST", api)
        if received is None:
            _finish_on_close(response, obs)
        return response
    started = time.monotonic()
    request_id = obs.request_id = new_request_id()
    try:
        response = await _handle(endpoint, request, request_id, started, obs)
    except GatewayError as error:
        obs.refusal = error.refusal or ""
        response = error.response(api=api, request_id=request_id)
    except QuotaError as error:
        log.error("quota store unusable: refusing request %s (fail closed): %s",
                  request_id, error)
        response = quota_store_unavailable().response(api=api, request_id=request_id)
    except Exception:  # noqa: BLE001 - a bug must still answer in the API's shape
        log.exception("request %s failed", request_id)
        response = GatewayError(500, "The gateway failed to handle the request.",
                                "server_error", "internal_error").response(
                                    api=api, request_id=request_id)
    if received is None:
        # Served by Django: nothing sends the headers before the hold's end, so wait for it here.
        settled = getattr(response, SETTLED_BEFORE_BODY, None)
        if settled is not None:
            await settled()
        _finish_on_close(response, obs)
    return _with_request_id(response, request_id, api)


def _finish_on_close(response: HttpResponse | StreamingHttpResponse, obs: Observation) -> None:
    """Served through Django (the test client, WSGI): the call ends when Django closes the
    response, after its last byte (a stream's too). Django's own hook for resources a response
    holds until then; Django's ASGI handler runs it on a thread, so the figures are recorded
    on the event loop (gateway/metrics.py: recorded on one thread)."""
    response._resource_closers.append(
        lambda: metrics.on_recording_thread(obs.finish, response.status_code))


async def _handle(endpoint: Endpoint, request: HttpRequest, request_id: str,
                  started: float, obs: Observation) -> HttpResponse | StreamingHttpResponse:
    runtime = await _runtime()
    ctx = await _authenticate(runtime, request, dialect_for(endpoint).api, obs)
    try:
        return await _admitted(endpoint, runtime, ctx, request, request_id, started, obs)
    except GatewayError as error:
        await _count_if_refusal(runtime, ctx, error)
        raise


async def _count_if_refusal(runtime: GatewayRuntime, ctx: KeyContext, error: GatewayError) -> None:
    """Count a refusal in the tenant's refused-today counts (gateway/refusals.py): those raised
    before the forward and those the forward answers with (every key resting, a queue timeout
    waiting for provider capacity). Only refusals pay for the count."""
    if error.refusal is not None:
        await count_refusal(runtime.engine.client, ctx.tenant_tag, error.refusal,
                            runtime.engine.clock.now_ms() / 1000, ctx.schedule)


async def _admitted(endpoint: Endpoint, runtime: GatewayRuntime, ctx: KeyContext,
                    request: HttpRequest, request_id: str, started: float,
                    obs: Observation) -> HttpResponse | StreamingHttpResponse:
    # Cheap refusals first: the key's own (above all before a large body is parsed or counted).
    refuse_before_reading(ctx)
    raw = _read_body(request)
    # Parsed, refused if memory can tell, and counted: one job on a thread for a large body.
    call = await checked(runtime, ctx, endpoint, raw)
    obs.model = metrics.model_label(runtime.catalog, call.parsed.model)
    obs.stream = call.parsed.stream
    # A Responses call continuing a stored response holds for the earlier turns too, and goes
    # to the provider key that stores them (gateway/responses_context.py).
    context = await held_context(runtime, ctx, call.parsed)
    if context is not None:
        call = with_context(call, context, ctx)
    dialect = dialect_for(endpoint)
    client_headers = dialect.passed_headers(request.headers) if dialect.passes_headers else {}
    # From the reservation on, the hold must end exactly once even if the client leaves and
    # this request is cancelled (even mid-reserve, when the script may already have run):
    # reserve and forward run in a task of their own, which settles or releases by itself.
    # The reserve's script is written first when it can be (runtime.send_reserve; not when
    # traced, so that the reserve's span holds its write): Redis runs it while the task starts,
    # and the task, made before anything is awaited, waits for its reply.
    request = reserve_request(runtime, ctx, call, request_id)
    sent = runtime.send_reserve(request) if obs.span is None else None
    task = asyncio.ensure_future(_admit_and_forward(
        runtime, ctx, call, request_id, started, client_headers,
        context.pinned if context is not None else None, obs, request=request, sent=sent))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # Still waiting in the queue policy's queue: stop waiting (the waiter leaves the queue,
        # quotas/waiting.py); admitted already: the task goes on and ends its hold by itself.
        runtime.waiting.client_left(task)
        task.add_done_callback(_start_drain_if_streaming)
        runtime.detach(task)
        raise
    finally:
        # A refusal raised by the task has this frame in its traceback: without this reference
        # back to the task, each would leave a reference cycle for the cyclic GC.
        del task


async def _admit_and_forward(runtime: GatewayRuntime, ctx: KeyContext, checked_call: Checked,
                             request_id: str, started: float, client_headers: dict[str, str],
                             pinned: int | None, obs: Observation,
                             request: ReserveRequest | None = None,
                             sent: SentReserve | None = None,
                             ) -> HttpResponse | StreamingHttpResponse:
    prepared = prepare_upstream(runtime, ctx, checked_call.parsed,
                                checked_call.estimate.output_cap, request_id, client_headers,
                                at_once=sent is not None)
    try:
        if obs.span is None:
            admission = await admit(runtime, ctx, checked_call, request_id, obs,
                                    request=request, sent=sent)
        else:
            with obs.child("quota.reserve") as span:
                admission = await admit(runtime, ctx, checked_call, request_id, obs,
                                        request=request)
                if span is not None:  # None: tracing was turned off since the call began
                    span.set_attribute("tollgate.held_tokens", admission.reservation.granted)
    except QuotaStoreUnavailable:
        if not settings.GATEWAY_FAIL_OPEN:
            raise
        log.error("FAIL-OPEN: the quota store is unreachable; forwarding %s of tenant %s "
                  "UNMETERED (GATEWAY_FAIL_OPEN is on)", request_id, ctx.tenant_id)
        admission = unmetered(checked_call, request_id)
    call = Call(runtime, ctx, checked_call.parsed, admission, request_id, started,
                client_headers=client_headers, pinned=pinned, obs=obs, prepared=prepared)
    try:
        return await forward(call)
    except QuotaStoreUnavailable:
        await call.release(503, "quota_store_unavailable")
        raise
    except GatewayError as error:
        obs.refusal = error.refusal or ""
        await _count_if_refusal(runtime, ctx, error)
        return error.response(call.response_headers(), call.dialect.api, request_id)
    except Exception:
        # A bug must not leave the hold to the sweep: charge what the upstream may have
        # produced, or release when it never answered (Call.abort).
        await call.abort(500, "gateway_error")
        raise
    except BaseException:
        # Cancelled (a worker stopping past its drain deadline cancels the calls still
        # running): the hold is left to the sweep, but the access line held back for its end
        # (Observation.hold_ended) is written now, with what is known.
        if not call.ended:
            obs.hold_ended()
        raise


def _start_drain_if_streaming(task: asyncio.Future[HttpResponse | StreamingHttpResponse]) -> None:
    """The client left while the upstream's headers were awaited: nobody will read the stream
    this task produced, so let it drain for its usage and settle."""
    if task.cancelled() or task.exception() is not None:
        return
    client_gone = getattr(task.result(), "tollgate_client_gone", None)
    if client_gone is not None:
        client_gone()


# csrf_exempt: API clients send no CSRF token. It matters only when a call goes through Django's
# middleware (the test client, WSGI); gateway/asgi.py serves these paths without it.


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _proxy(Endpoint.CHAT, request)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _proxy(Endpoint.COMPLETIONS, request)


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _proxy(Endpoint.EMBEDDINGS, request)


@csrf_exempt
async def responses(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """POST /v1/responses: OpenAI's Responses API."""
    return await _proxy(Endpoint.RESPONSES, request)


@csrf_exempt
async def messages(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """POST /v1/messages: Anthropic's Messages API."""
    return await _proxy(Endpoint.MESSAGES, request)


# The metered views' endpoint labels, read by gateway/asgi.py to count and log a call it refuses
# before the view runs (a body too large or not received in time: model "", no caller).
for _view, _endpoint in ((chat_completions, Endpoint.CHAT), (completions, Endpoint.COMPLETIONS),
                         (embeddings, Endpoint.EMBEDDINGS), (responses, Endpoint.RESPONSES),
                         (messages, Endpoint.MESSAGES)):
    _view.tollgate_endpoint = _endpoint.value  # type: ignore[attr-defined]
del _view, _endpoint


async def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up (no dependency is checked)."""
    return JsonResponse({"status": "ok"})


def _database_ok() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        return cursor.fetchone() == (1,)


async def readyz(request: HttpRequest) -> HttpResponse:
    """Every Redis the process uses and the database are reachable, and the quota Redis cannot
    evict or lose counters (quotas/durability.py): the process can serve /v1, the console and
    the API. Each is reported by name (gateway/readiness.py): `redis` and `redis_config` the
    quota store (with `redis_cluster` on a cluster), `cache_redis` the Django cache, `broker`
    Celery's, `database` PostgreSQL."""
    others = await readiness.other_redis_checks()
    checks: dict[str, str] = {}
    try:
        runtime = await _runtime()
    except GatewayError as error:
        if error.code == "quota_store_unsafe":  # the worker refused to start on it
            try:
                issues = "; ".join(p.issue for p in await store_problems()) or "unsafe"
            except Exception as exc:  # noqa: BLE001
                issues = type(exc).__name__
            return JsonResponse({"status": "unavailable", "redis_config": f"error: {issues}",
                                 **others}, status=503)
        return JsonResponse({"status": "unavailable", "database": "error: unreachable",
                             **others}, status=503)
    try:
        await runtime.engine.client.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure
        checks["redis"] = f"error: {type(exc).__name__}"
    if settings.REDIS_CLUSTER:
        try:
            checks["redis_cluster"] = await readiness.cluster_state(runtime.engine.client)
        except Exception as exc:  # noqa: BLE001
            checks["redis_cluster"] = f"error: {type(exc).__name__}"
    if checks["redis"] == "ok":
        # Checked on every probe: CONFIG SET on a running server changes it under us.
        try:
            problems = await durability.acheck(runtime.engine.client)
        except Exception as exc:  # noqa: BLE001
            checks["redis_config"] = f"error: {type(exc).__name__}"
        else:
            for problem in problems:
                log.error("readiness: %s", problem)
            checks["redis_config"] = ("error: " + "; ".join(p.issue for p in problems)
                                      if problems else "ok")
    checks.update(others)
    try:
        checks["database"] = "ok" if await runtime.db.run(_database_ok) else "error"
    except Exception as exc:  # noqa: BLE001
        checks["database"] = f"error: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", **checks},
                        status=200 if ready else 503)
