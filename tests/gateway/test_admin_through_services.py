"""Django admin's catalog and provider key writes go through the services of gateway/prices.py and
gateway/providers.py: the same audit events and invalidations as provider_add and the service
calls, for saves and deletes alike (a plain ModelAdmin delete would tell no gateway)."""
from __future__ import annotations

import os
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from gateway.models import ModelAlias, ModelSpec, ProviderKey
from gateway.prices import save_alias
from tenants.models import AuditEvent

pytestmark = pytest.mark.django_db

SECRET = "sk-admin-path-secret-1234"


@pytest.fixture
def root() -> Client:
    user = get_user_model().objects.create_superuser("root", "", "pw-123-secret")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr("tenants.invalidation._publish_now",
                        lambda kind, ident: sent.append((kind, ident)))
    return sent


def changes(published: list[tuple[str, Any]], capture: Any, run: Any) -> tuple[list[Any], list]:
    """The audit events (action, actor, data) and the invalidations of one change."""
    last = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    published.clear()
    with capture(execute=True):
        response = run()
    if hasattr(response, "status_code"):  # an admin request, not a service call
        assert response.status_code == 302, response.content[:2000]
    events = list(AuditEvent.objects.filter(id__gt=last).order_by("id")
                  .values_list("action", "actor", "data"))
    return events, list(published)


def test_adding_a_provider_key_in_admin_is_provider_add(
    root: Client, published: list, django_capture_on_commit_callbacks: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADMIN_PATH_SECRET", SECRET)
    by_cli = changes(published, django_capture_on_commit_callbacks, lambda: call_command(
        "provider_add", "upstream-a", "--base-url", "https://api.example.test/v1/",
        "--secret-env", "ADMIN_PATH_SECRET", "--models", "gpt-4o", stdout=StringIO()))
    by_admin = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        "/admin/gateway/providerkey/add/", {
            "name": "upstream-a", "kind": "openai", "base_url": "https://api.example.test/v1/",
            "models": '["gpt-4o"]', "rpm_capacity": "", "tpm_capacity": "", "priority": "0",
            "enabled": "on", "tenant": "", "secret": SECRET}))
    assert [(a, d) for a, _, d in by_admin[0]] == [(a, d) for a, _, d in by_cli[0]]
    assert by_admin[0][0][:2] == ("provider_key.create", "user:root")
    assert by_admin[1] == by_cli[1] == [("providers", None)]
    assert os.environ["ADMIN_PATH_SECRET"] not in str(by_admin[0])


def test_deleting_a_provider_key_in_admin_is_audited_and_reloads_every_pool(
    root: Client, published: list, django_capture_on_commit_callbacks: Any,
) -> None:
    from gateway.providers import create_provider_key

    key = create_provider_key("doomed", base_url="https://api.example.test/v1", secret=SECRET)
    events, sent = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        f"/admin/gateway/providerkey/{key.pk}/delete/", {"post": "yes"}))
    assert [(a, actor) for a, actor, _ in events] == [("provider_key.delete", "user:root")]
    assert sent == [("providers", key.pk)]
    assert not ProviderKey.objects.filter(pk=key.pk).exists()


def test_catalog_models_and_aliases_in_admin_are_audited_and_published(
    root: Client, published: list, django_capture_on_commit_callbacks: Any,
) -> None:
    spec = ModelSpec.objects.get(name="gpt-4o")
    form = {"name": spec.name, "tokenizer": spec.tokenizer, "kind": spec.kind,
            "context_window": spec.context_window, "default_output_tokens": 1024,
            "max_output_tokens": spec.max_output_tokens,
            "input_price_micros_per_mtok": spec.input_price_micros_per_mtok,
            "output_price_micros_per_mtok": spec.output_price_micros_per_mtok, "enabled": "on"}
    # The form shows the token-class prices too (issue 13): sent back as the admin shows them.
    for name in ("cached_input_micros_per_mtok", "cache_write_micros_per_mtok",
                 "reasoning_micros_per_mtok"):
        value = getattr(spec, name)
        form[name] = "" if value is None else value
    events, sent = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        f"/admin/gateway/modelspec/{spec.pk}/change/", form))
    assert events == [("model.update", "user:root", {"fields": ["default_output_tokens"]})]
    assert sent == [("catalog", None)]

    # The same alias added by a service call and by admin: the same event, the same message.
    by_service = changes(published, django_capture_on_commit_callbacks, lambda: save_alias(
        ModelAlias(alias="gpt-4o-snapshot-a", model=spec), actor="user:root"))
    by_admin = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        "/admin/gateway/modelalias/add/", {"alias": "gpt-4o-snapshot-b", "model": spec.pk}))
    assert by_admin == by_service
    alias = ModelAlias.objects.get(alias="gpt-4o-snapshot-b")
    events, sent = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        "/admin/gateway/modelalias/", {"action": "delete_selected", "post": "yes",
                                       "_selected_action": [alias.pk]}))
    assert events == [("model_alias.delete", "user:root", {"model": "gpt-4o"})]
    assert sent == [("catalog", None)]

    spare = ModelSpec.objects.create(
        name="spare-model", tokenizer=spec.tokenizer, kind=spec.kind, context_window=8192,
        default_output_tokens=1024, max_output_tokens=4096, input_price_micros_per_mtok=1,
        output_price_micros_per_mtok=1)
    events, sent = changes(published, django_capture_on_commit_callbacks, lambda: root.post(
        f"/admin/gateway/modelspec/{spare.pk}/delete/", {"post": "yes"}))
    assert [(a, d) for a, _, d in events] == [("model.delete", {"aliases": []})]
    assert sent == [("catalog", None)]
