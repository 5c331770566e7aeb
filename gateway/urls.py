from collections.abc import Awaitable, Callable
from typing import Any

from django.urls import path

from gateway import views

_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/chat/completions": views.chat_completions,
    "v1/completions": views.completions,
    "v1/embeddings": views.embeddings,
    "v1/responses": views.responses,
    "v1/messages": views.messages,
    "v1/models": views.list_models,
    "healthz": views.healthz,
    "readyz": views.readyz,
}

urlpatterns = [path(route, view) for route, view in _ROUTES.items()]


def direct_routes() -> dict[str, Callable[..., Awaitable[Any]]]:
    """Exact request paths served by gateway.asgi.GatewayRouter without Django's middleware."""
    return {f"/{route}": view for route, view in _ROUTES.items()}
