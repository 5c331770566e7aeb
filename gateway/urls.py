from collections.abc import Awaitable, Callable
from typing import Any

from django.urls import path

from gateway import views

_ROUTES: dict[str, Callable[..., Awaitable[Any]]] = {
    "v1/chat/completions": views.ChatCompletionsView.as_view(),
    "v1/completions": views.CompletionsView.as_view(),
    "v1/embeddings": views.EmbeddingsView.as_view(),
    "v1/models": views.ModelsView.as_view(),
    "healthz": views.healthz,
    "readyz": views.readyz,
}

urlpatterns = [path(route, view) for route, view in _ROUTES.items()]


def direct_routes() -> dict[str, Callable[..., Awaitable[Any]]]:
    """Exact request paths served by gateway.asgi.GatewayRouter without Django's middleware."""
    return {f"/{route}": view for route, view in _ROUTES.items()}
