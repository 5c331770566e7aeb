"""Traces end to end: a gateway under uvicorn (two workers) started with OTEL_EXPORTER_OTLP_ENDPOINT
pointing at a real OTLP/HTTP receiver on loopback (tests/support/otlp_receiver.py). Its calls'
spans arrive there, one trace per call with the request id as an attribute; with the batch's own
timer set to ten minutes they arrive only through the flush at the workers' exit."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MakeTenant, committed, start_gateway
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def test_a_gateways_spans_reach_an_otlp_collector_and_are_flushed_at_exit(
    provider_key: str, make_tenant: MakeTenant, django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tenants.models import Tenant

    t = make_tenant(requests_per_second=-1)
    poor = make_tenant(tokens_per_day=10)
    tenant_id = committed(django_db_blocker, lambda: Tenant.objects.get(pk=t.tenant_id).public_id)
    with OtlpReceiver() as receiver:
        server = start_gateway(tmp_path_factory.mktemp("otlp-gateway"), workers=2,
                               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                               OTEL_SERVICE_NAME="tollgate-e2e",
                               OTEL_BSP_SCHEDULE_DELAY="600000")
        try:
            calls: dict[str, str] = {}
            with httpx.Client(base_url=server.base_url, timeout=30) as http:
                for kind, key, body in (
                        ("plain", t.plaintext, {"model": "gpt-4o", "max_tokens": 8}),
                        ("stream", t.plaintext, {"model": "gpt-4o", "max_tokens": 8,
                                                 "stream": True}),
                        ("refused", poor.plaintext, {"model": "gpt-4o", "max_tokens": 50})):
                    response = http.post("/chat/completions",
                                         headers={"Authorization": f"Bearer {key}"},
                                         json={"messages": [{"role": "user", "content": "hi"}],
                                               **body})
                    assert response.status_code == (429 if kind == "refused" else 200)
                    calls[kind] = response.headers["x-request-id"]
            # Nothing yet: the batch waits for its timer (ten minutes) or the exit.
            assert receiver.spans() == []
        finally:
            server.stop()
        assert server.process.returncode is not None
        try:
            spans = receiver.wait_for(
                lambda found: {s.attributes.get("tollgate.request_id") for s in found
                               if s.name == "gateway.request"} >= set(calls.values()))
        except AssertionError as missing:
            # Seen once in a full run on a loaded machine (no span at all came); the workers'
            # own account of their exit is what tells why.
            raise AssertionError(
                f"{missing}\ngateway exit code {server.process.returncode}; its log:\n"
                f"{server.log.read_text(errors='replace')[-4000:]}") from None
        assert all(post["path"] == "/v1/traces" for post in receiver.posts)

    by_request: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_request[span.attributes["tollgate.request_id"]].append(span)
    assert {span.service for span in spans} == {"tollgate-e2e"}
    for kind, rid in calls.items():
        [root] = [s for s in by_request[rid] if s.name == "gateway.request"]
        assert root.parent_span_id == ""
        assert root.attributes["http.response.status_code"] == (429 if kind == "refused"
                                                                 else 200)
        # One trace per call: every span of the call is in the request span's trace.
        assert {s.trace_id for s in by_request[rid]} == {root.trace_id}
        children = {s.name for s in by_request[rid] if s.parent_span_id == root.span_id}
        if kind == "refused":
            assert "upstream.call" not in children and "quota.reserve" in children
        else:
            assert root.attributes["tollgate.tenant"] == tenant_id
            assert {"quota.reserve", "upstream.call", "quota.settle"} <= children, children
