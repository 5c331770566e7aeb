"""Stored responses and conversations through a running gateway (uvicorn, 4 workers, real Redis
and PostgreSQL, the mock upstream), called with the official openai SDK.

- /v1/responses/{id} (retrieve, input_items, cancel, delete) passes through to the provider key
  that stores the response, for the tenant that made it only: another tenant's key gets a 404 and
  the upstream is never asked.
- A previous_response_id chain holds for the earlier turns: each turn's ledger row is the mock's
  bill (whose input includes the earlier turns) and never exceeds its hold.
- An unseen previous_response_id is refused before anything is held, unless the plan has a
  context allowance.
- A conversation created through the gateway carries its items' context into its turns.
"""
from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from gateway.mock_upstream import MockUpstream, api_key_id
from quotas.engine import QuotaEngine
from quotas.windows import WindowKind
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    TenantKey,
    client_for,
    committed,
    wait_until,
)
from tests.support.gateway_calls import SHARED_PROVIDER_SECRET, unique_model, usage_events

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

OUTPUT = 5  # words of each answer (the mock's output_tokens fault)


@pytest.fixture
def plan(django_db_blocker: Any) -> str:
    """A plan with room for a few quick calls in a row (free allows 5 requests a second)."""
    from tenants.services.plans import create_plan

    name = f"stored-{uuid.uuid4().hex[:8]}"
    committed(django_db_blocker, lambda: create_plan(
        name, actor="test", tokens_per_day=1_000_000, requests_per_second=100))
    return name


@pytest.fixture
def allowance_plan(django_db_blocker: Any) -> str:
    from tenants.services.plans import create_plan

    name = f"stored-allow-{uuid.uuid4().hex[:8]}"
    committed(django_db_blocker, lambda: create_plan(
        name, actor="test", tokens_per_day=1_000_000, requests_per_second=100,
        responses_context_allowance_tokens=2_000))
    return name


def _model() -> str:
    return f"{unique_model('stored')}@output_tokens={OUTPUT}"


def _billed(mock: MockUpstream, model: str) -> tuple[int, int, int]:
    """(input, output, requests) the mock billed for `model` under the shared provider key."""
    name = model.split("@")[0]
    for row in httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]:
        if row["model"] == name and row["api_key_id"] == api_key_id(SHARED_PROVIDER_SECRET):
            return row["prompt_tokens"], row["completion_tokens"], row["requests"]
    return 0, 0, 0


def _upstream_requests(mock: MockUpstream) -> int:
    """Requests the shared provider key has sent the mock (inference and stored objects)."""
    report = httpx.get(f"{mock.url}/mock/faults", timeout=5).json()
    return report["requests"].get(api_key_id(SHARED_PROVIDER_SECRET), 0)


def _rows(django_db_blocker: Any, engine: QuotaEngine, t: TenantKey, count: int) -> dict[str, Any]:
    """The tenant's ledger rows by request id, once its `count` usage events are drained."""
    from billing.ledger import drain_tenant
    from billing.models import UsageRecord

    assert wait_until(lambda: len(usage_events(engine, t.tag)) >= count)
    committed(django_db_blocker, lambda: drain_tenant(engine.client, t.tenant_id))
    rows = committed(django_db_blocker,
                     lambda: list(UsageRecord.objects.filter(tenant_id=t.tenant_id)))
    assert len(rows) == count, [(r.request_id, r.status) for r in rows]
    return {row.request_id: row for row in rows}


def _pending(engine: QuotaEngine, t: TenantKey) -> int:
    return engine.counter(t.tag, "tenant", WindowKind.DAY).pending


def test_a_stored_response_is_retrieved_listed_cancelled_and_deleted(
        gateway: GatewayServer, make_tenant: MakeTenant, plan: str) -> None:
    t = make_tenant(plan=plan)
    client = client_for(gateway, t.plaintext)
    created = client.responses.create(model=_model(), input="tell me about toll gates")
    assert created.status == "completed"

    raw = client.responses.with_raw_response.retrieve(created.id)
    assert raw.headers["x-request-id"].startswith("req_")
    retrieved = raw.parse()
    assert (retrieved.id, retrieved.output_text) == (created.id, created.output_text)
    assert retrieved.usage.output_tokens == OUTPUT

    items = client.responses.input_items.list(created.id, order="asc", limit=5)
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == "tell me about toll gates"

    # Background mode is refused at creation, so the upstream refuses to cancel: passed on.
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(created.id)
    assert refused.value.status_code == 400
    assert "toll" not in refused.value.message  # Tollgate's words, not the upstream's

    client.responses.delete(created.id)
    # Forgotten: the gateway answers 404 itself, and a continuation is refused as unseen.
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(created.id)
    assert gone.value.code == "response_not_found"
    with pytest.raises(openai.BadRequestError) as unseen:
        client.responses.create(model=_model(), input="and then?",
                                previous_response_id=created.id)
    assert unseen.value.code == "previous_response_not_found"


