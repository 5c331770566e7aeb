"""Issue 11, items 11 and 13 (webhooks): the SSRF refusal says only "not a public address" (never
what an internal name resolves to) and refuses the IPv6 ranges that embed an IPv4 address; a
response carrying a webhook's signing secret is not cached; members see endpoints without their
URLs (API and console), owners and admins see them whole.

DNS answers are injected by replacing socket.getaddrinfo for one made-up name (fault injection:
the resolver answering what an attacker's zone would)."""
from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
from django.urls import reverse

from billing import webhooks
from billing.models import WebhookEndpoint
from billing.webhooks import WebhookUrlRefused, check_url, create_endpoint
from tenants.models import AuditEvent
from tests.world import World

HOST = "hooks.example.test"
REFUSAL = (f"the webhook URL's host '{HOST}' is not a public address "
           "(webhooks only go to public internet addresses)")


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch, settings: Any) -> Callable[[str | None], None]:
    """answer(address): HOST resolves to `address` (None: it does not resolve)."""
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = False
    real = socket.getaddrinfo
    current: list[str | None] = ["93.184.216.34"]

    def fake(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != HOST:
            return real(host, port, *args, **kwargs)
        if current[0] is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        family = socket.AF_INET6 if ":" in current[0] else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (current[0], port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)

    def answer(address: str | None) -> None:
        current[0] = address

    return answer


# -- item 11: the refusal's words and the embedded-IPv4 ranges -----------------------------------


@pytest.mark.parametrize("address", ["10.1.2.3", "127.0.0.1", "169.254.169.254", "fd00::5"])
def test_the_refusal_never_names_the_internal_answer(dns: Callable[[str | None], None],
                                                     address: str) -> None:
    dns(address)
    with pytest.raises(WebhookUrlRefused) as refused:
        check_url(f"https://{HOST}/hook")
    assert str(refused.value) == REFUSAL and address not in str(refused.value)


def test_a_name_that_does_not_resolve_is_refused_in_the_same_words(
        dns: Callable[[str | None], None]) -> None:
    """Otherwise the refusal would tell internal names (resolving privately) from unknown ones."""
    dns(None)
    with pytest.raises(WebhookUrlRefused) as refused:
        check_url(f"https://{HOST}/hook")
    assert str(refused.value) == REFUSAL


@pytest.mark.parametrize("address, what", [
    ("2002:a00:1::1", "6to4 embedding 10.0.0.1"),
    ("2002:7f00:1::1", "6to4 embedding 127.0.0.1"),
    ("2002:808:808::1", "6to4 embedding a public 8.8.8.8: the range is refused outright"),
    ("2001:0:a00:1::1", "Teredo (server 10.0.0.1)"),
    ("2001:0:808:808::1", "Teredo (server 8.8.8.8)"),
    ("64:ff9b::a00:1", "NAT64 well-known prefix embedding 10.0.0.1"),
    ("64:ff9b::808:808", "NAT64 well-known prefix embedding 8.8.8.8"),
    ("64:ff9b:1::a00:1", "NAT64 local-use prefix"),
    ("::ffff:10.0.0.1", "IPv4-mapped private"),
    ("::ffff:127.0.0.1", "IPv4-mapped loopback"),
    ("::ffff:169.254.169.254", "IPv4-mapped link-local (cloud metadata)"),
    ("::10.0.0.1", "IPv4-compatible"),
    ("::8.8.8.8", "IPv4-compatible, public inside"),
    ("::ffff:0:10.0.0.1", "IPv4-translated (SIIT)"),
])
def test_ipv6_ranges_embedding_ipv4_are_refused(dns: Callable[[str | None], None], address: str,
                                                what: str, world: World) -> None:
    dns(address)
    with pytest.raises(WebhookUrlRefused) as refused:
        check_url(f"https://{HOST}/hook")
    assert str(refused.value) == REFUSAL, what
    # And through the API: a field error in the same words, nothing written.
    response = world.client(world.owner).post(
        f"/api/tenants/{world.acme.public_id}/webhooks/", {"url": f"https://{HOST}/hook"},
        format="json")
    assert response.status_code == 400 and response.json() == {"url": [REFUSAL]}
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize("address", ["93.184.216.34", "::ffff:93.184.216.34", "2606:4700::1111"])
def test_public_addresses_are_still_accepted(dns: Callable[[str | None], None],
                                             address: str) -> None:
    dns(address)
    check_url(f"https://{HOST}/hook")


@pytest.mark.django_db
def test_a_refusal_at_delivery_time_shows_the_tenant_no_address(
        dns: Callable[[str | None], None], world: World) -> None:
    """The delivery log (console and API) is the tenant's: it says the same words."""
    endpoint, _ = create_endpoint(world.acme, f"https://{HOST}/hook", ["test"], actor="test")
    dns("10.20.30.40")  # rebinding after the check
    delivery = webhooks.deliver(webhooks.create_test_event(endpoint).pk)
    assert delivery.last_error == f"refused: {REFUSAL}"
    base = f"/api/tenants/{world.acme.public_id}/webhooks/{endpoint.public_id}/"
    log = world.client(world.owner).get(f"{base}deliveries/").content.decode()
    page = world.client(world.owner).get(reverse(
        "console-webhook-detail", args=[world.acme.public_id, endpoint.public_id])).content.decode()
    for shown in (log, page):
        assert "10.20.30.40" not in shown and "is not a public address" in shown


def test_members_see_the_host_in_the_delivery_log_masked_owners_whole(
        dns: Callable[[str | None], None], world: World) -> None:
    """The refusal names the endpoint's host; members, who see the URL masked everywhere else,
    see the host masked the same way in the delivery log (API and console)."""
    endpoint, _ = create_endpoint(world.acme, f"https://{HOST}/hook", ["test"], actor="test")
    dns("10.20.30.40")
    delivery = webhooks.deliver(webhooks.create_test_event(endpoint).pk)
    assert delivery.last_error == f"refused: {REFUSAL}"
    masked = REFUSAL.replace(HOST, "…example.test")
    api = f"/api/tenants/{world.acme.public_id}/webhooks/{endpoint.public_id}/deliveries/"
    page = reverse("console-webhook-detail", args=[world.acme.public_id, endpoint.public_id])
    member, owner = world.client(world.member), world.client(world.owner)
    [seen] = member.get(api).json()["results"]
    assert seen["last_error"] == f"refused: {masked}"
    assert HOST not in member.get(api).content.decode()
    [whole] = owner.get(api).json()["results"]
    assert whole["last_error"] == f"refused: {REFUSAL}"

    def row(html: str) -> str:
        rest = html[html.index(f'data-delivery="{delivery.public_id}"'):]
        return rest[:rest.index("</tr>")]

    member_page = member.get(page).content.decode()
    assert HOST not in member_page
    assert "host &#x27;…example.test&#x27; is not a public address" in row(member_page)
    assert f"host &#x27;{HOST}&#x27; is not a public address" in row(
        owner.get(page).content.decode())


@pytest.mark.parametrize("url, error, shown", [
    ("https://a.b.example.com/x", "host 'a.b.example.com' refused", "host '…example.com' refused"),
    ("https://example.com/x", "host 'example.com' refused", "host 'example.com' refused"),
    ("https://93.184.216.34/x", "connect to 93.184.216.34 failed", "connect to … failed"),
])
def test_masked_error_cuts_the_host_as_masked_url_does(url: str, error: str,
                                                       shown: str) -> None:
    assert webhooks.masked_error(error, url) == shown


# -- item 13: no-store on secrets, URLs hidden from members -------------------------------------

SECRET_URL = "https://hooks.example.test/services/T000/B000/XXXXSECRETTOKEN"


def test_the_api_response_with_the_signing_secret_is_not_cached(
        dns: Callable[[str | None], None], world: World) -> None:
    response = world.client(world.owner).post(
        f"/api/tenants/{world.acme.public_id}/webhooks/", {"url": SECRET_URL}, format="json")
    assert response.status_code == 201 and response.json()["secret"].startswith("whsec_")
    assert response["Cache-Control"] == "no-store"


def test_the_console_page_with_the_signing_secret_is_not_cached(
        dns: Callable[[str | None], None], world: World) -> None:
    response = world.client(world.owner).post(
        reverse("console-webhooks", args=[world.acme.public_id]),
        {"url": SECRET_URL, "events": ["test"]})
    endpoint = WebhookEndpoint.objects.get(tenant=world.acme)
    assert response.status_code == 200 and endpoint.secret in response.content.decode()
    assert response["Cache-Control"] == "no-store"


def test_members_see_no_webhook_url_in_the_api_owners_do(
        dns: Callable[[str | None], None], world: World) -> None:
    endpoint, _ = create_endpoint(world.acme, SECRET_URL, ["test"], actor="test")
    listing = f"/api/tenants/{world.acme.public_id}/webhooks/"
    detail = f"{listing}{endpoint.public_id}/"
    member, owner = world.client(world.member), world.client(world.owner)
    for url in (listing, detail):
        seen = member.get(url)
        assert seen.status_code == 200 and "XXXXSECRETTOKEN" not in seen.content.decode()
    [row] = member.get(listing).json()["results"]
    assert row["url"] is None and row["url_masked"] == "https://…example.test/…"
    assert member.get(detail).json()["url"] is None
    assert owner.get(listing).json()["results"][0]["url"] == SECRET_URL
    assert owner.get(detail).json()["url"] == SECRET_URL
    # The audit trail, which members read, names the endpoint's masked URL only.
    audit = member.get(f"/api/tenants/{world.acme.public_id}/audit-events/")
    assert audit.status_code == 200 and "XXXXSECRETTOKEN" not in audit.content.decode()
    assert AuditEvent.objects.get(action="webhook.created").data["url"] == (
        "https://…example.test/…")


def test_members_see_no_webhook_url_in_the_console_owners_do(
        dns: Callable[[str | None], None], world: World) -> None:
    endpoint, _ = create_endpoint(world.acme, SECRET_URL, ["test"], actor="test")
    pages = [reverse("console-webhooks", args=[world.acme.public_id]),
             reverse("console-webhook-detail", args=[world.acme.public_id, endpoint.public_id]),
             reverse("console-audit", args=[world.acme.public_id])]
    member, owner = world.client(world.member), world.client(world.owner)
    for page in pages:
        html = member.get(page).content.decode()
        assert "XXXXSECRETTOKEN" not in html and "hooks.example.test/services" not in html
    for page in pages[:2]:
        html = member.get(page).content.decode()
        assert endpoint.public_id in html and "https://…example.test/…" in html
        assert SECRET_URL in owner.get(page).content.decode()
