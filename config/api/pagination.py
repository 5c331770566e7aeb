"""The management API's pagination: `?limit=&offset=`, bounded, and strict about its input;
the audit trail's by cursor (AuditCursorPagination, below).

DRF's LimitOffsetPagination has no upper bound by default and silently ignores a malformed value
(and a 21-digit `limit` reached PostgreSQL as an out-of-range LIMIT: a 500). Here `limit` is
1..MAX_LIMIT and `offset` 0..MAX_OFFSET, the schema says so, and anything else is a 400 naming the
parameter, so a client's typo is never mistaken for "the first page".
"""

from __future__ import annotations

from typing import Any, Final

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.utils.urls import replace_query_param

from config import audit_cursor
from tenants.selectors import audit_page

MAX_LIMIT: Final = 200
# Far beyond any real listing; keeps the number inside PostgreSQL's bigint OFFSET.
MAX_OFFSET: Final = 1_000_000_000


def bounded_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """The whole number `name` of the query (default when absent), low..high, or a 400 naming
    it: also for the other paged parts of a document (config/api/key_scopes.py)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # str.isdigit() accepts non-ASCII digits ("²") that int() then refuses: ASCII only.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(high)):
        raise ValidationError({name: [f"Must be a whole number from {low} to {high}."]})
    value = int(raw)
    if not low <= value <= high:
        raise ValidationError({name: [f"Must be a whole number from {low} to {high}."]})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    # default_limit is DRF's: REST_FRAMEWORK["PAGE_SIZE"] in config/settings.py.
    max_limit = MAX_LIMIT

    def get_limit(self, request: Request) -> int:
        return bounded_int(request, self.limit_query_param, self.default_limit, 1, MAX_LIMIT)

    def get_offset(self, request: Request) -> int:
        return bounded_int(request, self.offset_query_param, 0, 0, MAX_OFFSET)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {"name": self.limit_query_param, "required": False, "in": "query",
             "description": (f"Results per page (default {self.default_limit}, "
                             f"at most {MAX_LIMIT})."),
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}},
            {"name": self.offset_query_param, "required": False, "in": "query",
             "description": "How many results to skip.",
             "schema": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET}},
        ]


class AuditCursorPagination(BasePagination):
    """The audit trail's pagination: `?limit=` (1..MAX_LIMIT) and `?cursor=` (the `next` link's),
    newest first, answering {"next": url or null, "results": [...]}.

    A keyset walk (tenants.selectors.audit_page) rather than limit/offset: a tenant's trail
    grows without end (a million events is a busy year), and a COUNT of it, or an OFFSET deep
    into it, read every row up to there on each page. No count and no previous link: follow
    `next` until it is null. A cursor this server did not make is a 400 naming it.
    """

    cursor_query_param = "cursor"
    limit_query_param = "limit"

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any]:
        size = bounded_int(request, self.limit_query_param,
                            api_settings.PAGE_SIZE or MAX_LIMIT, 1, MAX_LIMIT)
        after = None
        if (raw := request.query_params.get(self.cursor_query_param)) is not None:
            try:
                after = audit_cursor.decode(raw)
            except audit_cursor.BadCursor as exc:
                raise ValidationError({self.cursor_query_param: [str(exc)]}) from None
        rows, following = audit_page(queryset, after, size)
        self._next = None
        if following is not None:
            self._next = replace_query_param(request.build_absolute_uri(),
                                             self.cursor_query_param,
                                             audit_cursor.encode(following))
        return rows

    def get_paginated_response(self, data: Any) -> Response:
        return Response({"next": self._next, "results": data})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["next", "results"],
            "properties": {
                "next": {"type": "string", "nullable": True, "format": "uri",
                         "description": "The next (older) page; null on the last one."},
                "results": schema,
            },
        }

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {"name": self.limit_query_param, "required": False, "in": "query",
             "description": (f"Results per page (default {api_settings.PAGE_SIZE}, "
                             f"at most {MAX_LIMIT})."),
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}},
            {"name": self.cursor_query_param, "required": False, "in": "query",
             "description": "Where to continue: the cursor in the previous page's `next` link.",
             "schema": {"type": "string", "maxLength": audit_cursor.MAX_CURSOR_LENGTH}},
        ]