def test_a_response_gone_upstream_is_forgotten(gateway: GatewayServer, mock_upstream: MockUpstream,
                                              make_tenant: MakeTenant, plan: str) -> None:
    t = make_tenant(plan=plan)
    client = client_for(gateway, t.plaintext)
    created = client.responses.create(model=_model(), input="soon gone")
    # Deleted at the provider behind the gateway's back (as when it expires there).
    assert httpx.delete(f"{mock_upstream.base_url}/responses/{created.id}", timeout=5,
                        headers={"Authorization": f"Bearer {SHARED_PROVIDER_SECRET}"}
                        ).status_code == 200
    with pytest.raises(openai.NotFoundError) as upstream_404:
        client.responses.retrieve(created.id)
    assert upstream_404.value.code != "response_not_found"  # the upstream's 404, passed on
    with pytest.raises(openai.NotFoundError) as forgotten:
        client.responses.retrieve(created.id)
    assert forgotten.value.code == "response_not_found"  # the gateway's own, nothing sent
    with pytest.raises(openai.BadRequestError) as unseen:
        client.responses.create(model=_model(), input="more", previous_response_id=created.id)
    assert unseen.value.code == "previous_response_not_found"


def test_another_tenants_response_is_not_found_and_never_asked_upstream(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        plan: str) -> None:
    owner, stranger = make_tenant(plan=plan), make_tenant(plan=plan)
    created = client_for(gateway, owner.plaintext).responses.create(model=_model(),
                                                                    input="a private answer")
    other = client_for(gateway, stranger.plaintext)
    before = _upstream_requests(mock_upstream)
    with pytest.raises(openai.NotFoundError) as found:
        other.responses.retrieve(created.id)
    assert found.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(created.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(created.id)
    with pytest.raises(openai.NotFoundError):  # an id no Redis key may hold: not found either
        other.responses.retrieve("resp_" + "x" * 200)
    assert _upstream_requests(mock_upstream) == before
    # The owner still has it: the stranger's delete did nothing.
    assert client_for(gateway, owner.plaintext).responses.retrieve(created.id).id == created.id
    assert _upstream_requests(mock_upstream) == before + 1


def test_a_previous_response_chain_holds_for_the_earlier_turns(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        engine: QuotaEngine, django_db_blocker: Any, plan: str) -> None:
    t = make_tenant(plan=plan)
    client = client_for(gateway, t.plaintext)
    model = _model()
    turns = ["start a story about a bridge", "go on", "now finish it"]
    previous: str | None = None
    request_ids: list[str] = []
    expected_inputs: list[int] = []
    context = 0
    for text in turns:
        options: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        raw = client.responses.with_raw_response.create(model=model, input=text, **options)
        response = raw.parse()
        request_ids.append(raw.headers["x-request-id"])
        # The mock re-sends every earlier turn (input and output) as input.
        expected_inputs.append(context + len(text.split()))
        assert response.usage.input_tokens == expected_inputs[-1]
        context = response.usage.input_tokens + response.usage.output_tokens
        previous = response.id

    rows = _rows(django_db_blocker, engine, t, len(turns))
    for request_id, expected in zip(request_ids, expected_inputs):
        row = rows[request_id]
        assert (row.input_tokens, row.output_tokens) == (expected, OUTPUT)
        assert row.over_hold_tokens == 0  # the hold covered the earlier turns
    billed_in, billed_out, billed_requests = _billed(mock_upstream, model)
    assert (billed_in, billed_out, billed_requests) == (sum(expected_inputs), OUTPUT * 3, 3)
    assert _pending(engine, t) == 0


def test_an_unseen_previous_response_is_refused_before_any_hold(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        engine: QuotaEngine, plan: str) -> None:
    t = make_tenant(plan=plan)
    model = _model()
    with pytest.raises(openai.BadRequestError) as refused:
        client_for(gateway, t.plaintext).responses.create(
            model=model, input="continue", previous_response_id="resp_made_elsewhere")
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"
    assert _pending(engine, t) == 0
    assert engine.counter(t.tag, "tenant", WindowKind.DAY).used == 0
    assert usage_events(engine, t.tag) == []
    assert _billed(mock_upstream, model) == (0, 0, 0)


def test_a_plan_allowance_admits_an_unseen_previous_response(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        engine: QuotaEngine, django_db_blocker: Any, plan: str, allowance_plan: str) -> None:
    from quotas.keys import response_key

    model = _model()
    for plan_name, admitted in ((plan, False), (allowance_plan, True)):
        t = make_tenant(plan=plan_name)
        client = client_for(gateway, t.plaintext)
        first = client.responses.with_raw_response.create(model=model, input="one two three")
        earlier = first.parse()
        # The gateway's memory of it is gone (as when it expires here); the upstream keeps it.
        assert engine.client.delete(response_key(t.tag, earlier.id)) == 1
        if not admitted:
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=model, input="go on",
                                        previous_response_id=earlier.id)
            assert refused.value.code == "previous_response_not_found"
            assert _pending(engine, t) == 0
            continue
        # The plan's allowance is held for the unseen turns instead.
        raw = client.responses.with_raw_response.create(model=model, input="go on",
                                                        previous_response_id=earlier.id)
        assert raw.parse().usage.input_tokens == 3 + OUTPUT + 2
        rows = _rows(django_db_blocker, engine, t, 2)
        row = rows[raw.headers["x-request-id"]]
        assert (row.input_tokens, row.output_tokens, row.over_hold_tokens) == (10, OUTPUT, 0)
        assert _pending(engine, t) == 0


