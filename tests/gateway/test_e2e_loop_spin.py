"""The bounded spin in a running worker (quotas/loop_spin.py, GATEWAY_IDLE_SPIN_US): calls whose
upstream takes seconds, plain and streamed, cost the worker the spin's budget at each of its
waits and not the wait itself, and are charged exactly what the upstream produced. The spin is
at its largest setting (10 ms) so that a spin that outlived its budget would show: one spinning
through the calls would burn their whole 1.5 s of waiting."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from config.bench import cpu_seconds
from quotas.engine import QuotaEngine
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

HI = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def spinning_gateway(provider_key: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("spin-gateway"), workers=1,
                           GATEWAY_IDLE_SPIN_US="10000")
    yield server
    server.stop()


def test_slow_calls_cost_the_spin_s_budget_not_their_wait_and_are_charged_exactly(
    spinning_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    t = make_tenant(plan="enterprise")
    client = client_for(spinning_gateway, t.plaintext, timeout=30)
    client.chat.completions.create(model="gpt-4o-mini", messages=HI)  # the worker warmed up
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [])
    before = cpu_seconds(spinning_gateway.process.pid)
    plain = client.chat.completions.create(model="gpt-4o-mini@first_byte_ms=1500", messages=HI)
    # 15 chunks 100 ms apart: 1.5 s more, with a write to the client (and no kick) per chunk.
    chunks = list(client.chat.completions.create(
        model="gpt-4o-mini@chunk_ms=100@output_tokens=15", messages=HI, stream=True,
        stream_options={"include_usage": True}))
    cpu = cpu_seconds(spinning_gateway.process.pid) - before
    # Each call spins after three writes (the reserve, the upstream request, the settle): 10 ms
    # each at most, plus the calls' own work and the worker's background loops over 3 s. A spin through the waits would be over 3 s; the margin is for a loaded
    # machine.
    assert cpu < 0.6, f"the worker used {cpu:.2f} s of CPU over 3 s of slow calls"

    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [])
    events = usage_events(engine, t.tag)
    assert len(events) == 3 and {e["outcome"] for e in events} == {"settled"}
    streamed_usage = chunks[-1].usage
    assert plain.usage is not None and streamed_usage is not None
    assert engine.counter(t.tag, "tenant").pending == 0
    moved = committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    assert moved == 3
    rows = committed(django_db_blocker, lambda: {
        r.request_id: r for r in UsageRecord.objects.filter(tenant_id=t.tenant_id)})
    assert len(rows) == 3
    by_output = sorted((r.input_tokens, r.output_tokens) for r in rows.values())
    for usage in (plain.usage, streamed_usage):
        assert (usage.prompt_tokens, usage.completion_tokens) in by_output  # token for token


def test_a_worker_with_another_call_in_flight_does_not_spin(
    spinning_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
) -> None:
    # 40 quick calls 12 ms apart. Alone, each leaves the worker polling for the rest of the 10 ms
    # budget after its settle's write (the mock answers within it, so every wait spins); beside
    # a slow stream in flight, none does: the worker's CPU is then the calls' own work. Compared
    # in one process a few seconds apart, as a ratio, so a loaded machine moves both alike.
    t = make_tenant(plan="enterprise")
    client = client_for(spinning_gateway, t.plaintext, timeout=30)
    pid = spinning_gateway.process.pid

    def quick_calls() -> float:
        before = cpu_seconds(pid)
        for _ in range(40):
            client.chat.completions.create(model="gpt-4o-mini", messages=HI)
            time.sleep(0.012)
        return cpu_seconds(pid) - before

    quick_calls()  # warm: the sites' records hold hits, the client its connection
    alone = quick_calls()
    streamed: list[Any] = []
    first_chunk = threading.Event()

    def slow_stream() -> None:  # 60 chunks 100 ms apart: in flight through the quick calls
        for chunk in client_for(spinning_gateway, t.plaintext, timeout=30).chat.completions.create(
                model="gpt-4o-mini@chunk_ms=100@output_tokens=60", messages=HI, stream=True,
                stream_options={"include_usage": True}):
            streamed.append(chunk)
            first_chunk.set()

    streaming = threading.Thread(target=slow_stream)
    streaming.start()
    assert first_chunk.wait(10)
    beside = quick_calls()
    in_flight_to_the_end = streaming.is_alive()
    streaming.join(30)
    assert in_flight_to_the_end, "the stream ended before the quick calls: nothing was beside them"
    # Alone the spin polls about 40 x 10 ms; beside the stream only the calls' work remains (and
    # the stream's chunks).
    assert beside < alone / 2, f"beside a stream {beside:.3f} s of CPU, alone {alone:.3f} s"
    assert alone > 0.15, f"alone the calls should have spun: {alone:.3f} s of CPU"
    assert streamed[-1].usage is not None
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [])
    assert engine.counter(t.tag, "tenant").pending == 0
    assert len(usage_events(engine, t.tag)) == 121  # one per call: 3 x 40 quick, the stream
