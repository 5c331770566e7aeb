"""The /v1 view reads the client's headers for the upstream only for a dialect that passes some
(Dialect.passes_headers; request.headers is built from the whole of META on first use): a
dialect that would pass headers must say so, or its upstream would never be told them."""
from __future__ import annotations

from django.test import RequestFactory

from gateway.bodies import Endpoint
from gateway.dialects import ANTHROPIC_PASSED_HEADERS, dialect_for
from gateway.views import _api_key, _bearer, _read_body
from gateway.errors import Api

CLIENT = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31",
          "authorization": "Bearer tgk_x", "x-api-key": "tgk_y", "content-type": "application/json"}


def test_a_dialect_that_passes_headers_says_so() -> None:
    for endpoint in Endpoint:
        dialect = dialect_for(endpoint)
        assert bool(dialect.passed_headers(CLIENT)) == dialect.passes_headers, endpoint
    messages = dialect_for(Endpoint.MESSAGES)
    assert messages.passed_headers(CLIENT) == {name: CLIENT[name]
                                               for name in ANTHROPIC_PASSED_HEADERS}


def test_the_key_and_length_are_read_from_meta_as_request_headers_has_them() -> None:
    factory = RequestFactory()
    request = factory.post("/v1/messages", data=b'{"a": 1}', content_type="application/json",
                           headers={"Authorization": "bearer  tgk_abc ", "X-Api-Key": " tgk_k "})
    assert _bearer(request) == "tgk_abc"
    assert _read_body(request) == b'{"a": 1}'
    keyed = factory.post("/v1/messages", data=b"{}", content_type="application/json",
                         headers={"X-Api-Key": " tgk_k "})
    assert _api_key(keyed, Api.ANTHROPIC) == "tgk_k"
    assert _api_key(keyed, Api.OPENAI) is None
    assert request.headers.get("Authorization") == "bearer  tgk_abc "  # the same entry
