"""The race through HTTP for the Responses and Messages APIs: 1,000 concurrent calls from 4 client
processes against a gateway's 4 workers and a small tenant quota, per API (streamed and not,
mixed) and for chat completions, responses and messages together against ONE quota.

While the calls race, the mock upstream is frozen (SIGSTOP): no admitted call can end, and so
free part of its hold, before every one of the 1,000 has been admitted or refused. That makes
the count exact whatever the machine's load (a fixed upstream delay is not: under load the
reservations can take longer than it). Then the upstream resumes and the admitted calls finish.

Asserted: the holds granted never exceed the limit and fill it as far as the smallest refused
call could not fit (exactly ADMITS for a quota of ADMITS holds); every refusal is a 429 in the
API's own shape; nothing is pending after; one usage event and one ledger row per admitted call,
each equal to the usage its client received; the ledger equals the mock's bill token for token,
token classes included, and each row's cost is its usage at the price."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.catalog import fallback_model_info, hold_for, reservation_tokens
from gateway.mock_upstream import MockUpstream
from gateway.prices import Price
from gateway.tokens import estimate_chat_prompt, estimate_messages_prompt, estimate_responses_input
from gateway.usage import Usage
from quotas.engine import QuotaEngine
from tests.gateway import race_client
from tests.gateway.conftest import (
    ANTHROPIC_MOCK_SECRET,
    MOCK_DEFAULT_INPUT_PRICE,
    MOCK_DEFAULT_OUTPUT_PRICE,
    GatewayServer,
    MakeTenant,
    TenantKey,
    committed,
    start_gateway,
    wait_until,
)
from tests.support.gateway_calls import SHARED_PROVIDER_SECRET, billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.slow, pytest.mark.e2e]

CLIENTS = 4
PER_CLIENT = 250
ADMITS = 100
# Every call of a free-plan tenant holds its estimate times the plan's safety factor.
SAFETY = Decimal("1.25")
# The price of the mock provider keys for models with no price of their own (these ones).
MOCK_PRICE = Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)
# Each shape's usage has token classes: the mock's faults make part of the input cached (and, for
# Anthropic, cache writes) and part of the output reasoning, so the ledger must keep them apart.
RESPONSES_FAULTS = "@cached_tokens=2@reasoning_tokens=3"
MESSAGES_FAULTS = "@cache_read_tokens=2@cache_write_tokens=1"
CHAT_FAULTS = "@cached_tokens=1"
# Which provider key's secret the mock bills each endpoint's calls under.
SECRETS = {"chat": SHARED_PROVIDER_SECRET, "responses": SHARED_PROVIDER_SECRET,
           "messages": ANTHROPIC_MOCK_SECRET}
# How each API refuses a call over the quota: OpenAI's code, Anthropic's error type.
REFUSALS = {"chat": (429, "insufficient_quota"), "responses": (429, "insufficient_quota"),
            "messages": (429, "rate_limit_error")}


# -- the race's gateway ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def race_gateway(provider_key: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """Four workers like the session's gateway, with a longer wait for a Redis connection: a
    burst of 1,000 calls on a loaded test machine can starve a worker's event loop for longer
    than the default 2 s, and a call that waited that long is answered 503 (529 for the
    Messages API) quota_store_unavailable. That is a load limit, not what these tests are
    about; the default's own behaviour under a burst is test_e2e_race's."""
    server = start_gateway(tmp_path_factory.mktemp("race-gateway"), workers=4,
                           REDIS_SOCKET_TIMEOUT="10")
    yield server
    server.stop()


# -- the frozen upstream ---------------------------------------------------------------------------


def mock_pid(mock: MockUpstream) -> int:
    """The process of this session's mock upstream (a child of this pytest process)."""
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)
    for pid in children.stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gateway.mock_upstream" in argv and str(mock.port).encode() in argv:
            return int(pid)
    raise AssertionError(f"no mock upstream process on port {mock.port} among this session's")


@contextmanager
def frozen(mock: MockUpstream) -> Iterator[None]:
    """The mock upstream stopped (SIGSTOP) for the block: connections to it are still accepted
    (by the kernel) and requests sent, but nothing is answered until it resumes."""
    pid = mock_pid(mock)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# -- the race ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    """What the gateway holds for one request shape: the full hold, and the smallest it may
    shrink it to when the tenant's headroom is less (the prompt and one output token)."""

    amount: int
    least: int


