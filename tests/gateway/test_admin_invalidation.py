"""Edits in Django admin reach the gateways' in-process caches (pub/sub invalidation)."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from gateway.models import ModelSpec
from quotas.keys import INVALIDATION_CHANNEL
from quotas.runtime import get_engine
from tenants.models import Plan
from tenants.services import create_project, create_tenant, issue_key

pytestmark = pytest.mark.django_db(transaction=False)


def received(pubsub) -> list[dict]:
    messages, deadline = [], time.monotonic() + 2
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            body = json.loads(message["data"])
            body.pop("v")  # the message's number (quotas/invalidation.py)
            messages.append(body)
    return messages


@pytest.fixture
def admin_client() -> Client:
    user = get_user_model().objects.create_superuser("root", "", "pw-123-secret")
    client = Client()
    client.force_login(user)
    return client


def test_admin_edits_publish_invalidations(admin_client: Client, django_capture_on_commit_callbacks) -> None:
    tenant = create_tenant("acme", plan_name="free", actor="test")
    project = create_project(tenant, "web", actor="test")
    api_key = issue_key(project, actor="test").api_key
    spec = ModelSpec.objects.get(name="gpt-4o")
    pubsub = get_engine().client.pubsub()
    pubsub.subscribe(INVALIDATION_CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation

    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"/admin/gateway/modelspec/{spec.pk}/change/", {
            "name": "gpt-4o", "tokenizer": spec.tokenizer, "kind": spec.kind,
            "context_window": spec.context_window, "default_output_tokens": 2048,
            "max_output_tokens": spec.max_output_tokens,
            "input_price_micros_per_mtok": spec.input_price_micros_per_mtok,
            "output_price_micros_per_mtok": spec.output_price_micros_per_mtok, "enabled": "on"})
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"/admin/tenants/project/{project.pk}/change/", {
            "tenant": tenant.pk, "slug": "web", "name": "web", "tokens_per_day": 1000})
    with django_capture_on_commit_callbacks(execute=True):
        secret = api_key.secrets.get()
        response = admin_client.post(f"/admin/tenants/apikey/{api_key.pk}/change/", {
            "name": "ci", "tokens_per_day": 500, "max_concurrency": 3, "allowed_models": "[]",
            "secrets-TOTAL_FORMS": "1", "secrets-INITIAL_FORMS": "1",
            "secrets-MIN_NUM_FORMS": "0", "secrets-MAX_NUM_FORMS": "1000",
            "secrets-0-id": secret.pk, "secrets-0-api_key": api_key.pk})
        assert response.status_code == 302, response.content[:2000]
    assert ModelSpec.objects.get(pk=spec.pk).default_output_tokens == 2048
    api_key.refresh_from_db()
    assert (api_key.tokens_per_day, api_key.max_concurrency) == (500, 3)
    messages = received(pubsub)
    assert {"kind": "catalog", "id": None} in messages
    assert {"kind": "tenant", "id": tenant.pk} in messages
    assert {"kind": "api_key", "id": api_key.pk} in messages
    pubsub.close()


def test_plan_edits_in_admin_are_published(admin_client: Client,
                                           django_capture_on_commit_callbacks: Any) -> None:
    plan = Plan.objects.get(name="free")
    pubsub = get_engine().client.pubsub()
    pubsub.subscribe(INVALIDATION_CHANNEL)
    pubsub.get_message(timeout=1)
    # A blank admin field posts "", not None (the plan's nullable pace fields).
    data = {field.name: "" if getattr(plan, field.name) is None else getattr(plan, field.name)
            for field in Plan._meta.fields if field.name not in ("id", "created_at", "updated_at")}
    data.update(tokens_per_day=600_000, allowed_models=json.dumps(plan.allowed_models))
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(f"/admin/tenants/plan/{plan.pk}/change/", data)
    assert response.status_code == 302, response.content[:1000]
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    pubsub.close()
    body = json.loads(message["data"])
    assert {"kind": body["kind"], "id": body["id"]} == {"kind": "plan", "id": plan.pk}
    assert isinstance(body["v"], int)
