"""make bench-background's setup (config/bench_background.py): the bulk-inserted tenants are real
idle tenants, and the active ones are what the gateway would leave: events waiting, one open hold,
marked in the index of active tenants. Timings are the bench's to print, not asserted here."""
from __future__ import annotations

import uuid

import pytest

from config.bench_background import bulk_tenants, make_active
from quotas import active, keys
from quotas.runtime import get_engine
from tenants.models import Tenant

pytestmark = pytest.mark.django_db


def test_the_bench_tenants_are_idle_and_its_active_ones_have_work() -> None:
    ids = bulk_tenants(30)
    made = Tenant.objects.filter(slug__startswith="bg-")
    assert made.count() == 30 and set(made.values_list("pk", flat=True)) <= set(ids)
    assert {t.plan.name for t in made.select_related("plan")} == {"free"}
    engine = get_engine()
    chosen = sorted(made.values_list("pk", flat=True))[:2]
    make_active(engine, chosen, 3, prefix=f"b{uuid.uuid4().hex[:8]}")
    work = active.probe(engine.client, chosen)
    assert all((w.holds, w.events) == (1, 3) for w in work.values()), work
    indexed, _walks, _now = active.read_index(engine.client, engine.settings.active_shards)
    assert {str(t) for t in chosen} <= {i.tenant for i in indexed}
    for tenant_id in chosen:
        engine.client.delete(keys.usage_stream_key(keys.tenant_tag(tenant_id)))