def hold_of(spec: race_client.Spec) -> Hold:
    endpoint, model, _ = spec
    info = fallback_model_info(model)  # not in the catalog: the heuristic estimate
    _, body, _ = race_client.request_for(spec, "key")
    if endpoint == "chat":
        prompt = estimate_chat_prompt(body["messages"], model=model, tokenizer=info.tokenizer)
    elif endpoint == "responses":
        prompt = estimate_responses_input(body, model=model, tokenizer=info.tokenizer)
    else:
        prompt = estimate_messages_prompt(body, model=model, tokenizer=info.tokenizer)
    amount, _ = reservation_tokens(prompt, race_client.MAX_OUTPUT, info, SAFETY)
    return Hold(amount, min(amount, hold_for(prompt, 1, SAFETY)))


@dataclass
class Race:
    outcomes: list[race_client.Outcome]
    pending_at_freeze: int  # the tenant's held tokens once every call was admitted or refused
    open_at_freeze: int  # holds open then

    @property
    def admitted(self) -> list[race_client.Outcome]:
        return [o for o in self.outcomes if o[0] == 200]

    @property
    def refused(self) -> list[race_client.Outcome]:
        return [o for o in self.outcomes if o[0] != 200]


def race(gateway: GatewayServer, mock: MockUpstream, engine: QuotaEngine, t: TenantKey,
         shapes: list[race_client.Spec]) -> Race:
    """CLIENTS processes fire PER_CLIENT requests each, cycling through `shapes`, while the
    upstream is frozen; it resumes once every request is admitted (an open hold) or answered
    (refused)."""
    per_client = [[shapes[(c + i) % len(shapes)] for i in range(PER_CLIENT)]
                  for c in range(CLIENTS)]
    total = CLIENTS * PER_CLIENT
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(CLIENTS)
        answered = manager.list([0] * CLIENTS)
        with ProcessPoolExecutor(CLIENTS, mp_context=ctx) as pool, frozen(mock):
            futures = [pool.submit(race_client.run_specs, gateway.base_url, t.plaintext, specs,
                                   barrier, answered, slot)
                       for slot, specs in enumerate(per_client)]

            def decided() -> bool:
                return sum(answered) + len(engine.open_hold_ids(t.tag)) >= total

            assert wait_until(decided, timeout=180), (list(answered), engine.open_hold_ids(t.tag))
            pending = engine.counter(t.tag, "tenant").pending
            held_open = engine.open_hold_ids(t.tag)
        # Resumed: the admitted calls get their answers.
        outcomes = [o for f in futures for o in f.result(timeout=180)]
    assert len(outcomes) == total
    return Race(outcomes, pending, len(held_open))


def ledger_rows(django_db_blocker: Any, engine: QuotaEngine, t: TenantKey) -> list[UsageRecord]:
    """The tenant's usage stream moved to the ledger (as the drain job does), then its rows."""
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    return committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=t.tenant_id)))


def assert_rows_equal_the_bill(rows: list[UsageRecord], bill: dict[str, int]) -> None:
    """The ledger rows of one model equal what the mock billed for it, class by class."""
    assert len(rows) == bill["requests"]
    assert sum(r.input_tokens for r in rows) == bill["prompt_tokens"]
    assert sum(r.output_tokens for r in rows) == bill["completion_tokens"]
    assert sum(r.cached_input_tokens for r in rows) == bill["input_cached_tokens"]
    assert sum(r.cache_write_tokens for r in rows) == bill["input_cache_write_tokens"]
    assert sum(r.reasoning_tokens for r in rows) == bill["output_reasoning_tokens"]


def row_usage(row: UsageRecord) -> Usage:
    return Usage(row.input_tokens, row.output_tokens, row.cached_input_tokens,
                 row.cache_write_tokens, row.reasoning_tokens)


