"""The management API's pagination: `?limit=&offset=`, bounded, and strict about its input.

DRF's LimitOffsetPagination has no upper bound by default and silently ignores a malformed value
(and a 21-digit `limit` reached PostgreSQL as an out-of-range LIMIT: a 500). Here `limit` is
1..MAX_LIMIT and `offset` 0..MAX_OFFSET, the schema says so, and anything else is a 400 naming the
parameter, so a client's typo is never mistaken for "the first page".
"""

from __future__ import annotations

from typing import Any, Final

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

MAX_LIMIT: Final = 200
# Far beyond any real listing; keeps the number inside PostgreSQL's bigint OFFSET.
MAX_OFFSET: Final = 1_000_000_000


def _bounded_int(request: Request, name: str, default: int, low: int, high: int) -> int:
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
        return _bounded_int(request, self.limit_query_param, self.default_limit, 1, MAX_LIMIT)

    def get_offset(self, request: Request) -> int:
        return _bounded_int(request, self.offset_query_param, 0, 0, MAX_OFFSET)

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
