"""Errors in the caller's API shape, so the official SDKs raise the right exception and retry
where they should. OpenAI's: `{"error": {"message", "type", "param", "code"}}` with the status codes
of DESIGN.md §8. Anthropic's (the Messages API): `{"type": "error", "error": {"type", "message"},
"request_id"}`, its error type and status told by the same error (`Api.ANTHROPIC` below)."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.http import HttpResponse

from gateway import request_context
from quotas.limits import (
    MODEL_NOT_ALLOWED,
    MODEL_NOT_PRICED,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    QUOTA_TENANT,
    RATE_LIMIT,
    SPEND_RATE_EXCEEDED,
    UPSTREAM_UNAVAILABLE,
)


def new_request_id() -> str:
    """The id of one /v1 request: in its x-request-id, its logs, its hold and its ledger row.
    Bound to the running request's context here (gateway/request_context.py), so its log lines
    and spans carry it."""
    rid = f"req_{secrets.token_hex(12)}"
    request_context.bind_request(rid)
    return rid


class Api(StrEnum):
    """The API family a client speaks: the shape of its errors and rate headers."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# Anthropic's error type for each status the gateway answers with, and the status Anthropic
# uses where it differs: "overloaded" is 529 there (the SDK's OverloadedError), not 503.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    402: "billing_error", 403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    502: "api_error", 503: "overloaded_error", 504: "timeout_error"}
_ANTHROPIC_STATUS = {503: 529}


@dataclass(frozen=True)
class GatewayError(Exception):
    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None
    # Why a tenant's request was refused (quotas.limits.REFUSAL_REASONS), for the refused-today
    # counters; None for errors that are not a refusal (bad input, upstream failures, ...).
    refusal: str | None = None

    def response(self, headers: dict[str, str] | None = None,
                 api: Api = Api.OPENAI, request_id: str | None = None) -> HttpResponse:
        if api is Api.ANTHROPIC:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500
                                        else "invalid_request_error")
            body: dict[str, Any] = {"type": "error",
                                    "error": {"type": kind, "message": self.message},
                                    "request_id": request_id}
            status = _ANTHROPIC_STATUS.get(self.status, self.status)
        else:
            body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                              "code": self.code}}
            status = self.status
        response = HttpResponse(json.dumps(body), status=status,
                                content_type="application/json")
        for name, value in (headers or {}).items():
            response[name] = value
        if self.retry_after_s is not None:
            response["Retry-After"] = str(self.retry_after_s)
        # For the request metrics of the endpoints the router counts from their answer alone
        # (gateway/observe.py count_other): the metered ones keep theirs on the Observation.
        setattr(response, _REFUSAL, self.refusal or "")
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


def body_too_large(limit: int) -> GatewayError:
    """A request body over its limit. /v1 answers it as is (400, OpenAI's shape); the paths
    Django serves answer its message with a 413 (gateway/asgi.py)."""
    return bad_request(f"The request body is larger than {limit} bytes.", None,
                       "request_too_large")


def body_not_received(seconds: float) -> GatewayError:
    """A request body not complete by its read deadline (a client trickling it), 408; the
    paths Django serve answer its message in their own format (gateway/asgi.py)."""
    return GatewayError(408, f"The request body was not received within {seconds:g} s.",
                        "invalid_request_error", "request_timeout")


def invalid_api_key(message: str = "Incorrect API key provided.") -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", "invalid_api_key")


def model_not_allowed(model: str) -> GatewayError:
    return GatewayError(403, f"This API key is not allowed to use the model '{model}'.",
                        "invalid_request_error", "model_not_allowed", "model",
                        refusal=MODEL_NOT_ALLOWED)


def model_not_priced(model: str) -> GatewayError:
    """No price for the model (no price period, not in the catalog, and no provider key serving
    it names a default price). 403 like model_not_allowed: the request is well formed, this
    gateway will not run it until an operator prices the model; the SDKs do not retry it."""
    return GatewayError(403, f"The model '{model}' has no price on this gateway, so it cannot be "
                        "metered; ask your administrator to price it.",
                        "invalid_request_error", "model_not_priced", "model",
                        refusal=MODEL_NOT_PRICED)


def not_found(message: str) -> GatewayError:
    return GatewayError(404, message, "invalid_request_error", "not_found")


def insufficient_quota(scope: str, window: str, retry_after_s: int,
                       refusal: str = QUOTA_TENANT) -> GatewayError:
    return GatewayError(
        429,
        f"You exceeded your current quota ({scope}, {window} window). The quota resets at the "
        "end of the window; ask your administrator for more.",
        "insufficient_quota", "insufficient_quota", None, retry_after_s, refusal,
    )


def rate_limited(message: str, retry_after_s: int,
                 refusal: str | None = RATE_LIMIT) -> GatewayError:
    """429 in OpenAI's shape (type "requests", code "rate_limit_exceeded"). `refusal`: the
    reason counted against the tenant, or None when no tenant is known yet (the per-address
    bound on API key lookups, gateway/auth.py)."""
    return GatewayError(429, message, "requests", "rate_limit_exceeded", None, retry_after_s,
                        refusal)


