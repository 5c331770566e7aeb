"""JSON logs end to end: a gateway under uvicorn (two workers) with TOLLGATE_LOG_FORMAT=json, its
output captured to a file, called with a recognisable API key and a recognisable prompt, in
every way a call can end (served, streamed, refused by a quota, a bad key, an upstream 500, a
stream its client leaves, Anthropic's x-api-key). Every line of the file is a JSON object; each
call has exactly one access line with its x-request-id, tenant and key public ids; and neither
a key's secret, the provider's secret, the prompt nor the answer appears anywhere."""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from billing.ledger import drain_tenant
from billing.models import UsageRecord
from config.log_format import MASK
from gateway.mock_upstream.app import answer_text
from quotas.engine import QuotaEngine
from tenants.api_key_format import generate_key
from tests.gateway.conftest import (
    ANTHROPIC_MOCK_SECRET,
    GatewayServer,
    MakeTenant,
    committed,
    start_gateway,
    wait_until,
)

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

# The provider key every e2e test shares (tests/gateway/conftest.py provider_key).
OPENAI_MOCK_SECRET = "sk-mock-upstream"


@dataclass(frozen=True)
class Expected:
    """What the access line of one call must say."""
    status: int
    tenant: str | None
    api_key: str | None
    endpoint: str
    stream: bool = False
    refusal: str = ""


