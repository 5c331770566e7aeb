from collections.abc import Awaitable, Callable
from typing import Any

from django.urls import path

from gateway import stored_responses, views

_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/chat/completions": views.chat_completions,
    "v1/completions": views.completions,
    "v1/embeddings": views.embeddings,
    "v1/responses": views.responses,
    "v1/messages": views.messages,
    "v1/models": views.list_models,
    "v1/conversations": stored_responses.conversations,
    "healthz": views.healthz,
    "readyz": views.readyz,
}

# Paths with an id in them: the view gets the rest of the path as `rest`.
_PREFIX_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/responses/": stored_responses.response_item,
    "v1/conversations/": stored_responses.conversation_item,
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
