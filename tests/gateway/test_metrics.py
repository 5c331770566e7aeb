"""The request metrics' own parts, in process (gateway/metrics.py, gateway/observe.py): the tally
writes what direct observations would, labels stay bounded, the tenant label is opt-in, settings
fail loudly, and the counts made outside a call (a cool-down, the sweep, a call served through
Django's handler) land where /metrics reads them. The counts of real calls are checked end to end
in test_e2e_metrics.py."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.test import Client
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from billing import metrics as page
from gateway import metrics
from gateway.catalog import Catalog, fallback_model_info
from gateway.listener import publish_cooldown
from gateway.prices import PriceBook
from gateway.providers import ProviderPool, Upstream
from gateway.usage import Usage
from quotas import tasks
from quotas.engine import ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tests.support.prometheus import samples

ROOT = Path(__file__).resolve().parents[2]


def scrape() -> dict[str, float]:
    """This process's request metrics as /metrics shows them (the tally written first)."""
    return samples(page.exposition(page._RequestCollector()))


def test_the_tally_writes_what_direct_observations_would() -> None:
    """One increment per bucket instead of one per observation, through prometheus_client's
    own values (`_sum`, `_buckets`): the page must be the same as with observe()."""
    bounds = (0.001, 0.01, 0.1)
    direct_registry, tallied_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("h_seconds", "h", ["op"], buckets=bounds, registry=direct_registry)
    tallied = Histogram("h_seconds", "h", ["op"], buckets=bounds, registry=tallied_registry)
    child = metrics.HistogramChild(tallied, ("x",), bounds)
    tally = metrics.Tally()
    values = [0.0005, 0.001, 0.0011, 0.05, 0.1, 0.2, 7.0, 0.0]
    for value in values:
        direct.labels("x").observe(value)
        tally.observe(child, value)
    tally.flush()
    assert generate_latest(tallied_registry) == generate_latest(direct_registry)
    got = samples(generate_latest(tallied_registry).decode())
    assert got['h_seconds_bucket{op="x",le="0.001"}'] == 3  # cumulative, `le` inclusive
    assert got['h_seconds_count{op="x"}'] == len(values)


def test_the_tally_is_written_at_once_without_an_event_loop_and_later_with_one() -> None:
    metrics.flush()  # forgets a timer of a test's loop that ended before it fired
    child = metrics.HOLDS.labels("opened")
    before = child._value.get()
    metrics.add(child)  # no running loop here (as in a Celery task): written now
    assert child._value.get() == before + 1

    async def on_a_loop() -> float:
        metrics.add(child)
        written = child._value.get()
        await asyncio.sleep(0.3)  # TOLLGATE_METRICS_FLUSH_SECONDS is 0.1 below
        return written

    from django.conf import settings

    old = settings.TOLLGATE_METRICS_FLUSH_SECONDS
    settings.TOLLGATE_METRICS_FLUSH_SECONDS = 0.1
    try:
        written_at_once = asyncio.run(on_a_loop())
    finally:
        settings.TOLLGATE_METRICS_FLUSH_SECONDS = old
    assert written_at_once == before + 1  # tallied, not yet written
    assert child._value.get() == before + 2  # written by the loop's timer


