"""The request object of the /v1 calls the router serves (gateway/asgi.py): Django's
ASGIRequest, made with less work per call.

Django's ASGIRequest builds its META by turning every header's name into its CGI form
("x-stainless-os" -> "HTTP_X_STAINLESS_OS": a decode, an upper, a replace and a format per
header, on every request), and parses the Content-Type's parameters at once. A /v1 call reads
two or three headers and never its content type (bodies are parsed as JSON bytes,
gateway/bodies.py). Here the names' CGI forms are kept per process (the names clients send are
few: an SDK's dozen), and the content type is parsed when first read. Measured in a one-client
call: 16-19 us for Django's, 7-9 us for this one (docs/benchmarks.md, "the /v1 request made with
less work").

What a view can read is what Django's request gives: the same META (same keys and values, the
same rules for underscores and repeated headers), headers, GET, path, method, read(), and the
same content_type, content_params and encoding once read."""
from __future__ import annotations

import codecs
import logging
from collections.abc import Iterable
from typing import IO, Any

from django.core.handlers.asgi import ASGIRequest, get_script_prefix
from django.http import HttpResponse, HttpResponseBadRequest
from django.utils.functional import cached_property
from django.utils.http import parse_header_parameters

# Django's logger for this refusal (ASGIHandler.create_request logs it there).
log = logging.getLogger("django.request")

# Header name (bytes, as the ASGI scope gives it) -> its META key, or None for a name Django
# drops (one with an underscore: it would be ambiguous with a hyphen). Bounded: a client may
# send any names; past the bound, names are converted per request as Django does.
_META_NAMES: dict[bytes, str | None] = {b"content-length": "CONTENT_LENGTH",
                                        b"content-type": "CONTENT_TYPE"}
_META_NAMES_MAX = 512
_MISSING = object()  # a name not yet seen (None is a known answer: the name is dropped)


def _meta_name(name: bytes) -> str | None:
    """Django's ASGIRequest rule for a header's META key, kept per process."""
    known = _META_NAMES.get(name, _MISSING)
    if known is not _MISSING:
        return known  # type: ignore[return-value]
    text = name.decode("latin1")
    meta = None if "_" in text else "HTTP_" + text.upper().replace("-", "_")
    if len(_META_NAMES) < _META_NAMES_MAX:
        _META_NAMES[name] = meta
    return meta


def _headers_meta(meta: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> None:
    for name, value in headers:
        key = _meta_name(name)
        if key is None:
            continue
        text = value.decode("latin1")
        # A header's key (HTTP_* or CONTENT_*) is never one of META's own: one already there
        # is this header repeated, joined as Django does.
        previous = meta.get(key)
        meta[key] = text if previous is None else previous + "," + text


class V1Request(ASGIRequest):
    """ASGIRequest's attributes, made as its __init__ makes them but for the two costs above."""

    def __init__(self, scope: dict[str, Any], body_file: IO[bytes]) -> None:  # noqa: D107
        # Not super().__init__(): this is its work, less the per-header conversion and the
        # content type's parsing.
        self.scope = scope
        self._post_parse_error = False
        self._read_started = False
        self.resolver_match = None
        path = scope["path"]
        self.path = path
        self.script_name = script_name = get_script_prefix(scope)
        self.path_info = path.removeprefix(script_name) if script_name else path
        self.method = method = scope["method"].upper()
        query_string = scope.get("query_string", "")
        if isinstance(query_string, bytes):
            query_string = query_string.decode()  # UnicodeDecodeError: 400, v1_request()
        meta: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "QUERY_STRING": query_string,
            "SCRIPT_NAME": script_name,
            "PATH_INFO": self.path_info,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
        }
        client = scope.get("client")
        if client:
            meta["REMOTE_ADDR"] = meta["REMOTE_HOST"] = client[0]
            meta["REMOTE_PORT"] = client[1]
        server = scope.get("server")
        if server:
            meta["SERVER_NAME"] = server[0]
            meta["SERVER_PORT"] = str(server[1])
        else:
            meta["SERVER_NAME"] = "unknown"
            meta["SERVER_PORT"] = "0"
        _headers_meta(meta, scope.get("headers", ()))
        self.META = meta
        self._stream = body_file

    @cached_property
    def _content_type(self) -> tuple[str, dict[str, str]]:
        content_type, params = parse_header_parameters(self.META.get("CONTENT_TYPE", ""))
        charset = params.get("charset")
        if charset is not None and self.__dict__.get("_encoding") is None:
            try:
                codecs.lookup(charset)
            except LookupError:
                pass
            else:
                self._encoding = charset
        return content_type, params

    @property
    def content_type(self) -> str:  # type: ignore[override]
        return self._content_type[0]

    @content_type.setter
    def content_type(self, value: str) -> None:
        self.__dict__["_content_type"] = (value, self._content_type[1])

    @property
    def content_params(self) -> dict[str, str]:  # type: ignore[override]
        return self._content_type[1]

    @content_params.setter
    def content_params(self, value: dict[str, str]) -> None:
        self.__dict__["_content_type"] = (self._content_type[0], value)

    @property
    def encoding(self) -> str | None:  # type: ignore[override]
        self._content_type  # noqa: B018 - the Content-Type's charset, if any, is read first
        return self._encoding

    @encoding.setter
    def encoding(self, value: str | None) -> None:
        self._content_type  # noqa: B018 - a charset read later must not override this
        ASGIRequest.encoding.fset(self, value)  # type: ignore[attr-defined]

    def _load_post_and_files(self) -> None:
        # Django's reads self._encoding directly: the Content-Type's charset is read first.
        self._content_type  # noqa: B018
        super()._load_post_and_files()


def v1_request(scope: dict[str, Any], body_file: IO[bytes],
               ) -> tuple[V1Request, None] | tuple[None, HttpResponse]:
    """(request, None), or (None, the 400 Django answers) for a query string that is not UTF-8:
    ASGIHandler.create_request's contract."""
    try:
        return V1Request(scope, body_file), None
    except UnicodeDecodeError:
        log.warning("Bad Request (UnicodeDecodeError)", exc_info=True,
                    extra={"status_code": 400})
        return None, HttpResponseBadRequest()
