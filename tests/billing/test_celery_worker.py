"""The background jobs in a real Celery worker with beat, over the session's Redis and
PostgreSQL: a crashed request's hold is swept and every call reaches the ledger."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from billing.models import UsageRecord
from quotas.engine import QuotaEngine, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.conftest import celery_worker_process
from tests.gateway.conftest import committed, gateway_env, wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


@pytest.fixture
def celery_worker(django_db_setup: None, tmp_path: Path) -> Iterator[Path]:
    # The shortest stale threshold the settings accept: a hold must be able to end (deadline,
    # stream drain, two Redis timeouts) within half of it.
    env = gateway_env(QUOTA_STALE_HOLD_SECONDS="6", GATEWAY_CALL_DEADLINE_SECONDS="0.5",
                      GATEWAY_STREAM_DRAIN_SECONDS="0.5", REDIS_SOCKET_TIMEOUT="1",
                      TOLLGATE_SWEEP_INTERVAL_SECONDS="0.5", TOLLGATE_DRAIN_INTERVAL_SECONDS="0.5")
    with celery_worker_process(tmp_path, env) as log:
        yield log


def test_worker_sweeps_a_crashed_hold_and_drains_every_call_into_the_ledger(
    celery_worker: Path, django_db_blocker: Any
) -> None:
    def setup() -> tuple[int, int, int]:
        tenant = create_tenant(f"celery-{os.getpid()}", plan_name="free", actor="test")
        project = create_project(tenant, "web", actor="test")
        return tenant.pk, project.pk, issue_key(project, actor="test").api_key.pk

    tenant_id, project_id, key_id = committed(django_db_blocker, setup)
    engine: QuotaEngine = get_engine()
    tag = tenant_tag(tenant_id)
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
    meta = json.dumps({"p": project_id, "k": key_id, "m": "gpt-4o-mini", "ep": "chat/completions"})
    for i in range(5):
        hold = engine.reserve(ReserveRequest(tag, f"ok-{i}", 100, limits, meta=meta)).hold
        engine.settle(hold, 40, json.dumps({"in": 30, "out": 10, "st": 200}))
    # A gateway process that died mid-request: its hold is never ended by the gateway.
    engine.reserve(ReserveRequest(tag, "crashed", 500, limits, meta=meta))

    def ledger() -> dict[str, str]:
        return committed(django_db_blocker, lambda: dict(
            UsageRecord.objects.filter(tenant_id=tenant_id).values_list("request_id", "status")))

    assert wait_until(lambda: len(ledger()) == 6, timeout=30), ledger()
    assert ledger() == {**{f"ok-{i}": "settled" for i in range(5)}, "crashed": "swept"}
    counter = engine.counter(tag, "tenant")
    assert (counter.used, counter.pending) == (200, 0)
    assert engine.open_hold_ids(tag) == []
