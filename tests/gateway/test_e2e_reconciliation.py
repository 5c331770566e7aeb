"""Reconciliation end to end: real calls through a gateway to the mock upstream, drained into the
ledger, compared with the mock's bill endpoint (OpenAI's usage API shape): no drift. Then a call
made with the same upstream key outside the gateway shows up as drift."""
from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.bills import MockBill
from billing.ledger import drain_tenant
from billing.models import ReconciliationRun
from billing.reconciliation import reconcile, reconcile_configured
from gateway.mock_upstream import MockUpstream, api_key_id
from quotas.runtime import get_engine
from tests.gateway.conftest import MakeTenant, client_for, committed, start_gateway

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def test_gateway_traffic_matches_the_mock_bill(mock_upstream: MockUpstream,
                                                make_tenant: MakeTenant, django_db_blocker: Any,
                                                tmp_path: Path) -> None:
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    t = make_tenant()
    secret = f"sk-reconcile-{uuid.uuid4().hex}"
    # Dedicated to the tenant, so every call of this test goes through this upstream key alone.
    key = committed(django_db_blocker, lambda: create_provider_key(
        "reconcile", base_url=mock_upstream.base_url, secret=secret, priority=100,
        tenant=Tenant.objects.get(pk=t.tenant_id)))
    server = start_gateway(tmp_path, workers=1)
    try:
        client = client_for(server, t.plaintext)
        used = {"gpt-4o-mini": [0, 0], "text-embedding-3-small": [0, 0]}
        for words, max_tokens in ((3, 5), (10, 40), (1, 1)):
            answer = client.chat.completions.create(
                model="gpt-4o-mini", max_tokens=max_tokens,
                messages=[{"role": "user", "content": " ".join(["word"] * words)}])
            assert answer.usage is not None
            used["gpt-4o-mini"][0] += answer.usage.prompt_tokens
            used["gpt-4o-mini"][1] += answer.usage.completion_tokens
        stream = client.chat.completions.create(
            model="gpt-4o-mini", max_tokens=7, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "stream me a few words"}])
        for chunk in stream:
            if chunk.usage is not None:
                used["gpt-4o-mini"][0] += chunk.usage.prompt_tokens
                used["gpt-4o-mini"][1] += chunk.usage.completion_tokens
        embedding = client.embeddings.create(model="text-embedding-3-small",
                                             input=["one two three", "four five"])
        used["text-embedding-3-small"][0] += embedding.usage.prompt_tokens
    finally:
        server.stop()

    assert committed(django_db_blocker, lambda: drain_tenant(get_engine().client, t.tenant_id)) == 5
    today = datetime.now(UTC).date()
    period = (today - timedelta(days=1), today + timedelta(days=1))  # robust across midnight
    run = reconcile(period, MockBill(mock_upstream.base_url), provider_key=key)
    rows = list(run.rows.all())
    assert run.status == ReconciliationRun.Status.OK, [(r.model, r.note) for r in rows]
    by_model: dict[str, list[int]] = {}
    for row in rows:
        assert row.difference == 0 and not row.flagged and row.note == ""
        assert row.api_key_id == api_key_id(secret) and row.tenant_id == t.tenant_id
        assert (row.ours_input, row.ours_output) == (row.theirs_input, row.theirs_output)
        assert row.ours_requests == row.theirs_requests
        totals = by_model.setdefault(row.model, [0, 0])
        totals[0] += row.theirs_input
        totals[1] += row.theirs_output
    assert by_model == used
    assert run.ours_cost_micros > 0 and run.theirs_cost_micros is None

    # The same upstream key used outside the gateway: the bill has tokens the ledger lacks.
    outside = httpx.post(f"{mock_upstream.base_url}/chat/completions",
                         headers={"Authorization": f"Bearer {secret}"},
                         json={"model": "gpt-4o-mini", "max_tokens": 50,
                               "messages": [{"role": "user", "content": "x " * 200}]})
    assert outside.status_code == 200
    [drift] = reconcile_configured(today, "mock", provider_key=key)
    assert drift.status == ReconciliationRun.Status.DRIFT and drift.source == "mock"
    [flagged] = drift.rows.filter(flagged=True)
    assert flagged.model == "gpt-4o-mini"
    assert flagged.difference == outside.json()["usage"]["total_tokens"]
