from collections.abc import Awaitable, Callable
from typing import Any

from django.urls import path

from gateway import other_endpoints, stored_responses, views

_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/chat/completions": views.chat_completions,
    "v1/completions": views.completions,
    "v1/embeddings": views.embeddings,
    "v1/responses": views.responses,
    "v1/messages": views.messages,
    "v1/models": other_endpoints.list_models,
    "v1/moderations": other_endpoints.moderations,
    "v1/messages/count_tokens": other_endpoints.count_tokens,
    "v1/conversations": stored_responses.conversations,
    "healthz": views.healthz,
    "readyz": views.readyz,
    # /v1 itself: a JSON 404 like every other unknown /v1 path (the last prefix below).
    "v1": other_endpoints.v1_other,
    "v1/": other_endpoints.v1_other,
    # An SDK whose base URL lacks /v1: a JSON 404 naming the path meant, not Django's HTML page.
    **{route: other_endpoints.missing_v1 for route in other_endpoints.BASE_URL_MISTAKES},
}

# Paths with an id in them: the view gets the rest of the path as `rest`. The first prefix that
# matches serves the path (in this order), so "v1/" stays last: every other /v1 path, answered in
# JSON (a model by id, an unsupported endpoint, else 404), never Django's HTML page.
_PREFIX_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/responses/": stored_responses.response_item,
    "v1/conversations/": stored_responses.conversation_item,
    "v1/": other_endpoints.v1_other,
}

urlpatterns = [path(route, view) for route, view in _ROUTES.items()] + [
    path(f"{prefix}<path:rest>", view) for prefix, view in _PREFIX_ROUTES.items()]


def direct_routes() -> dict[str, Callable[..., Awaitable[Any]]]:
    """Exact request paths served by gateway.asgi.GatewayRouter without Django's middleware."""
    return {f"/{route}": view for route, view in _ROUTES.items()}


def prefix_routes() -> dict[str, Callable[..., Awaitable[Any]]]:
    """Path prefixes served by gateway.asgi.GatewayRouter likewise (the rest of the path is
    the view's `rest` argument)."""
    return {f"/{prefix}": view for prefix, view in _PREFIX_ROUTES.items()}
