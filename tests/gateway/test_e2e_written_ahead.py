"""The two script calls of a metered call are written to Redis before their waits
(docs/benchmarks.md, "Issue 16 item 3: the script calls written before their waits"): the view
writes the reserve before the call's own task starts (runtime.send_reserve), and the settle is
written before the answer is made (Call.begin_settle). Through the in-process gateway: the calls
take that path, and the money is right whatever happens in between: the hold ends once, charged
with what the upstream billed, when the client leaves at the very instant after the reserve's
write."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway import startup
from gateway.mock_upstream import MockUpstream
from quotas import keys
from quotas.engine import AsyncQuotaEngine, QuotaEngine
from tests.gateway.conftest import MakeTenant
from tests.gateway.test_e2e_observe_faults import HI, leave_after, post, run_app
from tests.gateway.test_e2e_spans import fresh_runtime, in_memory_tracing  # noqa: F401
from tests.support.gateway_calls import billed, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MODEL = "gpt-4o"


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """What AsyncQuotaEngine.send_reserve and send_settle returned, call by call."""
    reserves: list[Any] = []
    settles: list[Any] = []
    real_reserve, real_settle = AsyncQuotaEngine.send_reserve, AsyncQuotaEngine.send_settle

    def send_reserve(self: AsyncQuotaEngine, request: Any) -> Any:
        sent = real_reserve(self, request)
        reserves.append(sent)
        return sent

    def send_settle(self: AsyncQuotaEngine, *args: Any) -> Any:
        sent = real_settle(self, *args)
        settles.append(sent)
        return sent

    monkeypatch.setattr(AsyncQuotaEngine, "send_reserve", send_reserve)
    monkeypatch.setattr(AsyncQuotaEngine, "send_settle", send_settle)
    return reserves, settles


def _all_connections_back() -> None:
    """Every script connection the calls wrote on is back in the worker's pool: each command
    written ahead had its reply waited for."""
    scripts = startup._runtime.engine.client.scripts
    assert scripts is not None and scripts.opened >= 1
    assert scripts.in_use == 0 and len(scripts.free) == scripts.opened


def _charged(engine: QuotaEngine, tag: str) -> int:
    return sum(e["event"]["in"] + e["event"]["out"] for e in usage_events(engine, tag))


def test_a_call_writes_its_reserve_and_settle_before_their_waits(
        fresh_runtime: None, make_tenant: MakeTenant, engine: QuotaEngine,  # noqa: F811
        mock_upstream: MockUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's first call writes its activity mark first, so its reserve goes the usual way;
    the next ones write it ahead. Every settle is written ahead. Each call is charged once,
    with the upstream's usage."""
    t = make_tenant(requests_per_second=1000)
    reserves, settles = _record(monkeypatch)
    before = billed(mock_upstream, MODEL)

    async def work(client: httpx.AsyncClient) -> list[httpx.Response]:
        answers = [await post(client, t.plaintext, {"model": MODEL, "max_tokens": 4,
                                                    "messages": HI}) for _ in range(3)]
        _all_connections_back()
        return answers

    answers = run_app(work)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert reserves[0] is None and all(s is not None for s in reserves[1:])
    assert len(reserves) == 3 and len(settles) == 3 and all(s is not None for s in settles)
    after = billed(mock_upstream, MODEL)
    produced = sum(after[k] - before[k] for k in ("prompt_tokens", "completion_tokens"))
    answered = sum(a.json()["usage"]["total_tokens"] for a in answers)
    events = usage_events(engine, t.tag)
    assert [e["outcome"] for e in events] == ["settled"] * 3
    assert _charged(engine, t.tag) == produced == answered
    day = engine.counter(t.tag, "tenant")
    assert (day.used, day.pending) == (produced, 0)
    assert engine.client.zcard(keys.hold_index_key(t.tag)) == 0


