"""The management API's JSON parser: DRF's, with a bound on nesting depth.

DRF's JSONParser lets Python's RecursionError out of a deeply nested body (a 500 with a
traceback); this one answers 400 in the API's error shape (`{"detail": ...}`) for any body
nested deeper than JSON_MAX_DEPTH, the bound /v1 uses too (gateway/bodies.py).
"""
from __future__ import annotations

import json
from typing import IO, Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser
from rest_framework.utils.json import strict_constant

from gateway.bodies import nested_deeper_than, too_deep_message


class BoundedJSONParser(JSONParser):
    def parse(self, stream: IO[bytes], media_type: str | None = None,
              parser_context: dict[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        raw = stream.read() if stream is not None else b""
        limit = settings.JSON_MAX_DEPTH
        try:
            data = json.loads(raw.decode(encoding),
                              parse_constant=strict_constant if self.strict else None)
        except RecursionError:
            raise ParseError(too_deep_message(limit)) from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise ParseError(f"JSON parse error - {exc}") from None
        if isinstance(data, (dict, list)) and nested_deeper_than(raw, data, limit):
            raise ParseError(too_deep_message(limit))
        return data
