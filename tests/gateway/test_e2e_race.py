"""The race through HTTP: 1,000 concurrent chat completions from 4 client processes against 4
gateway worker processes, with a tenant quota that admits exactly 100 of them."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from decimal import Decimal

import httpx
import pytest

from gateway.catalog import fallback_model_info, reservation_tokens
from gateway.tokens import estimate_chat_prompt
from quotas.engine import QuotaEngine
from tests.gateway import race_client
from tests.gateway.conftest import GatewayServer, MakeTenant

pytestmark = [pytest.mark.django_db, pytest.mark.slow, pytest.mark.e2e]

CLIENTS = 4
PER_CLIENT = 250
ADMITS = 100
# Every answer waits 5 s upstream, so all 1,000 reservations are made before any hold settles.
MODEL = "gpt-4o-mini@first_byte_ms=5000"


def test_thousand_concurrent_requests_admit_exactly_one_hundred(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine, mock_upstream
) -> None:
    info = fallback_model_info(MODEL)  # not in the catalog: the heuristic estimate
    prompt = estimate_chat_prompt([{"role": "user", "content": "race"}], model=MODEL,
                                  tokenizer=info.tokenizer)
    hold, _ = reservation_tokens(prompt, 10, info, Decimal("1.25"))
    t = make_tenant(tokens_per_day=ADMITS * hold, requests_per_second=-1)
    billed_before = httpx.get(f"{mock_upstream.url}/mock/usage").json()

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(CLIENTS)
        with ProcessPoolExecutor(CLIENTS, mp_context=ctx) as pool:
            futures = [pool.submit(race_client.run, gateway.base_url, t.plaintext, MODEL,
                                   PER_CLIENT, barrier) for _ in range(CLIENTS)]
            results = [row for f in futures for row in f.result(timeout=180)]

    assert len(results) == CLIENTS * PER_CLIENT
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert len(ok) == ADMITS
    assert {(r[0], r[2]) for r in refused} == {(429, "insufficient_quota")}

    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0
    assert counter.used == sum(r[1] for r in ok)
    assert engine.open_hold_ids(t.tag) == []
    billed_after = httpx.get(f"{mock_upstream.url}/mock/usage").json()
    assert _total(billed_after) - _total(billed_before) == counter.used


def _total(usage: dict) -> int:
    """Chat tokens the mock upstream billed for gpt-4o-mini, over every provider key."""
    return sum(e["prompt_tokens"] + e["completion_tokens"] for e in usage["completions"]
               if e["model"] == "gpt-4o-mini")
