"""A gateway worker puts the tenants it serves into the index of active tenants the background
jobs visit (quotas/active.py): within a flush interval while it runs, and at its lifespan
shutdown for the marks not flushed yet."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.active_index import indexed, unindex
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    client_for,
    start_gateway,
    wait_until,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def call(server: GatewayServer, plaintext: str) -> None:
    client_for(server, plaintext).chat.completions.create(
        model="gpt-4o-mini", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_a_served_tenant_is_in_the_index_within_a_flush(gateway: GatewayServer,
                                                        make_tenant: MakeTenant) -> None:
    served, idle = make_tenant(), make_tenant()
    call(gateway, served.plaintext)
    assert wait_until(lambda: indexed(served.tenant_id), timeout=5)  # flushed every second
    assert not indexed(idle.tenant_id)


def test_a_stopping_worker_flushes_its_marks(make_tenant: MakeTenant, tmp_path: Path,
                                             provider_key: Any) -> None:
    """A worker whose periodic flush is a minute away: its marks go out at shutdown (SIGINT, a
    graceful stop), before the process ends. (A tenant's first call in the worker writes its
    mark at once, before the reserve: taken out of the index after it, the tenant's second
    call is marked in memory only, for the flush.)"""
    t = make_tenant()
    server = start_gateway(tmp_path, workers=1, GATEWAY_ACTIVE_FLUSH_SECONDS="60")
    try:
        call(server, t.plaintext)
        assert indexed(t.tenant_id)  # written before the first reserve
        unindex(t.tenant_id)
        call(server, t.plaintext)
        assert not indexed(t.tenant_id)  # not flushed yet
    finally:
        server.stop()
    assert server.process.returncode is not None
    assert indexed(t.tenant_id)
