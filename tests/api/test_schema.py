"""The OpenAPI schema is valid, warning-free, and documents the management API only."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management import call_command


def test_schema_validates_without_warnings(tmp_path: Path) -> None:
    out = tmp_path / "schema.json"
    call_command("spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json",
                 "--file", str(out))
    paths = json.loads(out.read_text())["paths"]
    assert all(path.startswith("/api/") for path in paths)
    for expected in ("/api/tenants/", "/api/tenants/{tenant_id}/keys/",
                     "/api/tenants/{tenant_id}/usage", "/api/tenants/{tenant_id}/webhooks/",
                     "/api/tenants/{tenant_id}/members/", "/api/plans/"):
        assert expected in paths, expected
