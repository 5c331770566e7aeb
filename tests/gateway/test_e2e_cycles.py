"""End to end: a tenant with a billing-day cycle in its own time zone (issue 14, reset cycles).

The gateway caches the tenant's key with its schedule; the change of cycle reaches every worker
(the tenant's invalidation), the calls after it count in the new cycle window (the first one,
cut at the switch), and the cost report of that window equals the ledger and the counter."""
from __future__ import annotations

import csv
import io
import time
from datetime import date
from typing import Any

import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from billing.reports import tenant_period, to_csv
from quotas.cycles import calendar_for, change_cycle, report_span, schedule_for
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import Tenant
from tests.gateway.conftest import GatewayServer, MakeTenant, client_for, committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]
HI = [{"role": "user", "content": "hello there"}]


def redis_ms() -> int:
    seconds, micros = get_engine().client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_billing_day_tenant_counts_in_its_cycle_and_its_report_equals_the_ledger(
        gateway: GatewayServer, make_tenant: MakeTenant, django_db_blocker: Any) -> None:
    engine = get_engine()
    t = make_tenant("enterprise", monthly_token_budget=10_000_000,
                    key_options={"allowed_models": ["gpt-4o-mini"]})
    client = client_for(gateway, t.plaintext)
    # Refused before any reserve (a model the key may not call): every worker caches the key,
    # with the enterprise plan's calendar month, and nothing is counted.
    for _ in range(12):
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(model="gpt-4o", max_tokens=2, messages=HI)

    def change() -> Tenant:
        tenant = Tenant.objects.select_related("plan").get(pk=t.tenant_id)
        done = change_cycle(tenant, cycle="monthly", anchor=date(2026, 1, 15),
                            time_zone="Europe/Paris", actor="test")
        assert done.at_once  # nothing counted in its current window
        return Tenant.objects.select_related("plan").get(pk=t.tenant_id)

    tenant = committed(django_db_blocker, change)
    schedule = schedule_for(tenant)
    switch = schedule.switch_ms
    assert switch is not None
    while redis_ms() <= switch:
        time.sleep(0.02)
    window = calendar_for(tenant).window(WindowKind.MONTH, redis_ms())
    assert window.id.startswith("c") and window.id.endswith(f"@{switch // 1000}")

    answers = [client.chat.completions.create(model="gpt-4o-mini", max_tokens=5, messages=HI)
               for _ in range(12)]
    used = sum(a.usage.total_tokens for a in answers)
    # Every worker heard of the change: every call counted in the new cycle window, none in the
    # calendar month the cached contexts had.
    cycle = engine.counter(t.tag, "tenant", WindowKind.MONTH, schedule=schedule)
    assert cycle.key.endswith(window.id) and (cycle.used, cycle.pending) == (used, 0)
    assert cycle.limit == 10_000_000
    assert engine.counter(t.tag, "tenant", WindowKind.MONTH).limit is None
    day = engine.counter(t.tag, "tenant", WindowKind.DAY, schedule=schedule)
    assert day.used == used and day.key.endswith(f"@{switch // 1000}")  # the Paris day, cut

    assert committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id)) == 12

    def report() -> tuple[Any, int, int]:
        span = report_span(tenant, window.id)
        rows = UsageRecord.objects.filter(tenant_id=t.tenant_id, ended_at__gte=span.start,
                                          ended_at__lt=span.end)
        tokens = sum(r.input_tokens + r.output_tokens for r in rows)
        return tenant_period(tenant, window.id), tokens, sum(r.cost_micros for r in rows)

    made, ledger_tokens, ledger_cost = committed(django_db_blocker, report)
    columns = list(made.columns)
    totals = dict(zip(columns, made.totals, strict=True))
    assert totals["input_tokens"] + totals["output_tokens"] == ledger_tokens == used
    assert made.cost_micros == ledger_cost and totals["requests"] == 12
    assert totals["time_zone"] == "Europe/Paris"
    assert totals["window_start"] == made.rows[0][columns.index("window_start")]
    rows = list(csv.reader(io.StringIO(to_csv(made).decode())))
    assert rows[0] == columns and rows[-1][columns.index("time_zone")] == "Europe/Paris"
    assert rows[-1][columns.index("window_start")].endswith("+01:00")  # Paris in winter