def test_the_routers_lifespan_shutdown_writes_the_tally(
        settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A uvicorn worker told to stop ends by the SIGTERM it re-raises, so exit hooks never run:
    the router writes the tally at the lifespan's shutdown (before the other hooks, which run
    even if one fails), whatever the flush interval."""
    from gateway.asgi import GatewayRouter

    settings.TOLLGATE_METRICS_FLUSH_SECONDS = 3600
    child = metrics.HOLDS.labels("released")
    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("exporter gone")

    router = GatewayRouter(None, {}, on_shutdown=(  # type: ignore[arg-type]
        failing, lambda: ran.append(f"written {child._value.get()}")))

    async def serve_then_stop() -> tuple[float, list[str]]:
        inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        sent: list[str] = []

        async def send(message: dict[str, str]) -> None:
            sent.append(message["type"])

        inbox.put_nowait({"type": "lifespan.startup"})
        lifespan = asyncio.ensure_future(router({"type": "lifespan"}, inbox.get, send))
        await asyncio.sleep(0)
        metrics.add(child)  # a call's figure, tallied: the timer is an hour away
        before = child._value.get()
        inbox.put_nowait({"type": "lifespan.shutdown"})
        await lifespan
        return before, sent

    metrics.flush()
    start = child._value.get()
    before, sent = asyncio.run(serve_then_stop())
    assert before == start  # tallied, not written, until the shutdown
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert ran == ["failing", f"written {start + 1}"]
    assert "shutdown hook" in caplog.text and "exporter gone" in caplog.text


def test_model_labels_are_catalog_models_or_other() -> None:
    catalog = Catalog.of([fallback_model_info("gpt-4o"), fallback_model_info("gpt-4o-mini")],
                         PriceBook.of(aliases={"gpt-4o-2024-08-06": "gpt-4o"}))
    assert metrics.model_label(catalog, "gpt-4o-mini") == "gpt-4o-mini"
    assert metrics.model_label(catalog, "gpt-4o-2024-08-06") == "gpt-4o"  # an alias: its model
    assert metrics.model_label(catalog, "my-own-model-7") == "other"
    assert metrics.model_label(catalog, 'a"b\nc') == "other"
    assert metrics.model_label(None, "gpt-4o") == "other"


def test_token_classes_split_every_token_once() -> None:
    usage = Usage.of(100, 40, cached=30, cache_write=5, reasoning=12)
    split = dict(zip(metrics.TOKEN_CLASSES, metrics.token_classes(usage), strict=True))
    assert split == {"input": 65, "cached_input": 30, "cache_write": 5, "output": 28,
                     "reasoning": 12}
    assert sum(split.values()) == usage.total


def test_the_tenant_label_is_only_for_listed_tenants(settings: Any) -> None:
    settings.TOLLGATE_METRICS_TENANTS = ()
    assert metrics.tenant_label("ten_abc", "acme") is None
    settings.TOLLGATE_METRICS_TENANTS = ("acme", "ten_XYZ")
    assert metrics.tenant_label("ten_abc", "acme") == "acme"  # by slug
    assert metrics.tenant_label("ten_XYZ", "other-co") == "ten_XYZ"  # by public id
    assert metrics.tenant_label("ten_def", "someone") is None


def test_no_tenant_family_exists_until_a_listed_tenant_is_counted() -> None:
    # No test in this process counts a listed tenant through a call, so neither family was made
    # (the e2e test checks them in its gateway's workers).
    if metrics._tenant_families.requests is None:
        assert "tollgate_tenant_requests" not in page.exposition(page._RequestCollector())
    metrics.add(metrics.tenant_request_child("acme", "chat/completions", 200))
    got = scrape()
    assert got['tollgate_tenant_requests_total{tenant="acme",endpoint="chat/completions",'
               'status="200"}'] >= 1


def _load(**env: str) -> subprocess.CompletedProcess[str]:
    code = ("import config.settings as s; "
            "print(s.TOLLGATE_METRICS_TENANTS, s.TOLLGATE_METRICS_FLUSH_SECONDS)")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, text=True,
                          capture_output=True, env={**os.environ, **env})


def test_metrics_settings_defaults_and_values() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOLLGATE_METRICS_TENANTS", "TOLLGATE_METRICS_FLUSH_SECONDS")}
    default = subprocess.run([sys.executable, "-c", "import config.settings as s; print("
                              "s.TOLLGATE_METRICS_TENANTS, s.TOLLGATE_METRICS_FLUSH_SECONDS)"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["()", "1.0"]
    listed = _load(TOLLGATE_METRICS_TENANTS=" acme , ten_0123456789abcdef ")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("('acme', 'ten_0123456789abcdef')")


@pytest.mark.parametrize(("env", "message"), [
    ({"TOLLGATE_METRICS_TENANTS": "acme,"}, "'' is not a tenant public id or slug"),
    ({"TOLLGATE_METRICS_TENANTS": "acme co"}, "'acme co' is not a tenant public id or slug"),
    ({"TOLLGATE_METRICS_TENANTS": 'a"b'}, "is not a tenant public id or slug"),
    ({"TOLLGATE_METRICS_TENANTS": "acme,acme"}, "lists a tenant twice"),
    ({"TOLLGATE_METRICS_TENANTS": ",".join(f"t{i}" for i in range(101))}, "at most 100"),
    ({"TOLLGATE_METRICS_FLUSH_SECONDS": "0"}, "TOLLGATE_METRICS_FLUSH_SECONDS must be > 0"),
    ({"TOLLGATE_METRICS_FLUSH_SECONDS": "61"}, "TOLLGATE_METRICS_FLUSH_SECONDS must be > 0"),
    ({"TOLLGATE_METRICS_FLUSH_SECONDS": "soon"}, "could not convert"),
])
def test_bad_metrics_settings_fail_loudly(env: dict[str, str], message: str) -> None:
    result = _load(**env)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_multiprocess_directory_that_does_not_exist_stops_the_import(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); import gateway.metrics"],
        cwd=ROOT, timeout=60, text=True, capture_output=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings",
             "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")})
    assert result.returncode != 0
    assert "is not a directory" in result.stderr


def test_a_call_served_through_djangos_handler_is_counted_when_its_response_closes() -> None:
    key = ('tollgate_requests_total{endpoint="embeddings",status="405",refusal="",'
           'model=""}')
    before = scrape().get(key, 0)
    assert Client().get("/v1/embeddings").status_code == 405
    assert scrape()[key] == before + 1


def test_a_cooldown_is_counted_where_it_starts() -> None:
    upstream = Upstream(id=991, public_id="pk_cooling", base_url="http://x.invalid/v1",
                        secret="s", rpm_capacity=None, tpm_capacity=None)
    published: list[Any] = []

    class Client_:
        async def publish(self, channel: str, message: str) -> None:
            published.append(message)

    runtime = SimpleNamespace(pool=ProviderPool([upstream]),
                              engine=SimpleNamespace(client=Client_()))
    key = 'tollgate_provider_cooldowns_total{provider_key="pk_cooling"}'
    before = scrape().get(key, 0)
    asyncio.run(publish_cooldown(runtime, 991, 1e12))  # type: ignore[arg-type]
    asyncio.run(publish_cooldown(runtime, 991, 1e12))  # type: ignore[arg-type]
    assert len(published) == 2
    assert scrape()[key] == before + 2


@pytest.mark.django_db
def test_the_sweep_task_counts_the_holds_it_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    from tenants.services import create_tenant

    engine = get_engine()
    tenant = create_tenant("swept-co", plan_name="free", actor="t")
    tag = tenant_tag(tenant.pk)
    limits = (ScopeLimit("tenant", WindowKind.DAY, 10**6),)
    for i in range(3):
        assert engine.reserve(ReserveRequest(tag, f"stale-{i}", 10, limits)).admitted
    # Every hold is stale for this run of the task (which reads the index of active tenants
    # through the engine's client).
    stale_engine = SimpleNamespace(sweep=lambda t: engine.sweep(t, stale_s=0),
                                   client=engine.client)
    monkeypatch.setattr(tasks, "get_engine", lambda: stale_engine)
    before = scrape().get('tollgate_holds_total{event="swept"}', 0)
    assert tasks.sweep_stale_holds() >= 3
    assert scrape()['tollgate_holds_total{event="swept"}'] >= before + 3
    assert tasks._swept_observer is not None  # installed by gateway.apps


def test_an_observation_finishes_once() -> None:
    from gateway.observe import Observation

    key = ('tollgate_requests_total{endpoint="completions",status="200",refusal="",'
           'model="other"}')
    before = scrape().get(key, 0)
    obs = Observation("completions")
    obs.model = "other"
    obs.finish(200)
    obs.finish(499)  # a second end (the router, then Django's close hook) counts nothing
    got = scrape()
    assert got[key] == before + 1
    assert 'tollgate_requests_total{endpoint="completions",status="499",refusal="",' \
           'model="other"}' not in got


def test_serve_gives_its_processes_one_emptied_multiprocess_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from config import serve

    shared = tmp_path / "prom"
    shared.mkdir()
    (shared / "counter_123.db").write_bytes(b"x")  # a previous run's
    (shared / "keep.txt").write_text("not ours")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(shared))
    assert serve.metrics_dir() == shared
    assert sorted(p.name for p in shared.iterdir()) == ["keep.txt"]
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setattr(serve, "data_dir", lambda: tmp_path / "data")
    made = serve.metrics_dir()
    assert made == tmp_path / "data" / "prometheus" and made.is_dir()