def assert_settled_exactly(result: Race, shapes: list[race_client.Spec], limit: int,
                           engine: QuotaEngine, django_db_blocker: Any, mock: MockUpstream,
                           t: TenantKey) -> list[UsageRecord]:
    """Everything after the race: counters, usage events, ledger rows and the bill."""
    holds = {spec: hold_of(spec) for spec in shapes}
    admitted = result.admitted
    assert admitted
    refusals = Counter((o[4], o[0], o[3]) for o in result.refused)
    assert all((status, code) == REFUSALS[endpoint] for endpoint, status, code in refusals), \
        refusals
    assert all(o[3] is None and o[1] > 0 and o[2] > 0 for o in admitted), \
        [o for o in admitted if o[3] is not None][:5]

    # At the freeze, every admitted call held its hold and no more than the limit was granted;
    # a refused call could not have fitted even shrunk to its least.
    assert result.open_at_freeze == len(admitted)
    assert result.pending_at_freeze <= limit
    refused_shapes = {(o[4], o[5]) for o in result.refused}
    least_refused = min(h.least for spec, h in holds.items()
                        if (spec[0], spec[2]) in refused_shapes)
    assert limit - result.pending_at_freeze < least_refused

    # Every hold ended once, by a settle with the client's own usage.
    assert wait_until(lambda: engine.open_hold_ids(t.tag) == [], timeout=60)
    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0
    assert counter.used == sum(o[1] + o[2] for o in admitted) <= limit
    events = {e["request_id"]: e for e in usage_events(engine, t.tag)}
    assert set(events) == {o[6] for o in admitted}
    assert sum(int(e["held"]) for e in events.values()) == result.pending_at_freeze
    for outcome in admitted:
        event = events[outcome[6]]
        assert event["outcome"] == "settled"
        assert (event["event"]["outcome"], event["event"]["st"]) == ("complete", 200)
        assert (event["event"]["in"], event["event"]["out"]) == (outcome[1], outcome[2])
        assert event["event"]["stream"] is outcome[5]

    # The ledger: one row per admitted call, its usage the client's, equal to the bill.
    rows = ledger_rows(django_db_blocker, engine, t)
    by_id = {r.request_id: r for r in rows}
    assert set(by_id) == set(events) and len(rows) == len(admitted)
    for outcome in admitted:
        row = by_id[outcome[6]]
        assert (row.input_tokens, row.output_tokens) == (outcome[1], outcome[2])
        assert row.endpoint == {"chat": "chat/completions"}.get(outcome[4], outcome[4])
        assert row.streamed is outcome[5]
        assert row.held_tokens == int(events[outcome[6]]["held"])
        assert row.cost_micros == MOCK_PRICE.cost_of(row_usage(row))
    for model in {spec[1] for spec in shapes}:
        endpoint = next(spec[0] for spec in shapes if spec[1] == model)
        base = model.split("@", 1)[0]
        assert_rows_equal_the_bill([r for r in rows if r.model == model],
                                   billed(mock, base, SECRETS[endpoint]))
    return rows


def both(endpoint: str, model: str) -> list[race_client.Spec]:
    """The streamed and the plain shape of one endpoint's call."""
    return [(endpoint, model, False), (endpoint, model, True)]


# -- 1. per API ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "faults"), [("responses", RESPONSES_FAULTS),
                                                  ("messages", MESSAGES_FAULTS)])
def test_thousand_concurrent_calls_of_one_api_admit_exactly_one_hundred(
    race_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    mock_upstream: MockUpstream, django_db_blocker: Any, endpoint: str, faults: str,
) -> None:
    shapes = both(endpoint, f"{unique_model(f'race-{endpoint}')}{faults}")
    [hold] = {hold_of(spec) for spec in shapes}  # streamed or not, the same hold
    limit = ADMITS * hold.amount
    t = make_tenant(tokens_per_day=limit, requests_per_second=-1)

    result = race(race_gateway, mock_upstream, engine, t, shapes)

    assert len(result.admitted) == ADMITS
    assert result.pending_at_freeze == limit  # exactly full
    assert {o[5] for o in result.admitted} == {False, True}  # both shapes got through
    rows = assert_settled_exactly(result, shapes, limit, engine, django_db_blocker,
                                  mock_upstream, t)
    assert all(r.held_tokens == hold.amount for r in rows)  # none shrunk: each fitted whole
    assert sum(r.cached_input_tokens for r in rows) > 0
    if endpoint == "responses":
        assert sum(r.reasoning_tokens for r in rows) > 0
    else:
        assert sum(r.cache_write_tokens for r in rows) > 0


# -- 2. chat, responses and messages against one quota -------------------------------------------


def test_chat_responses_and_messages_share_one_quota_exactly(
    race_gateway: GatewayServer, make_tenant: MakeTenant, engine: QuotaEngine,
    mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    shapes = (both("chat", f"{unique_model('race-mix-chat')}{CHAT_FAULTS}")
              + both("responses", f"{unique_model('race-mix-resp')}{RESPONSES_FAULTS}")
              + both("messages", f"{unique_model('race-mix-msg')}{MESSAGES_FAULTS}"))
    holds = [hold_of(spec) for spec in shapes]
    # About ADMITS calls' worth, not a multiple of any one hold: the last call admitted may be
    # shrunk to the headroom left.
    limit = ADMITS * max(h.amount for h in holds) - 7
    t = make_tenant(tokens_per_day=limit, requests_per_second=-1)

    result = race(race_gateway, mock_upstream, engine, t, shapes)

    # Each API had calls admitted from the one quota.
    assert {o[4] for o in result.admitted} == {"chat", "responses", "messages"}
    rows = assert_settled_exactly(result, shapes, limit, engine, django_db_blocker,
                                  mock_upstream, t)
    amounts = {spec[1]: hold_of(spec).amount for spec in shapes}
    # A hold is shrunk only when the headroom left is less than it: once at most, at the end.
    assert sum(r.held_tokens < amounts[r.model] for r in rows) <= 1
