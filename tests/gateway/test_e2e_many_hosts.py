"""Three gateway hosts (uvicorn, 1-2 workers each) over the 3-node Redis Cluster and the one test
PostgreSQL, as production runs several behind a load balancer: they share the quota counters
(the cluster), the invalidation and cooldown messages (the cluster's pub/sub) and the ledger, and
nothing else. The standalone embedded Redis is only their Django cache and Celery broker.

1. A 1,000-way race spread over the three hosts admits exactly what the quota allows.
2. A provider key's 429 cooldown and an API key's revocation reach every host within a second.
3. A host killed mid-stream (SIGKILL) leaves the other two serving; the sweep charges its holds
   what they knew (sweep_basis `streaming`).
4. A rolling restart under load (SIGTERM, a new host started) loses nothing: every call completes
   and is settled, or was refused before the upstream saw it; the ledger is exact.
5. A stream longer than a stopping host's drain is cut at the drain and charged what it
   produced, not left to the sweep.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import override_settings

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from gateway.catalog import fallback_model_info, reservation_tokens
from gateway.mock_upstream import MockUpstream, api_key_id
from gateway.tokens import estimate_chat_prompt
from quotas.client import make_redis
from quotas.engine import EngineSettings, QuotaEngine
from quotas.keys import hold_key
from tests.gateway import race_client
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    TenantKey,
    committed,
    start_gateway,
    wait_until,
)
from tests.gateway.test_e2e_call_end import own_mock_upstream  # noqa: F401 - a fixture
from tests.gateway.test_e2e_race_apis import frozen
from tests.support.gateway_calls import billed, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

HI = [{"role": "user", "content": "many hosts"}]
HEURISTIC = "heuristic"  # the tokenizer of models outside the catalog (as the gateway counts)
WORKERS = (2, 1, 2)  # per host
# How long a host told to stop (SIGTERM) lets its calls in flight finish: uvicorn's
# --timeout-graceful-shutdown, and the bound on the lifespan's wait for their ends.
DRAIN_SECONDS = 20


def _other_db(url: str, db: int) -> str:
    return url.replace("db=0", f"db={db}") if "db=0" in url else f"{url.rstrip('/0')}/{db}"


@pytest.fixture(scope="module")
def cluster_env(redis_cluster_url: str, redis_url: str) -> dict[str, str]:
    """What a host on the cluster is started with: the quota store on the cluster, the Django
    cache and Celery's broker on a standalone Redis (neither can use a cluster)."""
    return {"REDIS_URL": redis_cluster_url, "REDIS_CLUSTER": "true",
            "CACHE_REDIS_URL": _other_db(redis_url, 5),
            # kombu's name for a Unix socket (config/settings.py _celery_url)
            "CELERY_BROKER_URL": "redis+socket://" + redis_url.removeprefix("unix://").partition("?")[0],
            "GATEWAY_SHUTDOWN_DRAIN_SECONDS": str(DRAIN_SECONDS)}


@pytest.fixture(scope="module")
def cluster_engine(redis_cluster_url: str) -> Iterator[QuotaEngine]:
    """The test's own view of the counters, holds and usage streams on the cluster."""
    engine = QuotaEngine(make_redis(redis_cluster_url, cluster=True), EngineSettings.from_django())
    yield engine
    engine.client.close()


@contextmanager
def on_the_cluster(redis_cluster_url: str, **more: Any) -> Iterator[None]:
    """Settings of this process pointing at the cluster, for what it publishes (revocations,
    provider key changes: tenants/invalidation.py) and the sweep task (quotas.tasks)."""
    import quotas.runtime

    saved = quotas.runtime._engine
    quotas.runtime._engine = None  # built again from the settings below
    try:
        with override_settings(REDIS_URL=redis_cluster_url, REDIS_CLUSTER=True, **more):
            yield
    finally:
        if quotas.runtime._engine is not None:
            quotas.runtime._engine.client.close()
        quotas.runtime._engine = saved


