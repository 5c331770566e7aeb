"""The management API's OpenAPI schema (drf-spectacular): the preprocessing hook that keeps the
schema to /api/ only, and the description of the bearer management tokens.

The hook is named in settings (SPECTACULAR_SETTINGS["PREPROCESSING_HOOKS"]); the extension
registers itself when this module is imported, which config/api/urls.py does.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema


def management_api_only(endpoints: list[tuple[str, str, str, Any]], **_: Any) -> list[Any]:
    # /v1 is OpenAI's API, documented by OpenAI's own reference; /metrics is Prometheus text.
    return [endpoint for endpoint in endpoints if endpoint[0].startswith("/api/")]


class ManagementAutoSchema(AutoSchema):
    """Request bodies are documented as JSON only: the one encoding every endpoint's fields fit
    (lists, nulls, nested objects). Form encodings are still parsed, for older clients, but the
    contract a generated client (or the schema-driven tests) works from is JSON."""

    def map_parsers(self) -> list[Any]:
        return [media for media in super().map_parsers() if media == "application/json"]


class ManagementTokenScheme(OpenApiAuthenticationExtension):
    target_class = "config.api.token_authentication.ManagementTokenAuthentication"
    name = "managementToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A management token, `Authorization: Bearer tgm_...` (not a /v1 key).",
        }


# -- the errors every operation may answer --------------------------------------------------------
# DRF's error bodies: {"detail": "..."} for 401/403/404/405/406/415/429, field messages for a 400
# ({"field": ["..."]}, {"non_field_errors": ["..."]}). An operation's own documentation of a status
# (e.g. the quota's 503) is kept; a status it lists without a body gets the shared body.

_ERROR = {"$ref": "#/components/schemas/Error"}
_FIELD_ERRORS = {"$ref": "#/components/schemas/FieldErrors"}
_ERROR_COMPONENTS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "properties": {"detail": {"type": "string"}},
        "required": ["detail"],
    },
    "FieldErrors": {
        "type": "object",
        "description": "Messages by field name (non_field_errors: about the request as a whole).",
        "additionalProperties": {},
    },
}
_EVERY_OPERATION: dict[str, tuple[str, dict[str, Any]]] = {
    "401": ("Not authenticated: no, or an invalid, expired or revoked management token.", _ERROR),
    "403": ("Not allowed: the caller's role in the tenant, or the token's scope, does not "
            "allow this.", _ERROR),
    "406": ("Not acceptable: the API answers in JSON only (and the report files in their own "
            "type).", _ERROR),
    "429": ("Too many requests.", _ERROR),
}
_WITH_INPUT = ("400", "Invalid input: messages by field name.", _FIELD_ERRORS)
_WITH_BODY = ("415", "Unsupported media type: send JSON, a form or multipart.", _ERROR)
_WITH_PATH = ("404", "No such object (or one the caller cannot see).", _ERROR)
_HTTP_METHODS = ("get", "put", "post", "patch", "delete", "head", "options")


def _add(responses: dict[str, Any], code: str, description: str, schema: dict[str, Any]) -> None:
    response = responses.setdefault(code, {"description": description})
    if not response.get("content"):
        response["content"] = {"application/json": {"schema": schema}}


def _anchor_path_patterns(operation: dict[str, Any]) -> None:
    # drf-spectacular copies a URL regex group as the parameter's pattern, as "^csv|xlsx$":
    # that is "^csv" or "xlsx$", so "csv-anything" would pass. Anchor the whole alternation, as
    # the URL resolver does.
    for parameter in operation.get("parameters", []):
        schema = parameter.get("schema", {})
        pattern = schema.get("pattern")
        if parameter.get("in") != "path" or not pattern or pattern.startswith("^(?:"):
            continue
        inner = pattern.removeprefix("^")
        if inner.endswith("$") and not inner.endswith("\\$"):
            inner = inner[:-1]
        schema["pattern"] = f"^(?:{inner})$"


def _document_operation(method: str, operation: dict[str, Any]) -> None:
    _anchor_path_patterns(operation)
    responses = operation.setdefault("responses", {})
    for code, (description, schema) in _EVERY_OPERATION.items():
        _add(responses, code, description, schema)
    kinds = {parameter.get("in") for parameter in operation.get("parameters", [])}
    if "path" in kinds:
        _add(responses, *_WITH_PATH)
    # Input to validate, or a change the object's state may refuse (revoking a used invitation,
    # removing the last owner): a 400 with messages.
    if "query" in kinds or "requestBody" in operation or method != "get":
        _add(responses, *_WITH_INPUT)
    if "requestBody" in operation:
        _add(responses, *_WITH_BODY)
    # An error a view documents with a description only still has a body: the shared one.
    for code, response in responses.items():
        if code.isdigit() and int(code) >= 400 and not response.get("content"):
            response["content"] = {"application/json": {
                "schema": _FIELD_ERRORS if code == "400" else _ERROR}}


def document_common_errors(result: dict[str, Any], **_: Any) -> dict[str, Any]:
    """Postprocessing hook: every operation documents the errors it can answer, with their
    bodies, so that the schema is the whole contract (a client generated from it knows every
    status; tests/security/test_api_schema_fuzz.py holds the server to it)."""
    result.setdefault("components", {}).setdefault("schemas", {}).update(_ERROR_COMPONENTS)
    for path_item in result.get("paths", {}).values():
        for method in _HTTP_METHODS:
            if method in path_item:
                _document_operation(method, path_item[method])
    return result
