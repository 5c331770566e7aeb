"""Console pages for cost reports and webhooks: who sees what, forms that write nothing on bad
input, and a webhook signing secret shown exactly once."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from standardwebhooks import Webhook

from billing.models import WebhookDelivery, WebhookEndpoint
from billing.webhooks import create_endpoint, send_test_event
from gateway.crypto import encrypt_secret
from tenants.models import AuditEvent
from tests.support.celery_queue import run_queued_deliveries
from tests.support.webhook_receiver import Receiver
from tests.world import World


def _client(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


# -- reports ------------------------------------------------------------------------------------


def _reports(world: World) -> str:
    return reverse("console-reports", args=[world.acme.public_id])


def test_reports_page_links_the_current_cycle_windows_csv_and_the_link_downloads(
        world: World) -> None:
    client = _client(world.owner)
    html = client.get(_reports(world)).content.decode()
    # Acme is on the standard plan: its cycle is the calendar month (UTC), whose window id is
    # "m" and the month. The picker offers its cycle windows since the tenant was created (one:
    # it was created just now).
    month = datetime.now(UTC).strftime("%Y-%m")
    csv_link = re.search(r'<a [^>]*href="([^"]+)"[^>]*>Download CSV</a>', html).group(1)
    assert csv_link == f"/api/tenants/{world.acme.public_id}/reports/m{month}.csv"
    assert f"/reports/m{month}.xlsx" in html
    select = html[html.index('id="report-period"'):]
    assert '<label for="report-period">' in html
    options = select[:select.index("</select>")]
    assert options.count("<option") == 1
    assert f'value="m{month}" selected>{month}-01 – ' in options and "(UTC)" in options
    download = client.get(csv_link)  # the session is enough
    assert download.status_code == 200 and download["Content-Type"].startswith("text/csv")


def test_reports_page_for_another_month_and_a_bad_month(world: World) -> None:
    client = _client(world.owner)
    html = client.get(_reports(world), {"month": "2025-02"}).content.decode()
    assert "/reports/2025-02.csv" in html and "Report for 2025-02-01 – 2025-02-28 (UTC)" in html
    bad = client.get(_reports(world), {"month": "2025-13"})
    assert bad.status_code == 400 and "YYYY-MM" in bad.content.decode()


def test_member_sees_no_download_links(world: World) -> None:
    response = _client(world.member).get(_reports(world))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Download CSV" not in html and "owners and admins" in html


@pytest.mark.parametrize("who, status", [("outsider", 404), ("operator", 200)])
def test_reports_page_isolation(world: World, who: str, status: int) -> None:
    assert _client(getattr(world, who)).get(_reports(world)).status_code == status


# -- webhooks -----------------------------------------------------------------------------------

@pytest.fixture
def receiver(settings: Any) -> Iterator[Receiver]:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on 127.0.0.1
    with Receiver() as r:
        yield r


def _hooks(world: World) -> str:
    return reverse("console-webhooks", args=[world.acme.public_id])


def _hook(world: World, endpoint: WebhookEndpoint, name: str = "console-webhook-detail",
          *extra: str) -> str:
    return reverse(name, args=[world.acme.public_id, endpoint.public_id, *extra])


def test_adding_an_endpoint_shows_its_secret_once(world: World, receiver: Receiver) -> None:
    client = _client(world.owner)
    page = client.get(_hooks(world)).content.decode()
    assert '<label for="id_url">' in page and 'value="quota.threshold"' in page
    response = client.post(_hooks(world), {"url": receiver.url,
                                           "events": ["quota.threshold", "test"]})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    html = response.content.decode()
    endpoint = WebhookEndpoint.objects.get(tenant=world.acme)
    secret = endpoint.secret
    box = html[html.index('class="card secret-once"'):]
    assert f'value="{secret}"' in box and 'data-copy="#webhook-secret"' in box
    assert "You will not see it again" in box
    assert endpoint.events == ["quota.threshold", "test"]
    # Never again: not on the list, the detail page, or the audit log.
    for url in (_hooks(world), _hook(world, endpoint)):
        assert secret not in client.get(url).content.decode()
    assert all(secret not in str(a.data) for a in AuditEvent.objects.all())


def _shown_secret(html: str) -> str:
    box = html[html.index('class="card secret-once"'):]
    return re.search(r'id="webhook-secret" value="([^"]+)"', box).group(1)


def test_the_secret_shown_is_in_the_standard_format_and_verifies_a_delivery(
        world: World, receiver: Receiver) -> None:
    client = _client(world.owner)
    html = client.post(_hooks(world), {"url": receiver.url,
                                       "events": ["quota.threshold"]}).content.decode()
    secret = _shown_secret(html)
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{43}=", secret)
    assert "standardwebhooks" in html and "webhook-signature" in html
    endpoint = WebhookEndpoint.objects.get(tenant=world.acme)
    send_test_event(endpoint)
    [request] = receiver.requests
    assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"
    listing = client.get(_hooks(world)).content.decode()
    assert "deprecated: release 0.3.0 stops sending them" in listing


def test_rotating_the_secret_shows_the_new_one_once_and_keeps_the_old_one_for_the_grace(
        world: World, receiver: Receiver) -> None:
    endpoint, old = create_endpoint(world.acme, receiver.url, ["quota.threshold"], actor="test")
    client = _client(world.owner)
    page = client.get(_hook(world, endpoint)).content.decode()
    form = page[page.index('id="rotate-secret"'):]
    assert "Rotate secret" in form and '<option value="86400" selected>' in form
    form_id = re.search(r'name="form_id" value="([^"]+)"', form).group(1)
    rotate = _hook(world, endpoint, "console-webhook-rotate-secret")
    response = client.post(rotate, {"grace_seconds": "3600", "form_id": form_id})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    html = response.content.decode()
    new = _shown_secret(html)
    endpoint.refresh_from_db()
    assert new != old and endpoint.secret == new and "Signing secret rotated" in html
    assert "The previous secret also signs every delivery until" in html
    # A reload sends the same form again: nothing rotates, and the secret is not shown again.
    again = client.post(rotate, {"grace_seconds": "3600", "form_id": form_id}, follow=True)
    endpoint.refresh_from_db()
    assert endpoint.secret == new and new not in again.content.decode()
    assert "already submitted" in again.content.decode()
    detail = client.get(_hook(world, endpoint)).content.decode()
    assert "rotating" in detail and new not in detail and old not in detail
    assert AuditEvent.objects.filter(action="webhook.secret_rotated").count() == 1
    assert all(new not in str(a.data) and old not in str(a.data)
               for a in AuditEvent.objects.all())
    # Both secrets verify a delivery while the grace period lasts.
    send_test_event(endpoint)
    [request] = receiver.requests
    for secret in (old, new):
        assert Webhook(secret).verify(request["body"], request["headers"])["type"] == "test"


def test_rotating_a_secret_that_cannot_sign_says_the_old_one_is_not_kept(
        world: World, receiver: Receiver) -> None:
    endpoint = WebhookEndpoint.objects.create(
        tenant=world.acme, url=receiver.url, events=["test"],
        secret_encrypted=encrypt_secret("whsec_not*base64"))  # a row written by hand
    response = _client(world.owner).post(_hook(world, endpoint, "console-webhook-rotate-secret"),
                                         {"grace_seconds": "86400"})
    assert response.status_code == 200
    html = response.content.decode()
    new = _shown_secret(html)
    assert ("The previous secret was not kept for the grace period: it cannot sign: a webhook "
            "secret is whsec_ followed by base64. It signed nothing") in " ".join(html.split())
    assert "also signs every delivery until" not in html
    endpoint.refresh_from_db()
    assert endpoint.secret == new and endpoint.previous_secret_encrypted == ""
    detail = _client(world.owner).get(_hook(world, endpoint)).content.decode()
    assert "rotating" not in detail
    send_test_event(endpoint)
    [request] = receiver.requests
    assert Webhook(new).verify(request["body"], request["headers"])["type"] == "test"


def test_a_bad_grace_is_a_form_error_and_rotates_nothing(world: World,
                                                         receiver: Receiver) -> None:
    endpoint, secret = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    response = _client(world.owner).post(_hook(world, endpoint, "console-webhook-rotate-secret"),
                                         {"grace_seconds": "99"})
    assert response.status_code == 400 and "secret-once" not in response.content.decode()
    assert "Select a valid choice" in response.content.decode()
    endpoint.refresh_from_db()
    assert endpoint.secret == secret
    assert not AuditEvent.objects.filter(action="webhook.secret_rotated").exists()


def test_refused_url_writes_nothing_and_says_why(world: World, settings: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    audits = AuditEvent.objects.count()
    client = _client(world.owner)
    response = client.post(_hooks(world), {"url": "http://127.0.0.1:8000/x",
                                           "events": ["quota.threshold"]})
    assert response.status_code == 400
    assert "is not a public address" in response.content.decode()
    bad = client.post(_hooks(world), {"url": "https://example.com/x", "events": ["nope"]})
    assert bad.status_code == 400 and "secret-once" not in bad.content.decode()
    assert not WebhookEndpoint.objects.exists() and AuditEvent.objects.count() == audits


def test_detail_page_toggle_events_test_and_redeliver(world: World, receiver: Receiver,
                                                     django_capture_on_commit_callbacks: Any,
                                                     ) -> None:
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["quota.threshold"], actor="test")
    client = _client(world.owner)
    html = client.get(_hook(world, endpoint)).content.decode()
    assert "Send test event" in html and "Disable" in html and "Nothing delivered" in html

    # Queued, not sent inside the request: the page shows it pending.
    with django_capture_on_commit_callbacks(execute=True) as queued:
        client.post(_hook(world, endpoint, "console-webhook-test"))
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    assert len(queued) == 1 and delivery.status == "pending" and delivery.attempts == 0
    assert receiver.requests == []
    html = client.get(_hook(world, endpoint)).content.decode()
    assert f"Test event queued as delivery {delivery.public_id}" in html
    row = html[html.index(f'data-delivery="{delivery.public_id}"'):]
    assert "Pending" in row and "queued" in row
    # A worker sends it; the page shows the result.
    assert run_queued_deliveries({delivery.pk}) == ["delivered"]
    assert len(receiver.requests) == 1
    html = client.get(_hook(world, endpoint)).content.decode()
    row = html[html.index(f'data-delivery="{delivery.public_id}"'):]
    assert "Delivered" in row and '<td class="num">1</td>' in row and "Redeliver" in row
    assert all(f"<th scope=\"col\"{c}" in html for c in ("", ' class="num"'))

    with django_capture_on_commit_callbacks(execute=True):
        client.post(_hook(world, endpoint, "console-webhook-redeliver", delivery.public_id))
    delivery.refresh_from_db()
    assert delivery.status == "pending" and len(receiver.requests) == 1
    assert run_queued_deliveries({delivery.pk}) == ["delivered"]
    delivery.refresh_from_db()
    assert delivery.attempts == 2 and len(receiver.requests) == 2

    client.post(_hook(world, endpoint, "console-webhook-toggle"))
    endpoint.refresh_from_db()
    assert endpoint.enabled is False
    client.post(_hook(world, endpoint), {"events": ["quota.exhausted"]})
    endpoint.refresh_from_db()
    assert endpoint.events == ["quota.exhausted"]
    assert AuditEvent.objects.filter(action="webhook.updated", target=endpoint.public_id).count() == 2


def test_delete_asks_first(world: World, receiver: Receiver) -> None:
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    client = _client(world.owner)
    confirm = client.get(_hook(world, endpoint, "console-webhook-delete")).content.decode()
    assert "data-confirm=" in confirm and "cannot be undone" in confirm
    assert WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    response = client.post(_hook(world, endpoint, "console-webhook-delete"))
    assert response.status_code == 302 and not WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()


def test_member_reads_only(world: World, receiver: Receiver) -> None:
    endpoint, _ = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_type="test", payload={})
    client = _client(world.member)
    listing = client.get(_hooks(world)).content.decode()
    # A member sees the endpoint, not its URL (it can carry the receiver's token).
    assert endpoint.public_id in listing and "Add endpoint" not in listing
    assert receiver.url not in listing and "http://…/…" in listing
    detail = client.get(_hook(world, endpoint)).content.decode()
    assert receiver.url not in detail and "http://…/…" in detail
    assert "Send test event" not in detail and "Redeliver" not in detail
    assert delivery.public_id in detail
    assert client.post(_hooks(world), {"url": receiver.url, "events": ["test"]}).status_code == 403
    assert "Rotate secret" not in detail
    for name, extra in (("console-webhook-test", ()), ("console-webhook-toggle", ()),
                        ("console-webhook-delete", ()), ("console-webhook-rotate-secret", ()),
                        ("console-webhook-redeliver", (delivery.public_id,))):
        assert client.post(_hook(world, endpoint, name, *extra)).status_code == 403
    assert client.post(_hook(world, endpoint), {"events": []}).status_code == 403
    endpoint.refresh_from_db()
    assert endpoint.enabled and endpoint.events == ["test"] and receiver.requests == []
    assert WebhookEndpoint.objects.count() == 1


def test_outsider_and_foreign_ids_are_404(world: World, receiver: Receiver) -> None:
    mine, _ = create_endpoint(world.acme, receiver.url, ["test"], actor="test")
    theirs, _ = create_endpoint(world.globex, receiver.url, ["test"], actor="test")
    foreign = WebhookDelivery.objects.create(endpoint=theirs, event_type="test", payload={})
    outsider = _client(world.outsider)
    assert outsider.get(_hooks(world)).status_code == 404
    assert outsider.get(_hook(world, mine)).status_code == 404
    assert outsider.post(_hook(world, mine, "console-webhook-delete")).status_code == 404
    owner = _client(world.owner)
    assert owner.get(_hook(world, theirs)).status_code == 404
    assert owner.post(_hook(world, theirs, "console-webhook-test")).status_code == 404
    assert owner.post(_hook(world, mine, "console-webhook-redeliver",
                            foreign.public_id)).status_code == 404
    assert WebhookEndpoint.objects.count() == 2 and receiver.requests == []
