"""The management routes (/api/ and /console/), read from Django's URL resolver, so that tests
walking every route cover a route added later without being told about it."""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver

PREFIXES = ("api/", "console/")


@dataclass(frozen=True)
class Found:
    name: str
    pattern: URLPattern
    prefix: str

    @property
    def kwargs(self) -> tuple[str, ...]:
        regex = self.pattern.pattern.regex
        return tuple(regex.groupindex)

    @property
    def view_class(self) -> Any:
        return getattr(self.pattern.callback, "cls", None) or getattr(
            self.pattern.callback, "view_class", None)

    @property
    def answers_get(self) -> bool:
        """Whether the view has a GET, read from the view itself: a class view's `get`, or the
        methods a function view's require_http_methods() lets through (none: all of them)."""
        cls = self.view_class
        if cls is not None:
            allowed = getattr(cls, "http_method_names", ["get"])
            return hasattr(cls, "get") and "get" in allowed
        view = self.pattern.callback
        while view is not None:  # down the decorators (functools.wraps sets __wrapped__)
            methods = inspect.getclosurevars(view).nonlocals.get("request_method_list")
            if methods is not None:
                return "GET" in methods
            view = getattr(view, "__wrapped__", None)
        return True


def walk(patterns: list[Any], prefix: str = "") -> Iterator[Found]:
    """Every named URL pattern below `patterns`, with the path of the resolvers above it."""
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from walk(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern) and entry.name:
            yield Found(entry.name, entry, prefix)


def management_routes() -> dict[str, Found]:
    """Every named route under /api/ and /console/, by name (names are unique)."""
    routes: dict[str, Found] = {}
    for found in walk(get_resolver().url_patterns):
        if (found.prefix + str(found.pattern.pattern)).startswith(PREFIXES):
            assert found.name not in routes, f"two routes named {found.name}"
            routes[found.name] = found
    return routes
