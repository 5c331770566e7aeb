"""The /v1 request and answer made with less work (gateway/v1_request.py, gateway/asgi.py
_send_answer): what a view reads of the request, and what the client receives of the answer,
are what Django's ASGIRequest and send_response give, for every kind of scope and answer."""
from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import override_settings

from gateway import v1_request as v1
from gateway.asgi import _send_answer
from gateway.v1_request import V1Request

KEY = b"Bearer tgk_" + b"a" * 40


def _scope(headers: list[tuple[bytes, bytes]], **extra: Any) -> dict[str, Any]:
    scope = {"type": "http", "http_version": "1.1", "server": ("127.0.0.1", 8400),
             "client": ("10.0.0.9", 50000), "scheme": "http", "method": "POST",
             "root_path": "", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "headers": headers}
    scope.update(extra)
    return scope


SCOPES = {
    "an SDK's call": _scope([(b"host", b"gw:8400"), (b"authorization", KEY),
                             (b"content-type", b"application/json"),
                             (b"content-length", b"42"), (b"user-agent", b"OpenAI/Python 1.50"),
                             (b"x-stainless-os", b"Linux"), (b"x-stainless-retry-count", b"0")]),
    "a repeated header, joined": _scope([(b"x-tag", b"a"), (b"accept", b"*/*"),
                                         (b"x-tag", b"b"), (b"x-tag", b"c")]),
    "underscores dropped (spoofing a hyphen)": _scope([(b"x_api_key", b"sneaky"),
                                                      (b"x-api-key", b"tgk_real")]),
    "a charset": _scope([(b"content-type", b"application/json; charset=latin-1")]),
    "an unknown charset": _scope([(b"content-type", b"application/json; charset=nope-9")]),
    "no content type": _scope([(b"authorization", KEY)]),
    "latin-1 bytes in a value": _scope([(b"x-note", "caf\u00e9".encode("latin1"))]),
    "a query string": _scope([], query_string=b"a=1&b=two&a=3", method="get"),
    "no client, no server": _scope([], client=None, server=None),
    "mounted under a root path": _scope([], root_path="/gw", path="/gw/v1/chat/completions"),
    "header names that clash with META's own": _scope([(b"query-string", b"q"),
                                                       (b"remote-addr", b"1.2.3.4"),
                                                       (b"content_length", b"9")]),
}


def _django(scope: dict[str, Any]) -> ASGIRequest:
    return ASGIRequest(scope, io.BytesIO(b'{"model":"m"}'))


def _lean(scope: dict[str, Any]) -> V1Request:
    request, error = v1.v1_request(scope, io.BytesIO(b'{"model":"m"}'))
    assert error is None and request is not None
    return request


@pytest.mark.parametrize("case", sorted(SCOPES))
def test_the_request_reads_as_djangos(case: str) -> None:
    scope = SCOPES[case]
    for _ in range(2):  # the second time from the per-process table of header names
        django_request, lean = _django(scope), _lean(scope)
        assert lean.META == django_request.META
        assert dict(lean.headers) == dict(django_request.headers)
        assert (lean.method, lean.path, lean.path_info, lean.script_name) == (
            django_request.method, django_request.path, django_request.path_info,
            django_request.script_name)
        assert list(lean.GET.lists()) == list(django_request.GET.lists())
        assert (lean.content_type, lean.content_params, lean.encoding) == (
            django_request.content_type, django_request.content_params,
            django_request.encoding)
        assert lean.read() == django_request.read() == b'{"model":"m"}'


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_the_form_data_is_read_in_the_content_types_charset_as_djangos(method: str) -> None:
    """POST read first, before anything read the content type (Django reads the request's
    charset there directly)."""
    scope = _scope([(b"content-type", b"application/x-www-form-urlencoded; charset=latin-1")],
                   method=method)
    body = "a=caf\u00e9".encode("latin-1")
    lean, _ = v1.v1_request(scope, io.BytesIO(body))
    assert lean is not None

    def form(request: Any) -> tuple[Any, ...]:
        try:
            post = request.POST
        except Exception as error:  # noqa: BLE001 - Django refuses a POST form not in UTF-8
            return ("refused", type(error).__name__)
        return ("read", post.encoding, list(post.lists()))

    assert form(lean) == form(ASGIRequest(scope, io.BytesIO(body)))


def test_a_charset_the_content_type_names_is_the_encoding_unless_one_was_set() -> None:
    scope = SCOPES["a charset"]
    assert _lean(scope).encoding == "latin-1"
    lean, django_request = _lean(scope), _django(scope)
    lean.encoding = django_request.encoding = "utf-16"
    assert lean.encoding == django_request.encoding == "utf-16"
    assert lean.content_params == django_request.content_params == {"charset": "latin-1"}


