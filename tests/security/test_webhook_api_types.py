"""Webhook create and update through the management API take the JSON types the schema states
(config/api/strict_types.py, as every other management API body): a string for `enabled`, a
number for `enabled`, a number for `url`, a non-string event, or a URL longer than 2,000
characters as sent, is a 400 naming the field that creates, changes and audits nothing. Before,
DRF coerced: `"enabled": "false"` or `0` quietly disabled an endpoint, and a URL padded with
spaces past the limit was trimmed and stored."""

from __future__ import annotations

from typing import Any

import pytest

from billing.models import WebhookEndpoint
from billing.webhooks import create_endpoint
from tenants.models import AuditEvent
from tests.world import World

URL = "http://127.0.0.1:9/hook"
# 2,000 characters once DRF trims the tab, 2,001 as sent.
PADDED_URL = "\t" + URL + "?p=" + "a" * (2000 - len(URL) - 3)


@pytest.fixture(autouse=True)
def _private_urls(settings: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the test URLs are on 127.0.0.1


def _base(world: World) -> str:
    return f"/api/tenants/{world.acme.public_id}/webhooks/"


def _state() -> tuple[list[tuple[str, str, list[str], bool]], int]:
    """Every endpoint's id, URL, events and enabled flag, and the number of audit events."""
    endpoints = [(e.public_id, e.url, list(e.events), e.enabled)
                 for e in WebhookEndpoint.objects.order_by("public_id")]
    return endpoints, AuditEvent.objects.count()


@pytest.mark.parametrize(("body", "field"), [
    ({"url": 8785914689034124330}, "url"),
    ({"url": PADDED_URL}, "url"),
    ({"url": URL, "events": ["quota.exhausted", 1]}, "events"),
    ({"url": URL, "events": [True]}, "events"),
])
def test_create_with_a_wrong_typed_field_is_a_400_that_creates_nothing(
        world: World, body: dict[str, Any], field: str) -> None:
    before = _state()
    response = world.client(world.owner).post(_base(world), body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert _state() == before
    assert not WebhookEndpoint.objects.filter(tenant=world.acme).exists()


@pytest.mark.parametrize(("body", "field"), [
    ({"enabled": "false"}, "enabled"),
    ({"enabled": 0}, "enabled"),
    ({"enabled": "off"}, "enabled"),
    ({"url": 42}, "url"),
    ({"url": PADDED_URL}, "url"),
    ({"events": ["quota.threshold", 2]}, "events"),
    # One wrong field spoils the whole body: the well-typed one is not applied either.
    ({"events": ["quota.threshold"], "enabled": 1}, "enabled"),
])
def test_update_with_a_wrong_typed_field_is_a_400_that_changes_nothing(
        world: World, body: dict[str, Any], field: str) -> None:
    endpoint, _ = create_endpoint(world.acme, URL, ["quota.exhausted"], actor="test")
    before = _state()
    response = world.client(world.owner).patch(f"{_base(world)}{endpoint.public_id}/", body,
                                                format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert _state() == before
    endpoint.refresh_from_db()
    assert (endpoint.url, endpoint.events, endpoint.enabled) == (URL, ["quota.exhausted"], True)


def test_well_typed_values_are_still_taken(world: World) -> None:
    """The strict check refuses only other types: the same fields with the schema's types work."""
    owner = world.client(world.owner)
    created = owner.post(_base(world), {"url": URL, "events": ["quota.threshold"]},
                         format="json")
    assert created.status_code == 201, created.content
    updated = owner.patch(f"{_base(world)}{created.json()['id']}/",
                          {"enabled": False, "events": ["quota.exhausted"]}, format="json")
    assert updated.status_code == 200, updated.content
    endpoint = WebhookEndpoint.objects.get(public_id=created.json()["id"])
    assert (endpoint.url, endpoint.events, endpoint.enabled) == (URL, ["quota.exhausted"], False)
