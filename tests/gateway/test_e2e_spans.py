"""The spans of a /v1 call, exported to the OpenTelemetry SDK's in-memory exporter: the gateway
(GatewayRouter in front of Django's ASGI handler, as config/asgi.py builds it) runs in this
process under httpx's ASGI transport, over the session's Redis, PostgreSQL and mock upstream.
With tracing off no span is made at all."""
from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.db import connection
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway import startup, tracing
from gateway.asgi import GatewayRouter
from gateway.urls import direct_routes, prefix_routes
from tests.gateway.conftest import MakeTenant, TenantKey, committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "trace this call"}]


@contextmanager
def in_memory_tracing() -> Iterator[InMemorySpanExporter]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


@pytest.fixture
def fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's event loop builds its own worker runtime (the process's is bound to another
    loop, if any); the GC tuning of a real worker is left out."""
    monkeypatch.setattr(startup, "_runtime", None)
    monkeypatch.setattr(startup, "_lock", None)
    monkeypatch.setattr(settings, "GATEWAY_GC_GEN0_THRESHOLD", 0)


async def _stop_runtime() -> None:
    """Stop what the runtime started: its background tasks, clients and database threads (each
    closes its connection, or the test database could not be dropped at the end)."""
    runtime = startup._runtime
    if runtime is None:
        return
    while runtime.background:
        for task in list(runtime.background):
            task.cancel()
        await asyncio.gather(*list(runtime.background), return_exceptions=True)
    await runtime.http.aclose()
    await runtime.engine.client.aclose()
    threads = settings.GATEWAY_DB_THREADS
    barrier = threading.Barrier(threads)

    def close() -> None:
        barrier.wait(10)  # one job on every thread
        connection.close()

    await asyncio.gather(*(runtime.db.run(close) for _ in range(threads)))
    runtime.db._executor.shutdown(wait=True)


def _drive(calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """POST each (key, body) to /v1/chat/completions of an in-process gateway, in order."""
    async def run() -> list[httpx.Response]:
        app = GatewayRouter(ASGIHandler(), direct_routes(), prefix_routes())
        answers = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway", timeout=30) as client:
                for key, body in calls:
                    response = await client.post("/v1/chat/completions", json=body,
                                                 headers={"Authorization": f"Bearer {key}"})
                    await response.aread()
                    answers.append(response)
        finally:
            await _stop_runtime()
        return answers

    return asyncio.run(run())


def _by_trace(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    """Each call's spans, by its gateway.request span's request id."""
    roots = {s.context.trace_id: s for s in spans if s.name == "gateway.request"}
    out: dict[str, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        out[roots[span.context.trace_id].attributes["tollgate.request_id"]].append(span)
    return out


def _public_ids(django_db_blocker: Any, t: TenantKey) -> tuple[str, str]:
    from gateway.models import ProviderKey
    from tenants.models import Tenant

    return committed(django_db_blocker, lambda: (
        Tenant.objects.get(pk=t.tenant_id).public_id,
        ProviderKey.objects.get(name="mock").public_id))


def test_a_calls_spans_nest_under_its_request_span(
        fresh_runtime: None, make_tenant: MakeTenant, django_db_blocker: Any) -> None:
    t = make_tenant(requests_per_second=1000)
    poor = make_tenant(tokens_per_day=10)
    tenant_id, provider_id = _public_ids(django_db_blocker, t)
    failing = f"sp-{t.slug}@status=500"
    with in_memory_tracing() as exporter:
        plain, stream, refused, failed = _drive([
            (t.plaintext, {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 8}),
            (t.plaintext, {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 8,
                           "stream": True}),
            (poor.plaintext, {"model": "gpt-4o", "messages": MESSAGES}),
            (t.plaintext, {"model": failing, "messages": MESSAGES}),
        ])
        spans = exporter.get_finished_spans()
    assert [plain.status_code, stream.status_code, refused.status_code,
            failed.status_code] == [200, 200, 429, 502]
    calls = _by_trace(spans)
    assert len(calls) == 4 and len({s.context.trace_id for s in spans}) == 4

    def parts(response: httpx.Response) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
        found = calls[response.headers["x-request-id"]]
        [root] = [s for s in found if s.name == "gateway.request"]
        assert root.parent is None
        children: dict[str, list[ReadableSpan]] = defaultdict(list)
        for span in found:
            if span is not root:
                assert span.parent is not None and span.parent.span_id == root.context.span_id
                assert span.attributes["tollgate.request_id"] == root.attributes[
                    "tollgate.request_id"]
                children[span.name].append(span)
        return root, children

    for response in (plain, stream):
        root, children = parts(response)
        assert dict(root.attributes) == {
            "tollgate.endpoint": "chat/completions", "tollgate.model": "gpt-4o",
            "tollgate.request_id": response.headers["x-request-id"],
            "tollgate.stream": response is stream, "http.response.status_code": 200,
            "tollgate.tenant": tenant_id}
        assert sorted(children) == ["quota.reserve", "quota.settle", "upstream.call"]
        [reserve], [upstream], [settle] = (children["quota.reserve"], children["upstream.call"],
                                           children["quota.settle"])
        assert upstream.attributes["tollgate.provider_key"] == provider_id
        assert upstream.attributes["http.response.status_code"] == 200
        assert settle.attributes["tollgate.outcome"] == "settled"
        # In order, within the call: reserve, then the upstream, then the settle.
        assert root.start_time <= reserve.start_time <= reserve.end_time <= upstream.start_time
        assert upstream.end_time <= settle.start_time <= settle.end_time <= root.end_time
        assert root.status.status_code is StatusCode.UNSET

    root, children = parts(refused)
    assert root.attributes["tollgate.refusal"] == "quota_tenant"
    assert root.attributes["http.response.status_code"] == 429
    [reserve] = children.pop("quota.reserve")
    # A refusal is the call's answer, not a server error (OpenTelemetry leaves a 4xx UNSET):
    # the span says why instead.
    assert reserve.status.status_code is StatusCode.UNSET
    assert reserve.attributes["tollgate.refusal"] == "quota_tenant"
    assert root.status.status_code is StatusCode.UNSET
    assert not children  # never reached an upstream, no hold to end

    root, children = parts(failed)
    assert root.attributes["http.response.status_code"] == 502
    assert root.attributes["tollgate.model"] == "other"
    assert root.status.status_code is StatusCode.ERROR
    [upstream] = children["upstream.call"]
    assert upstream.attributes["http.response.status_code"] == 500
    [release] = children["quota.release"]
    assert release.attributes["tollgate.outcome"] == "released"
    assert "quota.settle" not in children


def test_no_span_is_made_when_tracing_is_off(
        fresh_runtime: None, make_tenant: MakeTenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, the gateway makes no span through any tracer: not even with an SDK provider
    installed as OpenTelemetry's global one (which code calling trace.get_tracer would use)."""
    from opentelemetry import trace

    t = make_tenant()
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    assert tracing.tracer() is None  # nothing enabled gateway.tracing
    [answer] = _drive([(t.plaintext, {"model": "gpt-4o", "messages": MESSAGES,
                                      "max_tokens": 4})])
    assert answer.status_code == 200
    assert exporter.get_finished_spans() == ()
