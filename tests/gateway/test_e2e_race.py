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
from tests.gateway.conftest import GatewayServer, MakeTenant, wait_until
from tests.gateway.test_e2e_race_apis import frozen

pytestmark = [pytest.mark.django_db, pytest.mark.slow, pytest.mark.e2e]

CLIENTS = 4
PER_CLIENT = 250
ADMITS = 100
# Outside the catalog (the heuristic estimate below is the gateway's); the mock bills it as
# gpt-4o-mini.
MODEL = "gpt-4o-mini@first_byte_ms=0"


def test_thousand_concurrent_requests_admit_exactly_one_hundred(
    gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine, mock_upstream
) -> None:
    info = fallback_model_info(MODEL)  # not in the catalog: the heuristic estimate
    prompt = estimate_chat_prompt([{"role": "user", "content": race_client.PROMPT}], model=MODEL,
                                  tokenizer=info.tokenizer)
    hold, _ = reservation_tokens(prompt, race_client.MAX_OUTPUT, info, Decimal("1.25"))
    t = make_tenant(tokens_per_day=ADMITS * hold, requests_per_second=-1)
    billed_before = httpx.get(f"{mock_upstream.url}/mock/usage").json()

    spec = ("chat", MODEL, False)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(CLIENTS)
        answered = manager.list([0] * CLIENTS)
        # The upstream is frozen until every request is admitted (an open hold) or refused, so
        # no hold can settle and free its unused part before the last decision, however slow
        # the machine (a fixed upstream delay once did not suffice under load).
        with ProcessPoolExecutor(CLIENTS, mp_context=ctx) as pool, frozen(mock_upstream):
            futures = [pool.submit(race_client.run_specs, gateway.base_url, t.plaintext,
                                   [spec] * PER_CLIENT, barrier, answered, slot)
                       for slot in range(CLIENTS)]

            def decided() -> bool:
                return sum(answered) + len(engine.open_hold_ids(t.tag)) >= CLIENTS * PER_CLIENT

            assert wait_until(decided, timeout=180), (list(answered), engine.open_hold_ids(t.tag))
        results = [row for f in futures for row in f.result(timeout=180)]

    assert len(results) == CLIENTS * PER_CLIENT
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert len(ok) == ADMITS
    assert {(r[0], r[3]) for r in refused} == {(429, "insufficient_quota")}

    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=60)
    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0
    assert counter.used == sum(r[1] + r[2] for r in ok)
    billed_after = httpx.get(f"{mock_upstream.url}/mock/usage").json()
    assert _total(billed_after) - _total(billed_before) == counter.used


def _total(usage: dict) -> int:
    """Chat tokens the mock upstream billed for gpt-4o-mini, over every provider key."""
    return sum(e["prompt_tokens"] + e["completion_tokens"] for e in usage["completions"]
               if e["model"] == "gpt-4o-mini")
