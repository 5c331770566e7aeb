"""The ends of a call that takes from an allotment chain, end to end: gateways under uvicorn, the
mock upstream, a tenant with a project allotted through the service ("guarded") and one without
("noisy"). After each fault the money must add up: the ledger holds what the upstream produced
(or, for a dead worker's streams, what the sweep's rule charges: the input plus what each
client received), and the allotment tier and the pool are what the ledger says each project
used, passed along the chain: the tier takes the guarded project's tokens, the pool the part
beyond its allotment and everything the noisy project used. So a hold that ends for less than
it held gives back to the pool first.

1. a worker SIGKILLed with streams of both projects in flight (the guarded ones borrowing from
   the pool): the sweep charges each its checkpoint;
2. a client that leaves mid-stream: the gateway drains the upstream and settles its usage;
3. an upstream that cuts the stream: the counted text is settled;
4. Redis losing the tenant's data (FLUSHALL): the rebuild puts the tier and the pool back from
   the ledger (billing/rebuild.py), and the allotment still protects the guarded project."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.catalog import fallback_model_info, reservation_tokens
from gateway.mock_upstream import MockUpstream
from gateway.tokens import count_stream_text, estimate_chat_prompt
from quotas import keys
from quotas.engine import QuotaEngine
from tests.gateway.conftest import (
    GatewayServer,
    client_for,
    committed,
    start_gateway,
    wait_until,
)
from tests.gateway.test_e2e_allotment_race import TwoProjects, two_projects
from tests.gateway.test_e2e_call_end import (  # noqa: F401 - own_mock_upstream is a fixture
    HEURISTIC,
    HI,
    ClientStream,
    eventually,
    own_mock_upstream,
)
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture
from tests.support.gateway_calls import billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

SAFETY = Decimal("1.25")  # the free plan's safety factor: a hold is its estimate times this


def stream_hold(model: str, max_tokens: int) -> int:
    """The hold of a ClientStream-shaped call (HI, `max_tokens`) of a model outside the catalog."""
    info = fallback_model_info(model)
    prompt = estimate_chat_prompt(HI, model=model, tokenizer=info.tokenizer)
    amount, _ = reservation_tokens(prompt, max_tokens, info, SAFETY)
    return amount


# -- reading the chain and the ledger -------------------------------------------------------------


def chain(client: Any, t: TwoProjects) -> tuple[dict[str, str], dict[str, str]]:
    """The guarded project's day tier and the tenant's day pool (the one window they exist in;
    both expire with it)."""
    [pool_key] = client.keys(keys.pool_key(t.tag, "*"))
    window_id = pool_key.rsplit(":", 1)[1]
    tier_key = keys.allotment_key(t.tag, keys.project_scope(t.guarded_id), window_id)
    assert client.ttl(tier_key) > 0 and client.ttl(pool_key) > 0
    return client.hgetall(tier_key), client.hgetall(pool_key)


def ledger(django_db_blocker: Any, client: Any, t: TwoProjects) -> list[UsageRecord]:
    """The tenant's usage stream moved to the ledger (as the drain job does), then its rows."""
    committed(django_db_blocker, lambda: drain_tenant(client, t.tenant_id))
    return committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id)))


def used_by_project(rows: list[UsageRecord], t: TwoProjects) -> tuple[int, int]:
    """(guarded, noisy) tokens in the ledger."""
    guarded = sum(r.input_tokens + r.output_tokens for r in rows if r.project_id == t.guarded_id)
    noisy = sum(r.input_tokens + r.output_tokens for r in rows if r.project_id == t.noisy_id)
    assert {r.project_id for r in rows} <= {t.guarded_id, t.noisy_id}
    return guarded, noisy


