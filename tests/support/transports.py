"""End-to-end tests run through each upstream transport (GATEWAY_UPSTREAM_TRANSPORT): where a
transport is known to behave otherwise, its run is an xfail saying how. Not strict, unlike
tests/gateway/test_upstream_http.py, whose case for each difference is staged exactly: end to end
a difference may depend on timing (whether the upstream's hang-up arrives in the same read as its
last events), so a run that happens to pass is no sign of a fix."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.conftest import GatewayServer, start_gateway

# aiohttp's reader raises a hang-up before the body pieces that arrived with it.
CUT_LOSES_LAST_EVENTS = (
    "aiohttp's reader raises the hang-up before the events that came with it "
    "(test_upstream_http: test_pieces_that_arrived_before_a_hang_up_are_read_before_its_error): "
    "the client gets none of them and the tenant is charged the input alone")


def transport_gateway(request: pytest.FixtureRequest, tmp: Path) -> Iterator[GatewayServer]:
    """The body of a module fixture parametrized over TRANSPORTS: the session's `gateway` for
    native (the default), else a gateway of two workers on that transport."""
    if request.param == "native":
        yield request.getfixturevalue("gateway")
        return
    server = start_gateway(tmp, workers=2, GATEWAY_UPSTREAM_TRANSPORT=request.param)
    yield server
    server.stop()


def known_difference(request: pytest.FixtureRequest, fixture: str, **reasons: str) -> None:
    """Make this run an xfail when the transport its `fixture` (parametrized over TRANSPORTS)
    runs on is one of `reasons`' keys."""
    kind = request.node.callspec.params[fixture]
    if kind in reasons:
        request.applymarker(pytest.mark.xfail(strict=False, reason=reasons[kind]))
