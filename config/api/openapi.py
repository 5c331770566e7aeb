"""The management API's OpenAPI schema (drf-spectacular): the preprocessing hook that keeps the
schema to /api/ only, and the description of the bearer management tokens.

The hook is named in settings (SPECTACULAR_SETTINGS["PREPROCESSING_HOOKS"]); the extension
registers itself when this module is imported, which config/api/urls.py does.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


def management_api_only(endpoints: list[tuple[str, str, str, Any]], **_: Any) -> list[Any]:
    # /v1 is OpenAI's API, documented by OpenAI's own reference; /metrics is Prometheus text.
    return [endpoint for endpoint in endpoints if endpoint[0].startswith("/api/")]


class ManagementTokenScheme(OpenApiAuthenticationExtension):
    target_class = "config.api.token_authentication.ManagementTokenAuthentication"
    name = "managementToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A management token, `Authorization: Bearer tgm_...` (not a /v1 key).",
        }