def test_a_conversation_carries_its_items_into_two_turns(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        engine: QuotaEngine, django_db_blocker: Any, plan: str) -> None:
    t = make_tenant(plan=plan)
    client = client_for(gateway, t.plaintext)
    model = _model()
    items = [{"type": "message", "role": "user", "content": "we are planning a trip to Rome"}]
    conversation = client.conversations.create(items=items, metadata={"topic": "travel"})
    assert conversation.id
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "travel"}
    updated = client.conversations.update(conversation.id, metadata={"topic": "rome"})
    assert updated.metadata == {"topic": "rome"}

    request_ids: list[str] = []
    expected: list[int] = []
    context = 7  # the mock counts the items' words
    for text in ("what should we see", "and where should we eat"):
        raw = client.responses.with_raw_response.create(model=model, input=text,
                                                         conversation=conversation.id)
        response = raw.parse()
        request_ids.append(raw.headers["x-request-id"])
        expected.append(context + len(text.split()))
        assert response.usage.input_tokens == expected[-1]
        context = response.usage.input_tokens + response.usage.output_tokens

    rows = _rows(django_db_blocker, engine, t, 2)
    for request_id, want in zip(request_ids, expected):
        assert (rows[request_id].input_tokens, rows[request_id].over_hold_tokens) == (want, 0)
    assert _billed(mock_upstream, model)[0] == sum(expected)

    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError) as gone:
        client.conversations.retrieve(conversation.id)
    assert gone.value.code == "conversation_not_found"
    with pytest.raises(openai.BadRequestError) as unseen:
        client.responses.create(model=model, input="one more", conversation=conversation.id)
    assert unseen.value.code == "conversation_not_found"
    assert _pending(engine, t) == 0


def test_another_tenants_conversation_is_not_found(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant,
        plan: str) -> None:
    owner, stranger = make_tenant(plan=plan), make_tenant(plan=plan)
    conversation = client_for(gateway, owner.plaintext).conversations.create()
    other = client_for(gateway, stranger.plaintext)
    before = _upstream_requests(mock_upstream)
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        other.conversations.delete(conversation.id)
    with pytest.raises(openai.BadRequestError) as unseen:
        other.responses.create(model=_model(), input="hi", conversation=conversation.id)
    assert unseen.value.code == "conversation_not_found"
    assert _upstream_requests(mock_upstream) == before


def test_stored_object_paths_answer_json_errors(gateway: GatewayServer,
                                                make_tenant: MakeTenant, plan: str) -> None:
    t = make_tenant(plan=plan)
    auth = {"Authorization": f"Bearer {t.plaintext}"}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        unauthenticated = http.get("/v1/responses/resp_abc")
        assert unauthenticated.status_code == 401
        assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
        wrong = http.put("/v1/responses/resp_abc", headers=auth)
        assert (wrong.status_code, wrong.headers["Allow"]) == (405, "DELETE, GET")
        unknown = http.get("/v1/responses/resp_abc/nope", headers=auth)
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "unknown_url")
        items = http.get("/v1/conversations/conv_abc/items", headers=auth)
        assert (items.status_code, items.json()["error"]["code"]) == (404, "unsupported_endpoint")
        bad = http.post("/v1/conversations", headers=auth, json={"items": "not a list"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "items")
