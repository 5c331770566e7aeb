"""The /v1 views are plain async Django views: through Django's middleware (the test client, as
under WSGI) a POST needs no CSRF token, and a wrong method answers 405 in OpenAI's error shape."""
from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from gateway import views


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_proxy_path_takes_post_only(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_models_takes_get_only() -> None:
    response = Client().post("/v1/models", {})
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_post_without_csrf_token_reaches_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoKeys:
        async def authenticate(self, token: str, client: Any = None) -> None:
            return None

    class Runtime:
        auth = NoKeys()

    async def runtime() -> Any:  # a worker's runtime is not needed to refuse a bad key
        return Runtime()

    monkeypatch.setattr(views, "_runtime", runtime)
    response = Client(enforce_csrf_checks=True).post(
        "/v1/chat/completions", b"{}", content_type="application/json",
        headers={"Authorization": "Bearer tgk_not_a_key"})
    assert response.status_code == 401  # refused by the view, not by the CSRF check (403)
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response["x-request-id"].startswith("req_")