@pytest.fixture(scope="module")
def json_gateway(provider_key: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    # LOG_LEVEL=INFO: the workers' own INFO lines are in the file too, not only the access log.
    server = start_gateway(tmp_path_factory.mktemp("json-logs"), workers=2,
                           TOLLGATE_LOG_FORMAT="json", LOG_LEVEL="INFO")
    yield server
    server.stop()


def parse(text: str) -> list[dict[str, Any]]:
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            parsed = json.loads(line)
        except ValueError:
            pytest.fail(f"line {number} of the gateway's output is not JSON: {line!r}")
        assert isinstance(parsed, dict), line
        lines.append(parsed)
    return lines


def public_ids(django_db_blocker: Any, tenant_pk: int) -> str:
    from tenants.models import Tenant

    return committed(django_db_blocker, lambda: Tenant.objects.get(pk=tenant_pk).public_id)


def test_json_lines_with_one_access_line_per_call_and_no_secret_or_prompt(
    json_gateway: GatewayServer, make_tenant: MakeTenant, django_db_blocker: Any,
    engine: QuotaEngine,
) -> None:
    server = json_gateway
    rich = make_tenant(requests_per_second=-1)
    poor = make_tenant(tokens_per_day=10)
    rich_tenant = public_ids(django_db_blocker, rich.tenant_id)
    poor_tenant = public_ids(django_db_blocker, poor.tenant_id)
    canary = uuid.uuid4().hex
    prompt = f"PROMPT-CANARY-{canary} what does the zebra in the attic eat"
    messages = [{"role": "user", "content": prompt}]
    bad_key = generate_key()[0]  # well formed, never issued
    expected: dict[str, Expected] = {}

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def chat(key: str, **body: Any) -> httpx.Response:
        return http.post("/v1/chat/completions", headers=bearer(key),
                         json={"messages": messages, **body})

    served = Expected(200, rich_tenant, rich.api_key_public_id, "chat/completions")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        # Served, then streamed to the end.
        response = chat(rich.plaintext, model="gpt-4o", max_tokens=8)
        assert response.status_code == 200, response.text
        expected[response.headers["x-request-id"]] = served
        rich_first = response.headers["x-request-id"]
        with http.stream("POST", "/v1/chat/completions", headers=bearer(rich.plaintext),
                         json={"model": "gpt-4o", "messages": messages, "max_tokens": 8,
                               "stream": True,
                               "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            assert "[DONE]" in response.read().decode()
            expected[response.headers["x-request-id"]] = Expected(
                200, rich_tenant, rich.api_key_public_id, "chat/completions", stream=True)
        # The upstream fails (HTTP 500): the gateway answers 502.
        response = chat(rich.plaintext, model="gpt-4o@status=500", max_tokens=8)
        assert response.status_code == 502, response.text
        expected[response.headers["x-request-id"]] = Expected(
            502, rich_tenant, rich.api_key_public_id, "chat/completions")
        # A key that does not exist: no tenant or key to name.
        response = chat(bad_key, model="gpt-4o", max_tokens=8)
        assert response.status_code == 401, response.text
        expected[response.headers["x-request-id"]] = Expected(401, None, None,
                                                              "chat/completions")
        # Refused by the tenant's quota (10 tokens a day, 50 asked).
        response = chat(poor.plaintext, model="gpt-4o", max_tokens=50)
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "insufficient_quota"
        expected[response.headers["x-request-id"]] = Expected(
            429, poor_tenant, poor.api_key_public_id, "chat/completions", refusal="quota_tenant")
        poor_first = response.headers["x-request-id"]
        # Anthropic's Messages API, the key in x-api-key.
        response = http.post("/v1/messages", headers={"x-api-key": rich.plaintext},
                             json={"model": "claude-canary", "max_tokens": 8,
                                   "messages": messages})
        assert response.status_code == 200, response.text
        expected[response.headers["x-request-id"]] = Expected(
            200, rich_tenant, rich.api_key_public_id, "messages")
        # A stream its client leaves after two chunks (about 10 s of answer left).
        with http.stream("POST", "/v1/chat/completions", headers=bearer(rich.plaintext),
                         json={"model": "gpt-4o@chunk_ms=100@output_tokens=100",
                               "messages": messages, "max_tokens": 200,
                               "stream": True}) as response:
            assert response.status_code == 200
            chunks = response.iter_lines()
            assert next(chunks).startswith("data: ") and next(chunks) is not None
            expected[response.headers["x-request-id"]] = Expected(
                499, rich_tenant, rich.api_key_public_id, "chat/completions", stream=True)

    def access_lines() -> list[dict[str, Any]]:
        return [line for line in parse(server.log.read_text())
                if line.get("logger") == "tollgate.access"]

    # The stream its client left is logged once its drain has settled (about 10 s of answer).
    assert wait_until(lambda: {line["request_id"] for line in access_lines()} >= set(expected),
                      timeout=40), access_lines()
    server.stop()  # everything the workers had to say, shutdown included
    output = server.log.read_text()
    lines = parse(output)

    # One access line per call, saying how it ended and for whom.
    access = [line for line in lines if line["logger"] == "tollgate.access"]
    assert sorted(line["request_id"] for line in access) == sorted(expected)
    for line in access:
        want = expected[line["request_id"]]
        assert (line["status"], line.get("tenant"), line.get("api_key"), line["endpoint"],
                line["stream"], line["refusal"]) == (
            want.status, want.tenant, want.api_key, want.endpoint, want.stream, want.refusal), line
        assert line["level"] == "INFO" and line["time"].endswith("Z")
        assert line["duration_ms"] > 0
        if want.status == 200:
            assert line["input_tokens"] > 0 and line["output_tokens"] > 0, line
            assert line["upstream_ms"] is not None and line["cost_micros"] > 0, line

    # Each access line says what its call was charged: the ledger's row, token for token, the
    # stream its client left too (its line waits for the drain's settle, with the 499 and the
    # client's duration). Refusals and the upstream's 500 charge nothing.
    for tenant_pk in (rich.tenant_id, poor.tenant_id):
        committed(django_db_blocker, lambda pk=tenant_pk: drain_tenant(engine.client, pk))
    rows = committed(django_db_blocker, lambda: {
        row.request_id: row for row in UsageRecord.objects.filter(
            tenant_id__in=(rich.tenant_id, poor.tenant_id))})
    for line in access:
        row = rows.get(line["request_id"])
        charged = ((row.input_tokens, row.output_tokens, row.cost_micros) if row is not None
                   else (0, 0, 0))
        assert (line["input_tokens"], line["output_tokens"], line["cost_micros"]) == charged, (
            line, charged)
    left = next(line for line in access if line["status"] == 499)
    assert left["output_tokens"] > 2 and rows[left["request_id"]].status == "partial", left

    # A call's other lines carry its ids: the request id always, the tenant and key once known
    # (the worker's start-up line, logged while it serves its first call, has only the first).
    callers = {rid: (want.tenant, want.api_key) for rid, want in expected.items()}
    for line in lines:
        if line.get("request_id") in callers:
            assert (line.get("tenant"), line.get("api_key")) in (
                callers[line["request_id"]], (None, None)), line
    assert any(line["message"].startswith("gateway worker ready") for line in lines), output
    # Work a call hands to a thread logs with its ids too: each tenant's first call found no
    # epoch (Redis had never seen the tenant), and its counters were rebuilt on a database
    # thread, whose line names that call.
    rebuilt = {line.get("request_id"): line for line in lines
               if line["message"].startswith("quota counters of tenant")}
    assert rebuilt.keys() >= {rich_first, poor_first}, rebuilt
    for first, tenant, key in ((rich_first, rich_tenant, rich.api_key_public_id),
                               (poor_first, poor_tenant, poor.api_key_public_id)):
        assert (rebuilt[first]["tenant"], rebuilt[first]["api_key"]) == (tenant, key)
        assert rebuilt[first]["level"] == "WARNING"

    # Never a secret, a prompt or an answer; nothing even needed masking.
    for secret in (rich.plaintext, rich.plaintext.rsplit("_", 1)[1], poor.plaintext,
                   poor.plaintext.rsplit("_", 1)[1], bad_key, bad_key.rsplit("_", 1)[1],
                   OPENAI_MOCK_SECRET, ANTHROPIC_MOCK_SECRET, canary, "zebra in the attic",
                   answer_text(8), MASK):
        assert secret not in output, secret
