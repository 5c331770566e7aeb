"""The allotment race through HTTP: a tenant with two projects, one given an allotment through
the service (create_project), hammered by 760 concurrent chat completions from 4 client processes
through the openai SDK (streamed and not) against 4 gateway workers and a quota of 100 calls.

While the calls race, the mock upstream is frozen (SIGSTOP, as in test_e2e_race_apis): no admitted
call can end and free part of its hold before every call is admitted or refused, so the counts
are exact whatever the machine's load.

Asserted: the protected project gets at least its allotment (it asked for four times as much),
the noisy one never more than the pool, the tenant exactly its quota; every refusal is a 429
insufficient_quota; then nothing is pending, the allotment tier and the pool hold exactly what
the two projects' calls used (the pool: the protected project's excess over its allotment and
everything the noisy one used), one usage event and one ledger row per admitted call, each equal
to the usage its client received, and the ledger equals the mock's bill token for token."""
from __future__ import annotations

import multiprocessing
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.mock_upstream import MockUpstream
from quotas import keys
from quotas.engine import QuotaEngine
from tests.gateway import allotment_race_client as race_client
from tests.gateway.conftest import GatewayServer, committed, start_gateway, wait_until
from tests.gateway.test_e2e_race_apis import frozen, hold_of
from tests.support.gateway_calls import SHARED_PROVIDER_SECRET, billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.slow, pytest.mark.e2e]

CLIENTS = 4
GUARDED_PER_CLIENT = 40  # 160 calls: four times its allotment
NOISY_PER_CLIENT = 150  # 600 calls: ten times the pool
ADMITS = 100  # the tenant's quota, in holds
GUARANTEED = 40  # the protected project's allotment, in holds


@dataclass(frozen=True)
class TwoProjects:
    tenant_id: int
    guarded_id: int
    noisy_id: int
    keys: dict[str, str]  # "guarded" / "noisy" -> plaintext API key

    @property
    def tag(self) -> str:
        return keys.tenant_tag(self.tenant_id)


def two_projects(django_db_blocker: Any, limit: int, allotment: int) -> TwoProjects:
    """A free-plan tenant with a daily quota of `limit`: project "guarded" allotted `allotment`
    a day through the service, project "noisy" without one; a key each."""
    from tenants.services import create_project, create_tenant, issue_key

    def create() -> TwoProjects:
        tenant = create_tenant(f"t-{uuid.uuid4().hex[:10]}", plan_name="free", actor="test",
                               tokens_per_day=limit, requests_per_second=-1)
        guarded = create_project(tenant, "guarded", actor="test",
                                 allotment_tokens_per_day=allotment)
        noisy = create_project(tenant, "noisy", actor="test")
        return TwoProjects(tenant.pk, guarded.pk, noisy.pk, {
            "guarded": issue_key(guarded, actor="test").plaintext,
            "noisy": issue_key(noisy, actor="test").plaintext})

    return committed(django_db_blocker, create)


