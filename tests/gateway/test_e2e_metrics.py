"""Request metrics end to end: calls of every outcome through a gateway of TWO uvicorn workers
sharing a prometheus_client multiprocess directory, then /metrics scraped until the last calls'
figures are in, and that scrape's every request counter and histogram count checked exactly; tokens and cost against the ledger rows
the same calls leave (drained here), which price each call independently of the gateway."""
from __future__ import annotations

import uuid
from collections import Counter as Tally
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway import metrics
from gateway.catalog import load_catalog
from gateway.usage import Usage
from quotas import keys
from quotas.engine import QuotaEngine
from tests.gateway.conftest import GatewayServer, MakeTenant, TenantKey, start_gateway, wait_until
from tests.support.prometheus import Samples, samples

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

TOKEN = "metrics-e2e-token"
CHAT = "chat/completions"
MESSAGES = [{"role": "user", "content": "count the words of this prompt please"}]
PLAIN_CALLS = 6  # concurrent, so both workers serve some


@pytest.fixture
def tenants(make_tenant: MakeTenant) -> tuple[TenantKey, TenantKey]:
    """The tenant the calls are made for (opted in to the tenant label), and one whose daily
    quota (10 tokens) refuses any call at the reserve."""
    return make_tenant(requests_per_second=1000), make_tenant(tokens_per_day=10)


@pytest.fixture
def two_workers(tenants: tuple[TenantKey, TenantKey], tmp_path: Path) -> Iterator[GatewayServer]:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    server = start_gateway(tmp_path, workers=2, PROMETHEUS_MULTIPROC_DIR=str(shared),
                           TOLLGATE_METRICS_TOKEN=TOKEN, TOLLGATE_METRICS_FLUSH_SECONDS="0.2",
                           TOLLGATE_METRICS_TENANTS=tenants[0].slug)
    yield server
    server.stop()


