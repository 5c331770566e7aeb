"""The "aiohttp" upstream transport (GATEWAY_UPSTREAM_TRANSPORT=aiohttp): httpx-aiohttp's
AiohttpTransport, aiohttp's client and its C parser behind httpx's transport API, with the error
meanings the gateway relies on. Built by gateway.upstream_http.make_transport; measured against
the native transport by `make bench` (config/bench.py, "transports")."""
from __future__ import annotations

import ssl
from collections.abc import AsyncIterator

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport


class Transport(AiohttpTransport):
    """httpx-aiohttp's transport, with httpx errors that mean what NativeTransport's mean.

    Its own mapping (httpx-aiohttp 0.2) turns every aiohttp connection error into ConnectTimeout,
    which the gateway takes for "nothing was sent" and retries on the next provider key: a server
    that hung up after reading the request would be sent the call twice. A malformed answer
    escaped as aiohttp's own ClientResponseError, past the gateway's `except httpx.HTTPError`.
    And a body read that was cancelled or failed (the gateway's view is cancelled when its client
    leaves) kept its pool slot until the response was garbage collected."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise _httpx_error(exc) from exc
        response.stream = _Body(response.stream)  # type: ignore[arg-type]
        return response


def aiohttp_transport(tls: ssl.SSLContext, limits: httpx.Limits) -> Transport:
    def session() -> aiohttp.ClientSession:
        # Made on the first request, inside the worker's event loop. No cookie jar: an API call
        # carries none, and the default jar costs a lookup per request and per answer.
        connector = aiohttp.TCPConnector(limit=limits.max_connections or 0,
                                         keepalive_timeout=limits.keepalive_expiry, ssl=tls)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                     auto_decompress=False)

    return Transport(verify=tls, limits=limits, client=session)


class _Body(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise _httpx_error(exc) from exc
        finally:
            await self.aclose()  # as the native _Body: a failed or cancelled read frees the slot

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._inner.aclose()


def _httpx_error(exc: Exception) -> Exception:
    """The httpx error for an aiohttp one (raised as is, or wrapped by httpx-aiohttp's mapping),
    with NativeTransport's meaning: a Connect* error only when nothing was sent."""
    cause = exc.__cause__ if isinstance(exc, httpx.HTTPError) else exc
    if not isinstance(cause, aiohttp.ClientError):
        return exc
    message = str(cause) or type(cause).__name__
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        # aiohttp's connect timeout covers both waiting for a pool slot and connecting.
        return httpx.ConnectTimeout(message)
    if isinstance(cause, aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(cause, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx.UnsupportedProtocol(message)
    if isinstance(cause, aiohttp.ClientOSError):
        return httpx.ReadError(message)  # a reset or a failed write: the request may be out
    return httpx.RemoteProtocolError(message)  # a hang-up, a short or a malformed answer