def assert_chain_is_the_ledger(engine: QuotaEngine, t: TwoProjects, rows: list[UsageRecord],
                               allotment: int) -> tuple[int, int]:
    """Nothing open or pending; the tenant's counter, the tier and the pool are the ledger's
    figures passed along the chain."""
    assert engine.open_hold_ids(t.tag) == []
    guarded, noisy = used_by_project(rows, t)
    counter = engine.counter(t.tag, "tenant")
    assert (counter.pending, counter.used) == (0, guarded + noisy)
    tier, pool = chain(engine.client, t)
    assert (int(tier["taken"]), int(tier["allot"])) == (guarded, allotment)
    assert int(pool["taken"]) == max(0, guarded - allotment) + noisy
    return guarded, noisy


# -- 1. a worker killed with streams of both projects in flight ---------------------------------


def test_a_killed_workers_guarded_streams_are_swept_and_give_back_to_the_pool_first(
    own_mock_upstream: tuple[MockUpstream, subprocess.Popen[bytes]],  # noqa: F811
    engine: QuotaEngine, django_db_blocker: Any, tmp_path: Path,
) -> None:
    """3 guarded and 2 noisy streams through one worker; the guarded holds exceed the
    allotment (half borrowed from the pool). Once each client has part of its answer, the
    upstream freezes and the checkpoints catch up; SIGKILL the worker and sweep: each stream is
    charged its input plus what its client received, and the tier and the pool hold exactly
    those charges: the guarded project's came back under its allotment, so the pool keeps
    only the noisy project's."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    mock, mock_process = own_mock_upstream
    model = f"{unique_model('allot-kill')}@chunk_ms=50@output_tokens=200"
    hold = stream_hold(model, 200)
    allotment = 3 * hold // 2
    t = two_projects(django_db_blocker, 40 * hold, allotment)
    committed(django_db_blocker, lambda: create_provider_key(
        f"allot-kill-{uuid.uuid4().hex[:8]}", base_url=mock.base_url,
        secret=f"sk-allot-kill-{uuid.uuid4().hex}", models=[model],
        tenant=Tenant.objects.get(pk=t.tenant_id), default_price=Price(1_000_000, 2_000_000)))
    server = start_gateway(tmp_path, workers=1)  # started after the key: its pool has it
    try:
        streams = {who: [ClientStream() for _ in range(n)]
                   for who, n in (("guarded", 3), ("noisy", 2))}
        every = [s for group in streams.values() for s in group]

        def hold_record(stream: ClientStream) -> dict[str, str]:
            return engine.client.hgetall(keys.hold_key(t.tag, stream.request_id))

        async def scenario() -> None:
            limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:
                tasks = [asyncio.create_task(s.run(http, f"{server.base_url}/chat/completions",
                                                   t.keys[who], model))
                         for who, group in streams.items() for s in group]
                assert await eventually(lambda: all(s.chunks >= 10 for s in every), 60), \
                    [s.chunks for s in every]
                os.kill(mock_process.pid, signal.SIGSTOP)  # nothing more comes from upstream

                def checkpoints_caught_up() -> bool:
                    return all((h := hold_record(s)).get("phase") == "streaming"
                               and int(h.get("progress", -1)) == s.tokens() for s in every)

                assert await eventually(checkpoints_caught_up, 30), [
                    (hold_record(s).get("progress"), s.tokens()) for s in every]
                # In flight: every hold in the chain, the guarded ones beyond the allotment.
                held = {who: sum(int(hold_record(s)["amount"]) for s in group)
                        for who, group in streams.items()}
                tier, pool = chain(engine.client, t)
                assert held["guarded"] > allotment
                assert int(tier["taken"]) == held["guarded"]
                assert int(pool["taken"]) == held["guarded"] - allotment + held["noisy"]
                os.kill(server.process.pid, signal.SIGKILL)  # one worker: uvicorn's own process
                await asyncio.gather(*tasks)
                os.kill(mock_process.pid, signal.SIGCONT)

        asyncio.run(scenario())
        assert all(s.error is not None for s in every)  # every stream died with its worker
        swept = engine.sweep(t.tag, stale_s=0).swept
        assert {s.request_id for s in swept} == {s.request_id for s in every}
        assert {s.basis for s in swept} == {"streaming"}

        events = {e["request_id"]: e for e in usage_events(engine, t.tag)}  # before the drain
        rows = {r.request_id: r for r in ledger(django_db_blocker, engine.client, t)}
        assert set(rows) == {s.request_id for s in every}
        for stream in every:
            row = rows[stream.request_id]
            # The sweep's rule: the input estimate plus what the client received, no more.
            assert (row.status, row.sweep_basis) == ("swept", "streaming")
            assert row.output_tokens == stream.tokens() >= stream.chunks >= 10
            assert row.input_tokens + row.output_tokens == int(events[stream.request_id]["actual"])
            assert row.input_tokens + row.output_tokens <= row.held_tokens
        guarded, noisy = assert_chain_is_the_ledger(engine, t, list(rows.values()), allotment)
        # The guarded streams came back under the allotment: the pool gave back all they had
        # borrowed and keeps the noisy project's charges alone.
        assert 0 < guarded < allotment and noisy > 0
    finally:
        server.stop()


# -- 2. the client leaves mid-stream ----------------------------------------------------------------


def test_a_guarded_client_leaving_mid_stream_settles_the_upstreams_usage_along_the_chain(
    gateway: GatewayServer, mock_upstream: MockUpstream, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    base = unique_model("allot-leave")
    model = f"{base}@chunk_ms=20@output_tokens=40"
    hold = stream_hold(model, 60)
    allotment = hold // 4  # the guarded call borrows the rest of its hold from the pool
    t = two_projects(django_db_blocker, 20 * hold, allotment)
    body = {"model": model, "stream": True, "max_tokens": 60, "messages": HI}
    with httpx.Client(timeout=30) as http, http.stream(
        "POST", f"{gateway.base_url}/chat/completions", json=body,
        headers={"Authorization": f"Bearer {t.keys['guarded']}"},
    ) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 3:
                    tier, pool = chain(engine.client, t)  # in flight: beyond the allotment
                    assert (int(tier["taken"]), int(pool["taken"])) == (hold, hold - allotment)
                    break
    # And a whole answer for the noisy project, from the pool.
    noisy = client_for(gateway, t.keys["noisy"], timeout=30).chat.completions.create(
        model=model, max_tokens=60, messages=HI)
    assert noisy.usage.completion_tokens == 40

    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=15)
    events = {e["event"]["outcome"]: e for e in usage_events(engine, t.tag)}
    assert set(events) == {"client_disconnected", "complete"}
    rows = ledger(django_db_blocker, engine.client, t)
    assert len(rows) == 2
    # The upstream produced (and billed) both answers whole: the ledger is its bill.
    bill = billed(mock_upstream, base)
    assert (bill["requests"], bill["completion_tokens"]) == (2, 80)
    assert sum(r.input_tokens for r in rows) == bill["prompt_tokens"]
    assert sum(r.output_tokens for r in rows) == bill["completion_tokens"]
    guarded, _ = assert_chain_is_the_ledger(engine, t, rows, allotment)
    assert guarded > allotment  # it used more than its allotment: the rest is borrowed


# -- 3. the upstream cuts the stream ------------------------------------------------------------------


def test_a_guarded_stream_the_upstream_cuts_is_settled_at_its_counted_text_along_the_chain(
    gateway: GatewayServer, mock_upstream: MockUpstream, engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    base = unique_model("allot-cut")
    hold = stream_hold(f"{base}@cut=3", 60)
    allotment = 3 * hold  # room to spare: the cut stream's charge stays within it
    t = two_projects(django_db_blocker, 20 * hold, allotment)
    text = []
    try:
        for chunk in client_for(gateway, t.keys["guarded"], timeout=30).chat.completions.create(
                model=f"{base}@cut=3", messages=HI, max_tokens=60, stream=True):
            text += [c.delta.content or "" for c in chunk.choices]
    except (openai.APIError, httpx.HTTPError):
        pass  # the client's stream may end with an error too
    assert "".join(text) == "mock reply the"

    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [])
    [event] = usage_events(engine, t.tag)
    assert (event["outcome"], event["event"]["outcome"]) == ("settled", "upstream_broken_counted")
    [row] = ledger(django_db_blocker, engine.client, t)
    bill = billed(mock_upstream, base)
    assert (bill["requests"], bill["completion_tokens"]) == (1, 3)
    # No usage came: the prompt estimate plus the text received, counted by the tokenizer; at
    # least what the upstream billed for its output.
    assert row.output_tokens == count_stream_text("".join(text), HEURISTIC) >= 3
    assert row.input_tokens + row.output_tokens == int(event["actual"]) <= int(event["held"])
    guarded, noisy = assert_chain_is_the_ledger(engine, t, [row], allotment)
    assert (noisy, int(chain(engine.client, t)[1]["taken"])) == (0, 0)  # nothing borrowed


# -- 4. Redis loses the tenant's data -----------------------------------------------------------------

CALL_MAX_TOKENS = 10


@pytest.fixture
def lonely_gateway(private_redis: PrivateRedis, provider_key: str,  # noqa: F811
                   tmp_path: Path) -> GatewayServer:
    server = start_gateway(tmp_path, workers=2, REDIS_URL=private_redis.url)
    yield server
    server.stop()


def test_after_redis_loses_the_tenant_the_rebuild_restores_the_chain_and_its_protection(
    lonely_gateway: GatewayServer, private_redis: PrivateRedis,  # noqa: F811
    mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    base = unique_model("allot-loss")
    hold = stream_hold(base, CALL_MAX_TOKENS)
    allotment = 12 * hold
    limit = 40 * hold
    t = two_projects(django_db_blocker, limit, allotment)
    client = private_redis.client()
    engine = QuotaEngine(client)
    # The SDK retries the 503 quota_store_rebuilding a call gets while another worker rebuilds.
    callers = {who: openai.OpenAI(base_url=lonely_gateway.base_url, api_key=key, timeout=30,
                                  max_retries=4)
               for who, key in t.keys.items()}

    def ask(who: str) -> bool:
        """One call; False when refused for quota."""
        try:
            callers[who].chat.completions.create(model=base, max_tokens=CALL_MAX_TOKENS,
                                                 messages=HI)
            return True
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            return False

    for _ in range(6):
        assert ask("guarded") and ask("noisy")
    rows = ledger(django_db_blocker, client, t)
    before = assert_chain_is_the_ledger(engine, t, rows, allotment)

    client.flushall()  # the tenant's counters, tiers, pool and epoch are gone
    assert ask("guarded")  # rebuilt from the ledger first, then admitted
    assert engine.has_epoch(t.tag)
    rows = ledger(django_db_blocker, client, t)
    after = assert_chain_is_the_ledger(engine, t, rows, allotment)
    assert after[1] == before[1] and after[0] > before[0]

    # The allotment still protects: the noisy project floods until refused, and never gets
    # more than the pool; the guarded project then still gets its allotment (up to less than
    # one call's hold: a call needs room for its whole hold).
    noisy_calls = 0
    while ask("noisy"):
        noisy_calls += 1
        assert noisy_calls < 200
    while ask("guarded"):
        pass
    rows = ledger(django_db_blocker, client, t)
    guarded, noisy = assert_chain_is_the_ledger(engine, t, rows, allotment)
    assert noisy <= limit - allotment
    assert guarded >= allotment - hold
    assert guarded + noisy <= limit
    bill = billed(mock_upstream, base)
    assert bill["requests"] == len(rows)
    assert bill["prompt_tokens"] + bill["completion_tokens"] == guarded + noisy
    client.close()