class Hosts:
    """The three hosts, as the load balancer sees them: `servers[i]` is host i's current
    process (a replacement takes its place)."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.servers: list[GatewayServer] = []
        self.ordinary: list[bool] = []  # started with the fleet's settings alone

    def start(self, index: int, **env: str) -> GatewayServer:
        workers = WORKERS[index]
        server = start_gateway(self.tmp, workers=workers, **{**self.env, **env})
        if index < len(self.servers):
            self.servers[index], self.ordinary[index] = server, not env
        else:
            self.servers.append(server)
            self.ordinary.append(not env)
        return server

    def restore(self, index: int) -> None:
        """Host `index` as the fleet started it, whatever a test left there."""
        server = self.servers[index]
        if self.ordinary[index] and server.process.poll() is None:
            return
        if server.process.poll() is None:
            kill_host(server)
        self.start(index)

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def hosts(provider_key: str, cluster_env: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    fleet = Hosts(tmp_path_factory.mktemp("hosts"), cluster_env)
    try:
        for index in range(len(WORKERS)):
            fleet.start(index)
        yield fleet
    finally:
        fleet.stop_all()


def drain(engine: QuotaEngine, django_db_blocker: Any, tenant_id: int) -> list[UsageRecord]:
    """Drain the tenant's usage stream from the cluster into the ledger; its rows."""
    while committed(django_db_blocker, lambda: drain_tenant(engine.client, tenant_id)):
        pass
    return committed(django_db_blocker, lambda: list(
        UsageRecord.objects.filter(tenant_id=tenant_id)))