@pytest.fixture(scope="module")
def race_gateway(provider_key: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """Four workers, with test_e2e_race_apis's longer wait for a Redis connection (a burst of
    calls on a loaded machine can starve a worker's loop beyond the default 2 s: a 503 that is
    a load limit, not what this test is about)."""
    server = start_gateway(tmp_path_factory.mktemp("allotment-gateway"), workers=4,
                           REDIS_SOCKET_TIMEOUT="10")
    yield server
    server.stop()


def test_a_noisy_project_never_takes_the_protected_allotment_through_the_gateway(
    race_gateway: GatewayServer, engine: QuotaEngine, mock_upstream: MockUpstream,
    django_db_blocker: Any,
) -> None:
    base = unique_model("race-allot")
    model = f"{base}@cached_tokens=1"
    [hold] = {hold_of(("chat", model, stream)) for stream in (False, True)}
    limit = ADMITS * hold.amount
    allotment = GUARANTEED * hold.amount
    t = two_projects(django_db_blocker, limit, allotment)

    rng = random.Random(t.tenant_id)
    per_client = []
    for _ in range(CLIENTS):
        calls = [("guarded", t.keys["guarded"], i % 2 == 0) for i in range(GUARDED_PER_CLIENT)]
        calls += [("noisy", t.keys["noisy"], i % 2 == 1) for i in range(NOISY_PER_CLIENT)]
        rng.shuffle(calls)
        per_client.append(calls)
    total = sum(len(c) for c in per_client)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(CLIENTS)
        answered = manager.list([0] * CLIENTS)
        with ProcessPoolExecutor(CLIENTS, mp_context=ctx) as pool, frozen(mock_upstream):
            futures = [pool.submit(race_client.run, race_gateway.base_url, model, calls,
                                   barrier, answered, slot)
                       for slot, calls in enumerate(per_client)]

            def decided() -> bool:
                return sum(answered) + len(engine.open_hold_ids(t.tag)) >= total

            assert wait_until(decided, timeout=240), (list(answered), engine.open_hold_ids(t.tag))
            pending_at_freeze = engine.counter(t.tag, "tenant").pending
            open_at_freeze = len(engine.open_hold_ids(t.tag))
        outcomes = [o for f in futures for o in f.result(timeout=240)]  # resumed: answered

    assert len(outcomes) == total
    admitted = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] != 200]
    by_who = Counter(o[4] for o in admitted)
    # The quota is full, exactly; the protected project got at least its allotment, the noisy
    # one never more than the pool.
    assert open_at_freeze == len(admitted) == ADMITS
    assert pending_at_freeze == limit
    assert by_who["guarded"] * hold.amount >= allotment
    assert by_who["noisy"] * hold.amount <= limit - allotment
    assert Counter((o[4], o[0], o[3]) for o in refused).keys() <= {
        ("guarded", 429, "insufficient_quota"), ("noisy", 429, "insufficient_quota")}
    assert by_who["noisy"] > 0 and {o[5] for o in admitted} == {False, True}
    assert all(o[3] is None and o[1] > 0 and o[2] > 0 for o in admitted), admitted[:3]

    # Every hold ended by its settle; the counters, the tier and the pool hold what was used.
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=60)
    used = {who: sum(o[1] + o[2] for o in admitted if o[4] == who) for who in by_who}
    counter = engine.counter(t.tag, "tenant")
    assert (counter.pending, counter.used) == (0, sum(used.values()))
    assert counter.used <= limit
    [pool_key] = engine.client.keys(keys.pool_key(t.tag, "*"))
    window_id = pool_key.rsplit(":", 1)[1]
    tier = engine.client.hgetall(keys.allotment_key(t.tag, keys.project_scope(t.guarded_id),
                                                    window_id))
    pool = engine.client.hgetall(pool_key)
    assert (int(tier["taken"]), int(tier["allot"])) == (used["guarded"], allotment)
    assert int(pool["taken"]) == max(0, used["guarded"] - allotment) + used["noisy"]
    assert int(pool["limit"]) == limit - allotment
    for who, project_id in (("guarded", t.guarded_id), ("noisy", t.noisy_id)):
        project = engine.counter(t.tag, keys.project_scope(project_id))
        assert (project.pending, project.used) == (0, used[who])

    # One usage event and one ledger row per admitted call, each the client's own usage; the
    # ledger equals the mock's bill.
    events = {e["request_id"]: e for e in usage_events(engine, t.tag)}
    assert set(events) == {o[6] for o in admitted}
    assert all(e["outcome"] == "settled" for e in events.values())
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    rows = committed(django_db_blocker, lambda: {
        r.request_id: r for r in UsageRecord.objects.filter(tenant_id=t.tenant_id)})
    assert set(rows) == set(events) and len(rows) == len(admitted)
    project_of = {"guarded": t.guarded_id, "noisy": t.noisy_id}
    for outcome in admitted:
        row = rows[outcome[6]]
        assert (row.input_tokens, row.output_tokens) == (outcome[1], outcome[2])
        assert row.project_id == project_of[outcome[4]]
        assert row.streamed is outcome[5]
        assert row.held_tokens == hold.amount
    bill = billed(mock_upstream, base, SHARED_PROVIDER_SECRET)
    assert bill["requests"] == len(rows)
    assert sum(r.input_tokens for r in rows.values()) == bill["prompt_tokens"]
    assert sum(r.output_tokens for r in rows.values()) == bill["completion_tokens"]
    assert sum(r.cached_input_tokens for r in rows.values()) == bill["input_cached_tokens"] > 0
    print(f"\nadmitted {dict(by_who)} of {total} (hold {hold.amount}, allotment "
          f"{GUARANTEED} holds, pool {ADMITS - GUARANTEED}); used {used}; pool {pool}")
