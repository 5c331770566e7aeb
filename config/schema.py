"""OpenAPI schema hooks (drf-spectacular): the schema documents the management API only."""

from __future__ import annotations

from typing import Any


def management_api_only(endpoints: list[tuple[str, str, str, Any]], **_: Any) -> list[Any]:
    # /v1 is OpenAI's API, documented by OpenAI's own reference; /metrics is Prometheus text.
    return [endpoint for endpoint in endpoints if endpoint[0].startswith("/api/")]