def dedicated_key(django_db_blocker: Any, redis_cluster_url: str, t: TenantKey, mock: MockUpstream,
                  name: str, models: list[str], priority: int = 0) -> str:
    """A provider key dedicated to the tenant (tried before the shared one), with a secret of its
    own so the mock counts its requests apart; published on the cluster, so every host's
    workers reload their pools. Returns the secret."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key
    from tenants.models import Tenant

    secret = f"sk-{name}-{uuid.uuid4().hex}"
    with on_the_cluster(redis_cluster_url):
        committed(django_db_blocker, lambda: create_provider_key(
            name, base_url=mock.base_url, secret=secret, models=models, priority=priority,
            tenant=Tenant.objects.get(pk=t.tenant_id), default_price=Price(1_000_000, 2_000_000)))
    return secret


def mock_requests(mock: MockUpstream, secret: str) -> int:
    """Inference requests the mock received with this provider key (counted on arrival)."""
    report = httpx.get(f"{mock.url}/mock/faults", timeout=5).json()
    return int(report["requests"].get(api_key_id(secret), 0))


def chat(url: str, key: str, model: str, **body: Any) -> httpx.Response:
    """One call on a connection of its own (so a host's workers share the calls)."""
    with httpx.Client(timeout=60) as http:
        return http.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": model, "messages": HI, "max_tokens": 3, **body})


# -- 1. the race over three hosts ----------------------------------------------------------------

CLIENTS = 4
PER_CLIENT = 250
ADMITS = 100
RACE_MODEL = "gpt-4o-mini@first_byte_ms=0"


def test_a_thousand_way_race_over_three_hosts_admits_exactly_the_quota(
    hosts: Hosts, make_tenant: MakeTenant, cluster_engine: QuotaEngine,
    mock_upstream: MockUpstream, django_db_blocker: Any,
) -> None:
    """1,000 calls from 4 client processes, each spreading its 250 over the three hosts; the
    tenant's daily quota holds exactly 100. The upstream is frozen until every call is admitted
    (an open hold on the cluster) or refused, so no settle frees room before the last decision."""
    engine = cluster_engine
    info = fallback_model_info(RACE_MODEL)
    prompt = estimate_chat_prompt([{"role": "user", "content": race_client.PROMPT}],
                                  model=RACE_MODEL, tokenizer=info.tokenizer)
    hold, _ = reservation_tokens(prompt, race_client.MAX_OUTPUT, info, Decimal("1.25"))
    t = make_tenant(tokens_per_day=ADMITS * hold, requests_per_second=-1)
    spec = ("chat", RACE_MODEL, False)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(CLIENTS)
        answered = manager.list([0] * CLIENTS)
        with ProcessPoolExecutor(CLIENTS, mp_context=ctx) as pool, frozen(mock_upstream):
            futures = [pool.submit(race_client.run_specs_spread, hosts.urls, t.plaintext,
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
    assert counter.used == sum(r[1] + r[2] for r in ok) <= counter.limit

    rows = drain(engine, django_db_blocker, t.tenant_id)
    assert sorted(r.request_id for r in rows) == sorted(r[6] for r in ok)
    assert {r.status for r in rows} == {"settled"}
    assert sum(r.input_tokens + r.output_tokens for r in rows) == counter.used


# -- 2. a cooldown and a revocation reach every host ---------------------------------------------


def test_a_cooldown_and_a_revocation_reach_every_host_within_a_second(
    hosts: Hosts, make_tenant: MakeTenant, mock_upstream: MockUpstream, cluster_engine: QuotaEngine,
    redis_cluster_url: str, django_db_blocker: Any,
) -> None:
    from tenants.models import ApiKey
    from tenants.services import revoke_key

    t = make_tenant(requests_per_second=-1)
    model = unique_model("fx-hosts-cool")
    first = dedicated_key(django_db_blocker, redis_cluster_url, t, mock_upstream, "first", [model],
                          priority=100)
    second = dedicated_key(django_db_blocker, redis_cluster_url, t, mock_upstream, "second",
                           [model])
    time.sleep(1.0)  # the pools' reload (the "providers" message) reached every worker

    # Every host's workers call the first key while it answers (and cache the API key).
    for url in hosts.urls:
        for _ in range(4):
            assert chat(url, t.plaintext, model).status_code == 200
    assert mock_requests(mock_upstream, first) == 12
    assert mock_requests(mock_upstream, second) == 0

    # The first key starts answering 429: host 0 learns it from the upstream, cools the key down
    # and fails over to the second; the others learn it from the cluster's pub/sub.
    httpx.post(f"{mock_upstream.url}/mock/faults", timeout=5, json={
        "key": first, "faults": {"status": 429, "retry_after": 60}}).raise_for_status()
    try:
        assert chat(hosts.urls[0], t.plaintext, model).status_code == 200
        assert mock_requests(mock_upstream, first) == 13
        time.sleep(1.0)
        for url in hosts.urls:
            for _ in range(4):
                assert chat(url, t.plaintext, model).status_code == 200
        assert mock_requests(mock_upstream, first) == 13  # no host tried the cooling key again
        assert mock_requests(mock_upstream, second) == 13
    finally:
        httpx.post(f"{mock_upstream.url}/mock/faults", timeout=5, json={
            "key": first, "faults": {}}).raise_for_status()
    assert billed(mock_upstream, model)["requests"] == 0  # the shared key never served it

    # The revocation, published on the cluster once its transaction commits.
    with on_the_cluster(redis_cluster_url):
        committed(django_db_blocker, lambda: revoke_key(
            ApiKey.objects.get(pk=t.api_key_id), actor="test"))
    time.sleep(1.0)
    answers = [chat(url, t.plaintext, model) for url in hosts.urls for _ in range(4)]
    assert [a.status_code for a in answers] == [401] * 12, [a.text for a in answers]
    assert mock_requests(mock_upstream, second) == 13
    assert cluster_engine.counter(t.tag, "tenant").pending == 0


# -- 3. a host killed mid-stream ------------------------------------------------------------------

# The killed host's own settings: a hold of its must end within half the stale threshold
# (config/settings.py): 6 s deadline + 1 s stream drain + 2 x 1 s socket timeout = 9 <= 18 / 2.
# The sweep below runs with the same threshold. The other two hosts' calls here end in far less.
VICTIM_STALE_SECONDS = 18
VICTIM_ENV = {"GATEWAY_CALL_DEADLINE_SECONDS": "6", "GATEWAY_STREAM_DRAIN_SECONDS": "1",
              "REDIS_SOCKET_TIMEOUT": "1", "QUOTA_STALE_HOLD_SECONDS": str(VICTIM_STALE_SECONDS),
              "GATEWAY_CHECKPOINT_SECONDS": "0.5"}


def kill_host(server: GatewayServer) -> None:
    """SIGKILL the host's processes at once: uvicorn's supervisor first (it would start new
    workers), then its workers (orphans would go on serving on the inherited socket)."""
    pids = [server.process.pid, *server.worker_pids()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    server.process.wait()
    for pid in pids[1:]:
        assert wait_until(lambda pid=pid: not _alive(pid), timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def host_2_restored(hosts: Hosts) -> Iterator[None]:
    yield
    hosts.restore(2)


def test_a_host_killed_mid_stream_leaves_two_serving_and_its_holds_swept(
    hosts: Hosts, host_2_restored: None, own_mock_upstream: tuple[MockUpstream, Any], make_tenant: MakeTenant,
    cluster_engine: QuotaEngine, redis_cluster_url: str, django_db_blocker: Any,
) -> None:
    """12 streams and 4 plain calls (whose upstream answers after 8 s) on host 2 (its own
    settings, above) from a mock upstream of the test's own. Once every stream's client has some
    of its answer, the upstream freezes (SIGSTOP) and the holds' checkpoints catch up: each
    stream's with what its client received, each plain call's `forwarded`; host 2 is SIGKILLed.
    Hosts 0 and 1 go on serving. The sweep task (quotas.tasks.sweep_stale_holds, on the
    cluster, with the killed host's stale threshold) ends the 16 holds as the integrity rules
    say: a stream the input estimate plus what its client received (sweep_basis `streaming`), a
    forwarded plain call its whole hold (`forwarded`: it may have produced up to its cap); the
    ledger's rows say so."""
    from quotas.tasks import sweep_stale_holds
    from tests.gateway.test_e2e_call_end import ClientStream, eventually

    engine = cluster_engine
    mock, mock_process = own_mock_upstream
    t = make_tenant(plan="enterprise", requests_per_second=-1)
    model = f"{unique_model('fx-hosts-kill')}@chunk_ms=50@output_tokens=200"
    slow = f"{unique_model('fx-hosts-kill')}@first_byte_ms=8000"
    dedicated_key(django_db_blocker, redis_cluster_url, t, mock, "kill", [model, slow])
    hosts.servers[2].stop()
    victim = hosts.start(2, **VICTIM_ENV)  # started after the key: its pool has it
    streams = [ClientStream() for _ in range(12)]
    plain_ids: list[str] = []
    survivors: list[httpx.Response] = []

    def hold(stream: ClientStream) -> dict[str, str]:
        return engine.client.hgetall(hold_key(t.tag, stream.request_id))

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(s.run(http, f"{victim.base_url}/chat/completions",
                                               t.plaintext, model)) for s in streams]

            async def plain() -> None:
                try:
                    await http.post(f"{victim.base_url}/chat/completions", json={
                        "model": slow, "messages": HI, "max_tokens": 20},
                        headers={"Authorization": f"Bearer {t.plaintext}"})
                except httpx.HTTPError:
                    pass  # dies with the host

            tasks += [asyncio.create_task(plain()) for _ in range(4)]
            assert await eventually(lambda: all(s.chunks >= 5 for s in streams), 60), \
                [s.chunks for s in streams]
            os.kill(mock_process.pid, signal.SIGSTOP)  # nothing more comes from upstream

            def checkpoints_caught_up() -> bool:
                open_ids = set(engine.open_hold_ids(t.tag))
                plain_ids[:] = sorted(open_ids - {s.request_id for s in streams})
                return all((h := hold(s)).get("phase") == "streaming"
                           and int(h.get("progress", -1)) == s.tokens() for s in streams) \
                    and len(plain_ids) == 4 and all(engine.client.hget(
                        hold_key(t.tag, i), "phase") == "forwarded" for i in plain_ids)

            assert await eventually(checkpoints_caught_up, 30), [
                (hold(s).get("progress"), s.tokens()) for s in streams]
            kill_host(victim)
            await asyncio.gather(*tasks)
            os.kill(mock_process.pid, signal.SIGCONT)

    asyncio.run(scenario())
    assert all(s.error is not None for s in streams)  # every stream died with its host
    ids = {s.request_id for s in streams}
    assert set(engine.open_hold_ids(t.tag)) == ids | set(plain_ids)

    # The other two hosts serve on (through the shared provider key and mock).
    for url in hosts.urls[:2]:
        for _ in range(4):
            survivors.append(chat(url, t.plaintext, "gpt-4o-mini"))
    assert [r.status_code for r in survivors] == [200] * 8

    # The sweep job, as Celery runs it, on the cluster with the killed host's threshold.
    swept: list[int] = []
    with on_the_cluster(redis_cluster_url, QUOTA_STALE_HOLD_SECONDS=VICTIM_STALE_SECONDS):
        def sweep() -> bool:
            swept.append(committed(django_db_blocker, sweep_stale_holds))
            return engine.open_hold_ids(t.tag) == []

        assert wait_until(sweep, timeout=VICTIM_STALE_SECONDS + 30)
    assert sum(swept) >= 16

    events = {e["request_id"]: e for e in usage_events(engine, t.tag)}
    assert {events[i]["outcome"] for i in ids} == {"swept"}
    for stream in streams:
        event = events[stream.request_id]
        assert int(event["out"]) == stream.tokens() >= stream.chunks >= 5
        assert int(event["in"]) > 0
        assert int(event["in"]) + int(event["out"]) == int(event["actual"]) <= int(event["held"])
    for request_id in plain_ids:
        assert events[request_id]["outcome"] == "swept"
        assert int(events[request_id]["actual"]) == int(events[request_id]["held"])
    served = {r.headers["x-request-id"] for r in survivors}
    assert {events[i]["outcome"] for i in served} == {"settled"}
    counter = engine.counter(t.tag, "tenant")
    assert counter.pending == 0
    assert counter.used == sum(int(e["actual"]) for e in events.values())

    rows = {r.request_id: r for r in drain(engine, django_db_blocker, t.tenant_id)}
    assert set(rows) == ids | set(plain_ids) | served
    for stream in streams:
        row = rows[stream.request_id]
        assert (row.status, row.sweep_basis) == ("swept", "streaming")
        assert row.output_tokens == stream.tokens()
        assert row.input_tokens + row.output_tokens <= row.held_tokens
    for request_id in plain_ids:
        row = rows[request_id]
        assert (row.status, row.sweep_basis) == ("swept", "forwarded")
        assert row.input_tokens + row.output_tokens == row.held_tokens
    assert {rows[i].status for i in served} == {"settled"}


# -- 4. a rolling restart under load -------------------------------------------------------------


@dataclass
class Outcome:
    """One call of the load, as its client saw it."""

    host: int
    url: str
    stream: bool
    started: float
    ended: float = 0.0
    status: int | None = None  # None: no answer at all (refused, reset before the headers)
    request_id: str = ""
    tokens: int = 0  # the usage the client was given (a stream's final usage chunk)
    complete: bool = False  # the whole answer: a body with its usage, a stream to [DONE]
    error: str = ""

    @property
    def refused(self) -> bool:
        """Refused before any answer began: no connection, or reset before the headers, or a
        503 (never forwarded: the upstream's request log says so too)."""
        return self.status is None or self.status == 503


async def one_call(http: httpx.AsyncClient, host: int, url: str, key: str, model: str,
                   stream: bool) -> Outcome:
    outcome = Outcome(host, url, stream, time.monotonic())
    body: dict[str, Any] = {"model": model, "messages": HI, "max_tokens": 50}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", f"{url}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as response:
            outcome.status = response.status_code
            outcome.request_id = response.headers.get("x-request-id", "")
            if response.status_code != 200:
                await response.aread()
            elif stream:
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            outcome.tokens = usage["total_tokens"]
                outcome.complete = done and outcome.tokens > 0
            else:
                outcome.tokens = json.loads(await response.aread())["usage"]["total_tokens"]
                outcome.complete = True
    except httpx.HTTPError as exc:
        outcome.error = repr(exc)
    outcome.ended = time.monotonic()
    return outcome


async def leave_a_stream(http: httpx.AsyncClient, url: str, key: str, model: str) -> str:
    """Start a stream, read a few of its chunks and leave (close the connection); its request
    id."""
    async with http.stream("POST", f"{url}/chat/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
            "model": model, "messages": HI, "stream": True, "max_tokens": 200}) as response:
        assert response.status_code == 200
        lines = 0
        async for line in response.aiter_lines():
            lines += line.startswith("data: {")
            if lines >= 3:
                break
        return response.headers["x-request-id"]


def test_a_rolling_restart_under_load_loses_nothing(
    hosts: Hosts, make_tenant: MakeTenant, mock_upstream: MockUpstream,
    cluster_engine: QuotaEngine, redis_cluster_url: str, django_db_blocker: Any,
) -> None:
    """18 clients call the three hosts without a pause (streams of about 1.6 s and short calls
    in turn) while host 0 (two workers) is told to stop (SIGTERM to uvicorn's supervisor) and a
    new host takes its place on another port, as a load balancer's target list would change.
    Every call either completed (200 with its whole answer and usage) or was refused before any
    answer began, and the upstream saw exactly the completed ones (its request log for this
    test's provider key); the old host finished its streams in flight and exited by itself;
    the ledger has one settled row per completed call with the tokens the mock produced."""
    engine = cluster_engine
    t = make_tenant(plan="enterprise", requests_per_second=-1)
    base = unique_model("fx-hosts-roll")
    streamed, plain = f"{base}@chunk_ms=40@output_tokens=40", f"{base}@first_byte_ms=200"
    long = f"{base}@chunk_ms=40@output_tokens=150"  # about 6 s, longer than the load's calls
    secret = dedicated_key(django_db_blocker, redis_cluster_url, t, mock_upstream, "roll",
                           [streamed, plain, long])
    time.sleep(1.0)  # every worker's pool has the key (published on the cluster)
    old = hosts.servers[0]
    outcomes: list[Outcome] = []
    leavers: list[str] = []  # request ids of the streams whose clients left
    marks: dict[str, float] = {}

    async def scenario() -> None:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:

            async def client(host: int, first_streams: bool) -> None:
                stream = first_streams
                while not stop.is_set():
                    url = hosts.servers[host].base_url  # the load balancer's current target
                    outcomes.append(await one_call(http, host, url, t.plaintext,
                                                   streamed if stream else plain, stream))
                    stream = not stream
                    if outcomes[-1].status is None:
                        await asyncio.sleep(0.05)  # a refused connection: try again shortly

            clients = [asyncio.create_task(client(host, i % 2 == 0))
                       for host in range(3) for i in range(6)]

            def streams_in_flight_on_old() -> bool:
                return sum(o.complete for o in outcomes) >= 20
            assert await eventually_async(streams_in_flight_on_old, 60)
            # Three clients leave their long streams on the old host just before it is told to
            # stop: each stream's drain (reading the upstream for its usage, then the settle)
            # goes on detached from its request, after uvicorn has nothing left to wait for;
            # the lifespan shutdown awaits it (gateway/shutdown.py).
            leavers.extend(await asyncio.gather(*(
                leave_a_stream(http, old.base_url, t.plaintext, long) for _ in range(3))))
            marks["term"] = time.monotonic()
            old.process.send_signal(signal.SIGTERM)
            # The replacement starts while the old host drains (start_gateway blocks).
            await asyncio.to_thread(hosts.start, 0)
            marks["new"] = time.monotonic()
            assert await eventually_async(
                lambda: sum(o.complete and o.url == hosts.urls[0] for o in outcomes) >= 10, 60)
            stop.set()
            await asyncio.gather(*clients)

    from tests.gateway.test_e2e_call_end import eventually as eventually_async

    asyncio.run(scenario())
    # The old host exited by itself (its supervisor and workers), well within its drain.
    old.process.wait(timeout=2 * DRAIN_SECONDS + 15)
    assert old.worker_pids() == []
    log = old.log.read_text()
    assert "calls' ends not done" not in log and "Cancel" not in log, log[-3000:]

    completed = [o for o in outcomes if o.status == 200 and o.complete]
    broken = [o for o in outcomes if not o.refused and not (o.status == 200 and o.complete)]
    assert broken == [], broken[:5]
    refused = [o for o in outcomes if o.refused]
    # Calls the old host had in flight when told to stop, streams among them, finished.
    drained = [o for o in completed if o.url == old.base_url and o.started < marks["term"] < o.ended]
    assert any(o.stream for o in drained), (len(drained), len(refused))
    # The upstream saw the completed calls and the leavers' and nothing else: nothing refused
    # was forwarded.
    assert mock_requests(mock_upstream, secret) == len(completed) + len(leavers)

    # Every hold ended by its own gateway: none left for the sweep (the leavers' included).
    assert engine.open_hold_ids(t.tag) == []
    counter = engine.counter(t.tag, "tenant")
    bill = billed(mock_upstream, base, secret)
    assert bill["requests"] == len(completed) + len(leavers)
    assert counter.pending == 0
    assert counter.used == bill["total_tokens"]
    rows = {r.request_id: r for r in drain(engine, django_db_blocker, t.tenant_id)}
    assert sorted(rows) == sorted([o.request_id for o in completed] + leavers)
    assert {rows[o.request_id].status for o in completed} == {"settled"}
    assert sum(o.tokens for o in completed) == sum(
        rows[o.request_id].input_tokens + rows[o.request_id].output_tokens for o in completed)
    # The leavers' drains read the upstream to its usage: charged all it produced, not swept.
    assert all(rows[i].status == "partial" and rows[i].output_tokens == 150 for i in leavers), [
        (rows[i].status, rows[i].output_tokens) for i in leavers]
    assert sum(r.input_tokens + r.output_tokens for r in rows.values()) == bill["total_tokens"]
    print(f"rolling restart: {len(completed)} calls completed ({len(drained)} drained by the "
          f"old host, {sum(o.stream for o in drained)} streams), {len(refused)} refused before "
          f"any answer; new host up {marks['new'] - marks['term']:.1f} s after SIGTERM")


def test_a_stream_longer_than_the_drain_is_cut_and_charged_what_it_produced(
    hosts: Hosts, make_tenant: MakeTenant, cluster_engine: QuotaEngine,
    django_db_blocker: Any,
) -> None:
    """A host whose drain (2 s) is shorter than a stream in flight (10 s): at the drain's end
    uvicorn cancels the call, which ends as if its client had left (the stream is read for up
    to GATEWAY_STREAM_DRAIN_SECONDS more, then settled with the text counted); the lifespan
    awaits that settle, and the host exits with no hold left for the sweep."""
    from tests.gateway.test_e2e_call_end import ClientStream, eventually

    engine = cluster_engine
    host = start_gateway(hosts.tmp, workers=1, **{
        **hosts.env, "GATEWAY_SHUTDOWN_DRAIN_SECONDS": "2", "GATEWAY_STREAM_DRAIN_SECONDS": "1"})
    try:
        t = make_tenant(plan="enterprise", requests_per_second=-1)
        model = f"{unique_model('fx-hosts-cut')}@chunk_ms=100@output_tokens=100"
        stream = ClientStream()

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                task = asyncio.create_task(stream.run(
                    http, f"{host.base_url}/chat/completions", t.plaintext, model))
                assert await eventually(lambda: stream.chunks >= 5, 30), stream.chunks
                host.process.send_signal(signal.SIGTERM)
                await task

        asyncio.run(scenario())
        host.process.wait(timeout=30)  # by itself: 2 s of drain, then at most 2 s of ends
    finally:
        host.stop()
    assert 5 <= stream.chunks < 100  # cut: some of the answer, not all of it
    assert engine.open_hold_ids(t.tag) == []
    [event] = usage_events(engine, t.tag)
    assert (event["outcome"], event["event"]["outcome"]) == (
        "settled", "client_disconnected_counted")
    # At least what the client received (the drain may have read a little more: produced).
    charged_in, charged_out = event["event"]["in"], event["event"]["out"]
    assert stream.tokens() <= charged_out < 100
    assert charged_in + charged_out == int(event["actual"]) <= int(event["held"])
    [row] = drain(engine, django_db_blocker, t.tenant_id)
    assert (row.status, row.output_tokens) == ("partial", charged_out)