def test_a_query_string_that_is_not_utf8_is_djangos_400() -> None:
    scope = _scope([], query_string=b"a=\xff")
    request, error = v1.v1_request(scope, io.BytesIO(b""))
    django_handler = ASGIHandler.__new__(ASGIHandler)  # create_request reads its request_class only
    django_request, django_error = django_handler.create_request(scope, io.BytesIO(b""))
    assert request is None is django_request
    assert error is not None and django_error is not None
    assert error.status_code == django_error.status_code == 400


def test_names_past_the_tables_bound_are_converted_per_request(monkeypatch: pytest.MonkeyPatch,
                                                               ) -> None:
    """A client sending endless new header names cannot grow the table: past its bound a name
    is converted as Django does, every time."""
    monkeypatch.setattr(v1, "_META_NAMES", dict(v1._META_NAMES))
    monkeypatch.setattr(v1, "_META_NAMES_MAX", len(v1._META_NAMES) + 3)
    headers = [(f"x-random-{i}".encode(), b"v") for i in range(50)]
    scope = _scope(headers)
    assert _lean(scope).META == _django(scope).META
    assert len(v1._META_NAMES) == v1._META_NAMES_MAX


async def _sent(response: Any, how: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    handler = ASGIHandler.__new__(ASGIHandler)  # send_response uses no handler state
    if how == "django":
        await handler.send_response(response, send)
    else:
        await _send_answer(handler, response, send)
    return messages


def _received(messages: list[dict[str, Any]]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """What a client gets of the messages: the status, the headers, the body."""
    start, *body = messages
    assert start["type"] == "http.response.start"
    assert all(m["type"] == "http.response.body" for m in body)
    assert not body[-1].get("more_body", False)
    return start["status"], start["headers"], b"".join(m.get("body", b"") for m in body)


def _answers() -> dict[str, HttpResponse]:
    plain = HttpResponse(b'{"id":"chatcmpl-1"}', status=200, content_type="application/json",
                         headers={"x-ratelimit-remaining-tokens": "999", "x-request-id": "req_1"})
    large = HttpResponse(b"x" * (3 * 65536 + 17), status=200, content_type="application/json")
    error = JsonResponse({"error": {"message": "caf\u00e9 \u2603"}}, status=429)
    error["Retry-After"] = "7"
    latin = HttpResponse(b"", status=204)
    latin["x-note"] = "caf\u00e9"
    return {"a plain answer": plain, "a body of several chunks": large, "an error": error,
            "an empty body, a latin-1 header": latin}


@pytest.mark.parametrize("case", sorted(_answers()))
def test_the_answer_reaches_the_client_as_djangos(case: str) -> None:
    django_sent = asyncio.run(_sent(_answers()[case], "django"))
    lean_sent = asyncio.run(_sent(_answers()[case], "lean"))
    status, headers, body = _received(django_sent)
    # Django's, and its length declared (uvicorn would frame a body of unknown length in
    # chunks), except where HTTP forbids it (204).
    length = [] if status == 204 else [(b"content-length", b"%d" % len(body))]
    assert _received(lean_sent) == (status, headers + length, body)
    assert len(lean_sent) == 2  # the headers, then the body in one piece


def test_a_length_already_declared_is_kept() -> None:
    answer = HttpResponse(b'{"id":"chatcmpl-1"}', content_type="application/json")
    answer["Content-Length"] = "19"
    _, headers, body = _received(asyncio.run(_sent(answer, "lean")))
    assert [value for name, value in headers if name.lower() == b"content-length"] == [b"19"]
    assert body == b'{"id":"chatcmpl-1"}'


def test_a_stream_and_an_answer_with_cookies_go_djangos_way() -> None:
    async def chunks() -> Any:
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    stream = StreamingHttpResponse(chunks(), content_type="text/event-stream")
    sent = asyncio.run(_sent(stream, "lean"))
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", None]
    with_cookie = HttpResponse(b"{}")
    with_cookie.set_cookie("k", "v")
    status, headers, body = _received(asyncio.run(_sent(with_cookie, "lean")))
    assert (b"Set-Cookie", b"k=v; Path=/") in headers and body == b"{}"


@override_settings(FORCE_SCRIPT_NAME="/forced")
def test_a_forced_script_name_is_djangos() -> None:
    scope = _scope([], path="/forced/v1/chat/completions")
    lean, django_request = _lean(scope), _django(scope)
    assert (lean.script_name, lean.path_info, lean.META["SCRIPT_NAME"]) == (
        django_request.script_name, django_request.path_info, django_request.META["SCRIPT_NAME"])
