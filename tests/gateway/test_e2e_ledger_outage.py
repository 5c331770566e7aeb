"""Nothing is lost: the gateway keeps serving while PostgreSQL is down (its hot path never
touches the database), usage events wait in Redis, and the drain records every one of them once
PostgreSQL is back."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from django.db import OperationalError, connection

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from config import embedded
from quotas.runtime import get_engine
from tests.conftest import DATA_DIR
from tests.gateway.conftest import GatewayServer, MakeTenant, client_for, committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def test_usage_survives_a_database_outage(gateway: GatewayServer, make_tenant: MakeTenant,
                                          django_db_blocker: Any) -> None:
    t = make_tenant(requests_per_second=-1)
    client = client_for(gateway, t.plaintext)
    warm = [client.chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                           messages=[{"role": "user", "content": "warm"}])
            for _ in range(16)]  # every worker has the key cached before the outage

    embedded.stop_postgres(DATA_DIR / "pg")
    try:
        during = [client.chat.completions.create(model="gpt-4o-mini", max_tokens=3,
                                                 messages=[{"role": "user", "content": "down"}])
                  for _ in range(20)]
        assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 503
        with pytest.raises(OperationalError):
            committed(django_db_blocker, lambda: drain_tenant(get_engine().client, t.tenant_id))
    finally:
        embedded.start_postgres(DATA_DIR / "pg")
        connection.close()  # this test's connection died with the server

    engine = get_engine()
    moved = committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    assert moved == len(warm) + len(during)
    rows = committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id).values_list("input_tokens",
                                                                       "output_tokens")))
    assert len(rows) == 36
    assert sum(i + o for i, o in rows) == sum(r.usage.total_tokens for r in warm + during)
    assert engine.counter(t.tag, "tenant").used == sum(i + o for i, o in rows)
