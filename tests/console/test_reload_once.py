"""A browser reload of a page that shows a secret re-sends its form. Issue key, rotate key,
issue a management token and add a webhook must act once; the repeat is refused with a message
and shows no secret."""

from __future__ import annotations

import re

from django.test import Client
from django.urls import reverse

from billing.models import WebhookEndpoint
from tenants.models import ApiKey, ApiKeySecret, ManagementToken
from tests.world import World


def _owner(world: World) -> Client:
    client = Client()
    client.force_login(world.owner)
    return client


def _form_id(html: str, form_marker: str) -> str:
    form = html[html.index(form_marker):]
    return re.search(r'name="form_id" value="([^"]+)"', form).group(1)


def test_reloading_the_issued_key_page_does_not_issue_again(world: World) -> None:
    client = _owner(world)
    t = world.acme.public_id
    page = client.get(reverse("console-projects", args=[t])).content.decode()
    form_id = _form_id(page, "console-key-issue" if "console-key-issue" in page else "issue-key")
    url = reverse("console-key-issue", args=[t, world.web.public_id])
    data = {f"{world.web.public_id}-name": "reloaded", "form_id": form_id}
    before = ApiKey.objects.count()
    first = client.post(url, data)
    assert first.status_code == 200 and 'id="new-key"' in first.content.decode()
    again = client.post(url, data, follow=True)
    assert ApiKey.objects.count() == before + 1
    html = again.content.decode()
    assert "already submitted" in html and 'id="new-key"' not in html


def test_reloading_the_rotated_key_page_does_not_rotate_again(world: World) -> None:
    client = _owner(world)
    api_key = world.issued.api_key
    key_url = reverse("console-key", args=[world.acme.public_id, api_key.public_id])
    form_id = _form_id(client.get(key_url).content.decode(), 'id="rotate-key"')
    url = reverse("console-key-rotate", args=[world.acme.public_id, api_key.public_id])
    data = {"grace_seconds": "0", "form_id": form_id}
    first = client.post(url, data)
    assert 'id="new-key"' in first.content.decode()
    secrets_after_first = ApiKeySecret.objects.filter(api_key=api_key).count()
    again = client.post(url, data, follow=True)
    assert ApiKeySecret.objects.filter(api_key=api_key).count() == secrets_after_first
    assert "already submitted" in again.content.decode()
    # The secret shown by the first rotation is the one that works.
    assert ApiKeySecret.objects.filter(api_key=api_key, revoked_at__isnull=True).count() == 1


def test_reloading_token_and_webhook_creation_acts_once(world: World, settings) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    client = _owner(world)
    t = world.acme.public_id
    tokens_url = reverse("console-tokens", args=[t])
    form_id = _form_id(client.get(tokens_url).content.decode(), 'id="new-token"')
    for _ in range(2):
        client.post(tokens_url, {"name": "deploy", "form_id": form_id})
    assert ManagementToken.objects.filter(tenant=world.acme, name="deploy").count() == 1

    hooks_url = reverse("console-webhooks", args=[t])
    form_id = _form_id(client.get(hooks_url).content.decode(), "Add an endpoint")
    data = {"url": "http://127.0.0.1:9/hook", "events": ["quota.threshold"], "form_id": form_id}
    for _ in range(2):
        client.post(hooks_url, data)
    assert WebhookEndpoint.objects.filter(tenant=world.acme).count() == 1