def test_a_client_leaving_just_after_the_reserve_was_written_is_charged_once(
        fresh_runtime: None, make_tenant: MakeTenant, engine: QuotaEngine,  # noqa: F811
        mock_upstream: MockUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client hangs up right after the view wrote the reserve, before the call's task took
    its first step (the disconnect is delivered first): the view is cancelled, the task goes on
    with the reserve's reply as for any client leaving once admitted, and the hold ends once,
    charged with what the upstream billed."""
    t = make_tenant(requests_per_second=1000)
    gone: list[asyncio.Event] = []
    real = AsyncQuotaEngine.send_reserve

    def send_reserve(self: AsyncQuotaEngine, request: Any) -> Any:
        sent = real(self, request)
        if sent is not None and gone:
            gone.pop().set()  # injected: the client leaves at this instant
        return sent

    monkeypatch.setattr(AsyncQuotaEngine, "send_reserve", send_reserve)
    before = billed(mock_upstream, MODEL)

    async def work(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        # A first call writes the tenant's activity mark (its reserve is not written ahead).
        assert (await post(client, t.plaintext, {"model": MODEL, "max_tokens": 4,
                                                 "messages": HI})).status_code == 200
        left = asyncio.Event()
        gone.append(left)
        messages = await leave_after(t.plaintext, {"model": MODEL, "max_tokens": 4,
                                                   "messages": HI}, 30, left)
        for _ in range(200):  # the detached call ends its hold by itself
            if len(usage_events(engine, t.tag)) == 2 and not startup._runtime.detached:
                break
            await asyncio.sleep(0.05)
        _all_connections_back()
        return messages

    messages = run_app(work)
    assert not gone  # the client left at the reserve's write
    assert [m for m in messages if m["type"] == "http.response.start"] == []  # nothing sent
    events = usage_events(engine, t.tag)
    assert [e["outcome"] for e in events] == ["settled", "settled"]
    after = billed(mock_upstream, MODEL)
    produced = sum(after[k] - before[k] for k in ("prompt_tokens", "completion_tokens"))
    assert _charged(engine, t.tag) == produced > 0
    day = engine.counter(t.tag, "tenant")
    assert (day.used, day.pending) == (produced, 0)
    assert engine.client.zcard(keys.hold_index_key(t.tag)) == 0


def test_a_call_whose_upstream_request_cannot_be_made_still_reads_its_reserve(
        fresh_runtime: None, make_tenant: MakeTenant, engine: QuotaEngine,  # noqa: F811
        mock_upstream: MockUpstream) -> None:
    """The upstream request is prepared at the call's task's first step when its reserve was
    written ahead. A client's header the request cannot carry (a non-ASCII anthropic-version,
    passed through to the upstream) makes that fail: the failure is logged, the reserve's
    reply is still read, the call fails as it did (its request made again, failing in the
    forward: 500) and its hold is released; no script connection is left taken, call after
    call."""
    t = make_tenant(requests_per_second=1000)
    body = {"model": "claude-haiku-4-5", "max_tokens": 4, "messages": HI}

    async def work(client: httpx.AsyncClient) -> list[int]:
        statuses = []
        for version in [b"2023-06-01"] + [b"2023-06-01\xe9"] * 4:
            answer = await client.post("/v1/messages", json=body, headers={
                "x-api-key": t.plaintext, "anthropic-version": version})
            statuses.append(answer.status_code)
        _all_connections_back()
        return statuses

    assert run_app(work) == [200, 500, 500, 500, 500]
    events = usage_events(engine, t.tag)
    assert [e["outcome"] for e in events] == ["settled"] + ["released"] * 4
    assert engine.client.zcard(keys.hold_index_key(t.tag)) == 0
    day = engine.counter(t.tag, "tenant")
    assert day.pending == 0 and day.used == _charged(engine, t.tag) > 0


def test_a_traced_call_writes_its_script_calls_inside_their_spans(
        fresh_runtime: None, make_tenant: MakeTenant, engine: QuotaEngine,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With tracing on, neither script call is written ahead: the quota.reserve and
    quota.settle spans each hold their write and their reply."""
    t = make_tenant(requests_per_second=1000)

    async def work(client: httpx.AsyncClient) -> list[int]:
        return [(await post(client, t.plaintext, {"model": MODEL, "max_tokens": 4,
                                                  "messages": HI})).status_code
                for _ in range(2)]

    with in_memory_tracing() as exporter:
        reserves, settles = _record(monkeypatch)
        assert run_app(work) == [200, 200]
        names = [s.name for s in exporter.get_finished_spans()]
    assert reserves == [] and settles == []
    assert names.count("quota.reserve") == 2 and names.count("quota.settle") == 2
    assert [e["outcome"] for e in usage_events(engine, t.tag)] == ["settled", "settled"]
