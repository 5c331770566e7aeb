"""OpenAPI description of the bearer management tokens (drf-spectacular extension).

Imported by tenants.api.resources so it is registered whenever the API routes load.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ManagementTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.api.authentication.ManagementTokenAuthentication"
    name = "managementToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A management token, `Authorization: Bearer tgm_...` (not a /v1 key).",
        }
