"""The management API keeps the contract its own OpenAPI schema states (issue 11, item 14).

Schemathesis generates requests from the schema (/api/schema/, as drf-spectacular builds it) for
every operation and sends them to the Django app in-process (WSGI), authenticated with a tenant
management token of full scope, with the fixture's real ids in the path so the operations run
rather than stop at a 404. Each response is checked for:
- no server error (5xx);
- status-code conformance: every status answered is documented for that operation;
- content-type conformance: the Content-Type answered is one the schema documents;
- response-schema conformance: the body validates against the documented schema;
- negative-data rejection: a request that violates the schema is refused with a 4xx.

Reproducible: Hypothesis is derandomized (a fixed seed per test), no example database, and a
modest number of examples per operation and mode (EXAMPLES, below), so the whole file runs in
well under the suite's budget. A wider run by hand: TOLLGATE_FUZZ_EXAMPLES=25 pytest this file
(and TOLLGATE_FUZZ_SEED=<n> for other examples than the suite's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from rest_framework.utils.encoders import JSONEncoder
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from billing.models import WebhookDelivery
from billing.webhooks import create_endpoint
from tenants.membership import invite_member
from tenants.services import issue_management_token
from tests.world import World

EXAMPLES = int(os.environ.get("TOLLGATE_FUZZ_EXAMPLES", "4"))
# Unset (the suite, CI): derandomized, the same examples every run. Set: another seed, by hand.
SEED = os.environ.get("TOLLGATE_FUZZ_SEED")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def _schema() -> Any:
    document = SchemaGenerator().get_schema(request=None, public=True)
    # A round trip through JSON, as a client downloading /api/schema/ would see it.
    loaded = schemathesis.openapi.from_dict(json.loads(json.dumps(document, cls=JSONEncoder)))
    loaded.app = WSGIHandler()
    return loaded


SCHEMA = _schema()
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


def test_every_operation_is_fuzzed() -> None:
    """The parametrisation below is the schema's whole list: nothing is left out."""
    assert len(OPERATIONS) == sum(
        1 for item in SCHEMA.raw_schema["paths"].values() for method in item
        if method in ("get", "post", "put", "patch", "delete"))
    assert len(OPERATIONS) > 40


@pytest.fixture
def wsgi_in_test_transaction() -> Iterator[None]:
    """The test's database transaction stays open across requests: as Django's own test client
    does, keep the WSGI handler from closing the connection at each request's end."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def fast_settings(settings: Any) -> None:
    # Argon2 for the world's four users in each of ~90 tests is slow and plays no part here;
    # the webhook points at a closed local port.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True


@pytest.fixture
def fuzz_world(fast_settings: None, world: World,
               wsgi_in_test_transaction: None) -> dict[str, Any]:
    """acme's real objects, one of each kind the API's paths name, and a full-scope token."""
    hook, _ = create_endpoint(world.acme, "http://127.0.0.1:9/hook", ["quota.threshold"],
                              actor="test")
    delivery = WebhookDelivery.objects.create(endpoint=hook, event_type="test",
                                              payload={"type": "test"})
    auth = issue_management_token(world.acme, name="fuzz", actor="test")
    target = issue_management_token(world.acme, name="to-revoke", actor="test")
    invitation = invite_member(world.acme, "fuzz@acme.test", role="member", actor="test",
                               accept_url=lambda secret: f"/console/invite/{secret}/").invitation
    path = {
        "tenant_id": world.acme.public_id, "project_id": world.web.public_id,
        "key_id": world.issued.api_key.public_id, "webhook_id": hook.public_id,
        "delivery_id": delivery.public_id, "token_id": target.token.public_id,
        "invitation_id": invitation.public_id, "member_id": "member", "name": "standard",
        "month": "2025-01", "fmt": "csv",
    }
    return {"headers": {"Authorization": f"Bearer {auth.plaintext}"}, "path": path}


def _run(operation: Any, mode: GenerationMode, fixed: dict[str, Any]) -> None:
    names = {p.name for p in operation.path_parameters}
    path = {name: value for name, value in fixed["path"].items() if name in names}
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path)
    if mode is GenerationMode.POSITIVE and names:
        # Sometimes the schema's own path values too: unknown ids must be a documented 404.
        strategy = st.one_of(strategy, operation.as_strategy(generation_mode=mode))

    @settings(max_examples=EXAMPLES, derandomize=SEED is None, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case: Any) -> None:
        case.call_and_validate(headers=fixed["headers"], checks=CHECKS)

    if SEED is not None:
        check = seed(int(SEED))(check)
    check()


CASES = [
    pytest.param(operation, mode, id=f"{name}-{operation.label}")
    for name, mode in (("positive", GenerationMode.POSITIVE),
                       ("negative", GenerationMode.NEGATIVE))
    for operation in OPERATIONS
]


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_operation_keeps_its_contract(fuzz_world: dict[str, Any], operation: Any,
                                      mode: GenerationMode) -> None:
    _run(operation, mode, fuzz_world)
