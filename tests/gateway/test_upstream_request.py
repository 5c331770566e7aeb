"""gateway/forward.py upstream_request: the request the gateway hands its upstream transport,
built without httpx's header bookkeeping, must be the request httpx builds from the same
arguments: method, URL, every header in the same order with the same case, body, stream type
and extensions."""
from __future__ import annotations

import httpx
import pytest

from gateway.forward import upstream_request

URLS = ["https://api.openai.com/v1/chat/completions", "http://127.0.0.1:18099/v1/messages",
        "https://example.com:443/v1/responses", "http://[::1]:8080/v1/embeddings",
        "https://upstream.example:8443/prefix/v1/chat/completions?api-version=2024-10-21"]

HEADERS = [
    # What a call sends: the client's defaults, the dialect's auth, the content type, the id.
    {"Accept": "*/*", "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive",
     "User-Agent": "python-httpx/0.28", "Authorization": "Bearer sk-x",
     "Content-Type": "application/json", "X-Request-Id": "req_1"},
    {"x-api-key": "sk-ant", "anthropic-version": "2023-06-01", "anthropic-beta": "a,b",
     "Content-Type": "application/json", "X-Request-Id": "req_2"},
    # Headers httpx would otherwise add, given already: kept as given, where given.
    {"Host": "proxy.internal", "Content-Type": "application/json"},
    {"content-length": "999", "X-Request-Id": "req_3"},
    {"Transfer-Encoding": "chunked", "X-Request-Id": "req_4"},
    {},
]


def _same(ours: httpx.Request, theirs: httpx.Request) -> None:
    assert ours.method == theirs.method == "POST"
    assert ours.url == theirs.url
    assert ours.headers.raw == theirs.headers.raw
    assert ours.content == theirs.content
    assert type(ours.stream) is type(theirs.stream)
    assert ours.extensions == theirs.extensions


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("headers", HEADERS)
@pytest.mark.parametrize("payload", [b'{"model":"gpt-4o-mini","messages":[]}', b"", "é".encode()])
def test_the_request_httpx_builds(url: str, headers: dict[str, str], payload: bytes) -> None:
    extensions = {"timeout": {"connect": 5.0, "read": 60.0, "write": 60.0, "pool": 10.0}}
    ours = upstream_request(httpx.URL(url), payload, headers, extensions)
    theirs = httpx.Request("POST", httpx.URL(url), content=payload, headers=headers,
                           extensions=extensions)
    _same(ours, theirs)


def test_bytes_written_by_the_native_transport_are_the_same() -> None:
    from gateway.upstream_http import _request_head

    url = httpx.URL(URLS[0])
    headers = HEADERS[0]
    payload = b'{"model":"gpt-4o-mini"}'
    ours = upstream_request(url, payload, headers, {})
    theirs = httpx.Request("POST", url, content=payload, headers=headers)
    assert _request_head(ours) + ours.content == _request_head(theirs) + theirs.content
