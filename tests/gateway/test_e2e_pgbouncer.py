"""PostgreSQL behind a real PgBouncer in transaction mode (tests/support/pgbouncer.py), with
DATABASE_PGBOUNCER=true (server-side cursors off, prepared statements pinned off): a uvicorn
server whose only database route is PgBouncer serves the console (login, a page, a key issued
through its one-use form), the management API (a read and a write) and /v1 with the issued key;
the ledger drain, run in a subprocess with the same environment, moves that call's usage event
into the ledger through PgBouncer, and the API then reports it.

PgBouncer 1.18 (Debian 12's) keeps no prepared statement across transactions: a server-side
prepared statement or a cursor WITH HOLD reaching it would fail as soon as two clients share a
server connection."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings

from gateway.mock_upstream import MockUpstream
from tests.gateway.conftest import (
    ROOT,
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    gateway_env,
    start_gateway,
    wait_until,
)
from tests.support.active_index import indexed
from tests.support.console_http import issue_key, log_in, owner_of
from tests.support.pgbouncer import PgBouncer, pgbouncer, show  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def bouncer_env(bouncer: PgBouncer) -> dict[str, str]:
    return {"DATABASE_URL": bouncer.url(settings.DATABASES["default"]["NAME"]),
            "DATABASE_PGBOUNCER": "true"}


@pytest.fixture
def bounced_server(pgbouncer: PgBouncer, provider_key: str,  # noqa: F811
                   tmp_path: Path) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path, workers=2, **bouncer_env(pgbouncer))
    yield server
    server.stop()


DRAIN = """
import json
import django
django.setup()
from django.db import connection
from billing.tasks import drain_usage
print(json.dumps({
    "drained": drain_usage(),
    "server_side_cursors_disabled": connection.settings_dict["DISABLE_SERVER_SIDE_CURSORS"],
    "prepare_threshold": connection.get_connection_params()["prepare_threshold"],
    "server_port": connection.get_connection_params().get("port"),
}))
"""


def test_console_api_v1_and_the_drain_through_pgbouncer(
        bounced_server: GatewayServer, pgbouncer: PgBouncer,  # noqa: F811
        make_tenant: MakeTenant, mock_upstream: MockUpstream, django_db_blocker: Any) -> None:
    from billing.models import UsageRecord
    from tenants.models import Tenant
    from tenants.services.management_tokens import issue_management_token

    t = make_tenant()
    owner = owner_of(django_db_blocker, t)
    with httpx.Client(base_url=bounced_server.url, timeout=30) as browser:
        assert log_in(browser, owner.username).status_code == 302
        dashboard = browser.get(f"/console/t/{owner.tenant_public_id}/")
        assert dashboard.status_code == 200
        issued = issue_key(browser, owner, "via-pgbouncer")

    token = committed(django_db_blocker, lambda: issue_management_token(
        Tenant.objects.get(pk=t.tenant_id), name="pgbouncer test", actor="test").plaintext)
    api = httpx.Client(base_url=f"{bounced_server.url}/api/tenants/{owner.tenant_public_id}",
                       headers={"Authorization": f"Bearer {token}"}, timeout=30)
    with api:
        assert api.get("/").status_code == 200
        created = api.post("/projects/", json={"slug": "bounced", "name": "Bounced"})
        assert created.status_code == 201, created.text
        assert created.json()["id"].startswith("prj_")

        answer = client_for(bounced_server, issued.plaintext, timeout=30).chat.completions.create(
            model="gpt-4o-mini", max_tokens=4,
            messages=[{"role": "user", "content": "through pgbouncer"}])
        assert answer.usage is not None
        tokens = answer.usage.total_tokens
        # The drain visits the index of active tenants, which the gateway worker writes every
        # second: run it once the call's tenant is there (else it may find nothing to drain).
        assert wait_until(lambda: indexed(t.tenant_id), timeout=10)

        drain = subprocess.run(
            [sys.executable, "-c", DRAIN], cwd=ROOT, capture_output=True, text=True, timeout=120,
            env=gateway_env(DJANGO_SETTINGS_MODULE="config.settings", **bouncer_env(pgbouncer)))
        assert drain.returncode == 0, drain.stderr[-3000:]
        report = json.loads(drain.stdout.strip().splitlines()[-1])
        assert report["drained"] >= 1
        assert report["server_side_cursors_disabled"] is True
        assert report["prepare_threshold"] is None
        assert int(report["server_port"]) == pgbouncer.port

        rows = committed(django_db_blocker, lambda: [
            r.total_tokens for r in UsageRecord.objects.filter(
                api_key__name="via-pgbouncer", tenant_id=t.tenant_id)])
        assert rows == [tokens]
        usage = api.get("/usage", params={"group_by": "key"})
        assert usage.status_code == 200, usage.text
        by_key = {r["key_name"]: (r["requests"], r["total_tokens"])
                  for r in usage.json()["results"]}
        assert by_key["via-pgbouncer"] == (1, tokens)

    # Every one of those went through PgBouncer: its pool for the test database was used.
    pools = {row["database"]: row for row in show(pgbouncer, "SHOW POOLS")}
    pool = pools[settings.DATABASES["default"]["NAME"]]
    assert pool["pool_mode"] == "transaction"
    assert int(pool["sv_idle"]) + int(pool["sv_used"]) + int(pool["sv_active"]) >= 1