def _post(server: GatewayServer, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def _leave_mid_stream(server: GatewayServer, key: str, model: str) -> None:
    """A streamed call whose client reads its first event and hangs up."""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{server.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": MESSAGES, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # closing the client drops the connection mid-stream


def _scrape(server: GatewayServer) -> dict[str, float]:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert response.status_code == 200
    return samples(response.text)


def _open_holds(engine: QuotaEngine, tenant: TenantKey) -> int:
    return int(engine.client.zcard(keys.hold_index_key(tenant.tag)))


def test_every_outcome_is_counted_once_across_two_workers(
        two_workers: GatewayServer, tenants: tuple[TenantKey, TenantKey],
        engine: QuotaEngine, tmp_path: Path) -> None:
    server, (tenant, refused) = two_workers, tenants
    uid = uuid.uuid4().hex[:8]
    classes_model = f"mc{uid}@cached_tokens=3@reasoning_tokens=4"
    failing_model = f"mf{uid}@status=500"
    left_model = f"ml{uid}@chunk_ms=40@output_tokens=30"

    # 200, non-streamed, concurrently (spread over the two workers), of a catalog model.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(PLAIN_CALLS) as pool:
        answers = list(pool.map(lambda _: _post(server, tenant.plaintext, {
            "model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 8}),
            range(PLAIN_CALLS)))
    assert [a.status_code for a in answers] == [200] * PLAIN_CALLS
    # 200 with cached and reasoning tokens, of a model the catalog does not know ("other").
    assert _post(server, tenant.plaintext, {"model": classes_model, "messages": MESSAGES,
                                            "max_tokens": 12}).status_code == 200
    # 200, streamed.
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {tenant.plaintext}"},
                      json={"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True,
                            "max_tokens": 8}) as stream:
        assert stream.status_code == 200
        assert "[DONE]" in stream.read().decode()
    # 429: the other tenant's quota refuses it at the reserve.
    quota = _post(server, refused.plaintext, {"model": "gpt-4o-mini", "messages": MESSAGES})
    assert quota.status_code == 429 and quota.json()["error"]["code"] == "insufficient_quota"
    # 401: no such key.
    assert _post(server, "tgk_not-a-key", {"model": "gpt-4o-mini",
                                            "messages": MESSAGES}).status_code == 401
    # 5xx upstream: the gateway answers 502 and releases the hold.
    assert _post(server, tenant.plaintext, {"model": failing_model,
                                            "messages": MESSAGES}).status_code == 502
    # The client leaves mid-stream: the gateway drains the upstream and settles in the
    # background.
    _leave_mid_stream(server, tenant.plaintext, left_model)

    assert wait_until(lambda: _open_holds(engine, tenant) == 0, timeout=20)
    # Every worker's tally is written every TOLLGATE_METRICS_FLUSH_SECONDS (0.2 s), and a
    # hold's end is tallied after its script answers: scrape until the last calls' figures are
    # in (a fixed pause was not always enough on a loaded machine), then check them all.
    scraped: list[dict[str, float]] = []

    def complete() -> bool:
        scraped.append(_scrape(server))
        last = scraped[-1]
        return (sum(v for k, v in last.items() if k.startswith("tollgate_requests_total{"))
                >= PLAIN_CALLS + 6
                and last.get('tollgate_holds_total{event="settled"}', 0) >= PLAIN_CALLS + 3
                and last.get('tollgate_holds_total{event="released"}', 0) >= 1)

    assert wait_until(complete, timeout=20), scraped[-1]
    got = scraped[-1]

    # Both workers wrote figures (each has its own files in the shared directory).
    pids = {p.stem.rsplit("_", 1)[-1] for p in (tmp_path / "prometheus").glob("counter_*.db")}
    assert len(pids) >= 2, pids

    # -- requests by endpoint, status, refusal and model --------------------------------------
    def requests(status: int, refusal: str, model: str) -> float:
        return got.get(f'tollgate_requests_total{{endpoint="{CHAT}",status="{status}",'
                       f'refusal="{refusal}",model="{model}"}}', 0)

    assert requests(200, "", "gpt-4o-mini") == PLAIN_CALLS + 1  # the plain ones and the stream
    assert requests(200, "", "other") == 1
    assert requests(429, "quota_tenant", "gpt-4o-mini") == 1
    assert requests(401, "", "") == 1
    assert requests(502, "", "other") == 1
    assert requests(499, "", "other") == 1
    total = sum(v for k, v in got.items() if k.startswith("tollgate_requests_total{"))
    assert total == PLAIN_CALLS + 6

    # -- histogram counts -------------------------------------------------------------------
    def count(family: str, **labels: str) -> float:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return got.get(f"{family}_count{{{inner}}}", 0)

    assert count("tollgate_request_duration_seconds", endpoint=CHAT, stream="false") \
        == PLAIN_CALLS + 4  # the plain ones, classes, 429, 401, 502
    assert count("tollgate_request_duration_seconds", endpoint=CHAT, stream="true") == 2
    assert count("tollgate_gateway_overhead_seconds", endpoint=CHAT) == PLAIN_CALLS + 6
    # Every call handed to the upstream got its headers: the plain ones, classes, the stream,
    # the 500 and the one left.
    assert count("tollgate_upstream_ttfb_seconds", endpoint=CHAT) == PLAIN_CALLS + 4
    assert count("tollgate_redis_duration_seconds", operation="reserve") == PLAIN_CALLS + 5
    assert count("tollgate_redis_duration_seconds", operation="settle") == PLAIN_CALLS + 3
    assert count("tollgate_redis_duration_seconds", operation="release") == 1
    # The gateway's overhead is within the whole call.
    assert got[f'tollgate_gateway_overhead_seconds_sum{{endpoint="{CHAT}"}}'] <= (
        got[f'tollgate_request_duration_seconds_sum{{endpoint="{CHAT}",stream="false"}}']
        + got[f'tollgate_request_duration_seconds_sum{{endpoint="{CHAT}",stream="true"}}'])

    # -- holds, upstream errors ----------------------------------------------------------------
    assert got['tollgate_holds_total{event="opened"}'] == PLAIN_CALLS + 4
    assert got['tollgate_holds_total{event="settled"}'] == PLAIN_CALLS + 3
    assert got['tollgate_holds_total{event="released"}'] == 1
    assert got['tollgate_holds_total{event="swept"}'] == 0
    assert got['tollgate_holds_total{event="late_end"}'] == 0
    assert got["tollgate_gateway_over_hold_calls_total"] == 0
    errors = {k: v for k, v in got.items() if k.startswith("tollgate_upstream_errors_total{")}
    assert list(errors.values()) == [1] and 'kind="5xx"' in next(iter(errors))

    # -- tokens and cost, against the ledger's rows of the same calls --------------------------
    while drain_tenant(engine.client, tenant.tenant_id):
        pass
    rows = list(UsageRecord.objects.filter(tenant_id=tenant.tenant_id))
    # (the ledger calls the stream its client left "partial": the gateway settled it)
    assert Tally(r.status for r in rows) == {"settled": PLAIN_CALLS + 2, "partial": 1,
                                              "released": 1}
    catalog = load_catalog()
    tokens: Tally[tuple[str, str]] = Tally()
    cost: Tally[str] = Tally()
    for row in rows:
        label = metrics.model_label(catalog, row.served_model)
        usage = Usage(row.input_tokens, row.output_tokens, row.cached_input_tokens,
                      row.cache_write_tokens, row.reasoning_tokens)
        for name, n in zip(metrics.TOKEN_CLASSES, metrics.token_classes(usage), strict=True):
            tokens[label, name] += n
        cost[label] += row.cost_micros
    assert tokens["other", "cached_input"] == 3 and tokens["other", "reasoning"] == 4
    for (label, name), n in tokens.items():
        assert got.get(f'tollgate_tokens_total{{model="{label}",class="{name}"}}', 0) == n
    for label, micros in cost.items():
        assert micros > 0
        assert got[f'tollgate_cost_microdollars_total{{model="{label}"}}'] == micros
    # The opted-in tenant's own families; the refused tenant has none.
    assert got[f'tollgate_tenant_requests_total{{tenant="{tenant.slug}",endpoint="{CHAT}",'
               'status="200"}'] == PLAIN_CALLS + 2
    assert got[f'tollgate_tenant_requests_total{{tenant="{tenant.slug}",endpoint="{CHAT}",'
               'status="502"}'] == 1
    assert sum(v for k, v in got.items() if k.startswith("tollgate_tenant_requests_total{")) \
        == PLAIN_CALLS + 4
    assert got[f'tollgate_tenant_tokens_total{{tenant="{tenant.slug}",class="output"}}'] \
        == sum(n for (_, name), n in tokens.items() if name == "output")
    assert not any(refused.slug in k for k in got if k.startswith("tollgate_tenant_"))
    # The ledger's own families are on the same page.
    assert "tollgate_usage_backlog_events" in got


def _requests_in(directory: Path) -> float:
    """tollgate_requests_total summed over what the processes wrote to `directory`."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(directory))
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == "tollgate_requests_total")


@pytest.mark.parametrize("how", ["restarted", "stopped"])
def test_a_workers_last_figures_are_written_when_it_is_told_to_stop(
        make_tenant: MakeTenant, tmp_path: Path, how: str) -> None:
    """A uvicorn worker told to stop (SIGHUP to the supervisor restarts its workers, SIGINT
    stops them: SIGTERM to each) dies of the signal it re-raises, so exit hooks never run: its
    tally (written every TOLLGATE_METRICS_FLUSH_SECONDS, a minute here) is written at the
    lifespan's shutdown. SIGKILL still loses up to one interval."""
    import os
    import signal

    t = make_tenant(requests_per_second=1000)
    shared = tmp_path / "prometheus"
    shared.mkdir()
    server = start_gateway(tmp_path, workers=2, PROMETHEUS_MULTIPROC_DIR=str(shared),
                           TOLLGATE_METRICS_FLUSH_SECONDS="60")
    try:
        for _ in range(3):
            assert _post(server, t.plaintext, {"model": "gpt-4o-mini", "max_tokens": 4,
                                               "messages": MESSAGES}).status_code == 200
        assert _requests_in(shared) == 0  # tallied in the workers, not written yet
        if how == "restarted":
            old = set(server.worker_pids())
            os.kill(server.process.pid, signal.SIGHUP)
            assert wait_until(lambda: len(set(server.worker_pids()) - old) >= 2, timeout=30)
        else:
            server.stop()
        assert wait_until(lambda: _requests_in(shared) == 3, timeout=15), _requests_in(shared)
    finally:
        server.stop()


def test_the_unmetered_endpoints_are_counted_by_endpoint_status_and_refusal(
        two_workers: GatewayServer, tenants: tuple[TenantKey, TenantKey],
        make_tenant: MakeTenant) -> None:
    """/v1/models, a model by id, moderations, token counts and any other /v1 path are counted
    too (model "": nothing is metered), with their whole time; no hold, token or overhead
    figure moves."""
    server, (tenant, _) = two_workers, tenants
    limited = make_tenant(key_options={"allowed_models": ["gpt-4o-mini"]})
    bearer = {"Authorization": f"Bearer {tenant.plaintext}"}
    before = _scrape(server)
    calls: Tally[tuple[str, int, str]] = Tally()

    def call(endpoint: str, refusal: str, method: str, path: str, **options: Any) -> None:
        response = httpx.request(method, f"{server.url}{path}", timeout=30, **options)
        calls[endpoint, response.status_code, refusal] += 1

    call("models", "", "GET", "/v1/models", headers=bearer)
    call("models", "", "GET", "/v1/models", headers={"Authorization": "Bearer tgk_not-a-key"})
    call("models", "", "POST", "/v1/models", headers=bearer)  # 405
    call("models/{id}", "", "GET", "/v1/models/gpt-4o-mini", headers=bearer)
    call("models/{id}", "", "GET", "/v1/models/no-such-model", headers=bearer)
    call("moderations", "", "POST", "/v1/moderations", headers=bearer,
         json={"input": "a friendly sentence"})
    call("moderations", "model_not_allowed", "POST", "/v1/moderations",
         headers={"Authorization": f"Bearer {limited.plaintext}"},
         json={"model": "omni-moderation-latest", "input": "hello"})
    call("messages/count_tokens", "", "POST", "/v1/messages/count_tokens",
         headers={"x-api-key": tenant.plaintext, "anthropic-version": "2023-06-01"},
         json={"model": "claude-sonnet-4-5", "messages": MESSAGES})
    call("responses/{id}", "", "GET", "/v1/responses/resp_unknown", headers=bearer)
    call("other", "", "GET", "/v1/files", headers=bearer)  # not served (yet)
    call("other", "", "GET", "/v1/no-such-path")
    call("other", "", "POST", "/chat/completions", json={})  # a base URL without /v1
    statuses = {(e, s) for e, s, _ in calls}
    assert {("models", 200), ("models", 401), ("models", 405), ("models/{id}", 200),
            ("models/{id}", 404), ("moderations", 200), ("moderations", 403),
            ("messages/count_tokens", 200), ("responses/{id}", 404), ("other", 404)} == statuses
    n = sum(calls.values())

    def moved() -> dict[str, float]:
        after = _scrape(server)
        return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

    assert wait_until(lambda: sum(v for k, v in moved().items()
                                  if k.startswith("tollgate_requests_total{")) >= n, timeout=20)
    got = Samples(moved())
    counted = {k: v for k, v in got.items() if k.startswith("tollgate_requests_total{")}
    assert len(counted) == len(calls) and sum(counted.values()) == n, counted
    for (endpoint, status, refusal), c in calls.items():
        assert got[f'tollgate_requests_total{{endpoint="{endpoint}",status="{status}",'
                   f'refusal="{refusal}",model=""}}'] == c
    durations = Tally[str]()
    for (e, _, _), c in calls.items():
        durations[e] += c
    for endpoint, c in durations.items():
        assert got[f'tollgate_request_duration_seconds_count{{endpoint="{endpoint}",'
                   'stream="false"}'] == c
    assert not any(k.startswith(("tollgate_holds_total", "tollgate_tokens_total",
                                 "tollgate_gateway_overhead_seconds",
                                 "tollgate_upstream_ttfb_seconds")) for k in got), got