def spend_rate_exceeded(owner: str, retry_after_s: int) -> GatewayError:
    """A scope spending far above its pace: its burn-rate breaker is tripped (quotas/pace.py)
    until Retry-After. 429 with type "requests" (slow down, unlike insufficient_quota), code
    spend_rate_exceeded; the SDKs retry a 429 briefly, then raise RateLimitError."""
    return GatewayError(
        429,
        f"Spending paused: {owner} spent far above its pace (its burn-rate breaker tripped). "
        "Calls resume after the cool-down, or when an administrator resumes it in the console.",
        "requests", "spend_rate_exceeded", None, retry_after_s, SPEND_RATE_EXCEEDED,
    )


def queue_full(waiters: int, retry_after_s: int = 1) -> GatewayError:
    """The queue policy's bound: the tenant already has TOLLGATE_QUEUE_MAX_WAITERS callers
    waiting, so this one is refused at once rather than queued. 429, type "requests" (slow
    down), code queue_full, with Retry-After."""
    return GatewayError(
        429, f"Too many requests are already waiting in your queue ({waiters}); the request was "
        "not queued. Please retry after the Retry-After delay.",
        "requests", "queue_full", None, retry_after_s, QUEUE_FULL)


def queue_timeout(what: str, waited_s: float, retry_after_s: int) -> GatewayError:
    """A call under the queue policy waited its plan's queue_timeout_seconds for `what` (the
    resource that refused it) and gave up. 429, type "requests", code queue_timeout, with the
    Retry-After of that resource."""
    return GatewayError(
        429, f"The request waited {waited_s:.1f} s in the queue for {what} and timed out; it "
        "was not forwarded.", "requests", "queue_timeout", None, retry_after_s, QUEUE_TIMEOUT)


def quota_store_unavailable() -> GatewayError:
    return GatewayError(503, "The quota service is unavailable; the request was not forwarded. "
                        "Please retry shortly.", "server_error", "quota_store_unavailable")


def quota_store_rebuilding(retry_after_s: int = 1) -> GatewayError:
    """Redis lost the tenant's counters (its epoch marker is gone): nothing is admitted on an
    empty counter until they are rebuilt from the ledger, which takes moments."""
    return GatewayError(503, "Your quota counters are being restored after a quota store "
                        "restart; the request was not forwarded. Please retry shortly.",
                        "server_error", "quota_store_rebuilding", None, retry_after_s)


def quota_store_unsafe() -> GatewayError:
    """The quota Redis may evict or lose counters (quotas/durability.py): refuse to meter on it.
    The why (server names, settings) goes to the operator's log, not to API clients."""
    return GatewayError(503, "The quota service is misconfigured; the request was not forwarded. "
                        "The operator has been told.", "server_error", "quota_store_unsafe",
                        None, 30)


def upstream_error(status: int, message: str) -> GatewayError:
    return GatewayError(status, message, "server_error", "upstream_error")


def upstream_unavailable(retry_after_s: int) -> GatewayError:
    """Every upstream provider key for the model is resting with its circuit breaker open
    (gateway/circuit.py), some perhaps cooling down after a 429: nothing was forwarded. 503 with
    Retry-After (seconds until the first breaker half-opens), which the OpenAI SDKs retry."""
    return GatewayError(503, "Every upstream provider for this model is failing and resting; the "
                        "request was not forwarded. Please retry after the Retry-After delay.",
                        "server_error", "upstream_unavailable", None, retry_after_s,
                        UPSTREAM_UNAVAILABLE)


# What an upstream's client error may pass on to the tenant: `type`, `code` and `param` when each
# is a short token ("invalid_request_error", "context_length_exceeded", "messages[0].content");
# never its message, which names the provider, its organisation, deployments or URLs.
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.\[\]-]{1,64}")
# Larger error bodies are not parsed: a real one is a few hundred bytes.
_MAX_UPSTREAM_ERROR_BYTES = 64 * 1024
_UPSTREAM_MESSAGES = {
    400: "The upstream provider rejected the request as invalid",
    404: "The upstream provider does not serve the requested model or resource",
    409: "The upstream provider refused the request because of a conflict",
    413: "The upstream provider refused the request as too large",
    415: "The upstream provider refused the request's content type",
    422: "The upstream provider could not process the request",
}


def _safe_token(value: Any) -> str | None:
    if isinstance(value, str) and _SAFE_TOKEN.fullmatch(value):
        return value
    return None


def _upstream_error_fields(body: bytes) -> dict[str, Any]:
    if len(body) > _MAX_UPSTREAM_ERROR_BYTES:
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else {}


def upstream_client_error(status: int, body: bytes) -> GatewayError:
    """An upstream's 4xx (other than the key refusals and rate limits the gateway handles) in
    Tollgate's words: the status, a message of ours naming the parameter, and the upstream's
    `type`, `code` and `param` when they are safe short tokens, so SDKs and clients can still
    tell what was wrong."""
    fields = _upstream_error_fields(body)
    param = _safe_token(fields.get("param"))
    code = _safe_token(fields.get("code"))
    kind = _safe_token(fields.get("type")) or "invalid_request_error"
    message = _UPSTREAM_MESSAGES.get(status, f"The upstream provider refused the request "
                                             f"(HTTP {status})")
    if param is not None:
        message += f" (parameter '{param}')"
    if code is not None:
        message += f": {code}"
    return GatewayError(status, message + ".", kind, code, param)


# The attribute an error answer carries its refusal reason in (GatewayError.response).
_REFUSAL = "tollgate_refusal"


def refusal_of(response: object) -> str:
    """The refusal reason an error answer was made with (GatewayError.response), else ""."""
    return getattr(response, _REFUSAL, "")
