"""The console's main journey in Chromium, against a running system: log in, create a project,
issue a key and read it once, call /v1 with it through the openai SDK, see the dashboard's usage
change, find the key on the keys page (by project, by name, by status), rotate and revoke it
(each time the old secret gets a 401), download the month's CSV. Screenshots of the dashboard,
the projects page and the keys page at laptop and phone width."""
from __future__ import annotations

import csv
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
from playwright.sync_api import expect

from tests.browser.conftest import (
    LAPTOP,
    PHONE,
    Account,
    MakeAccount,
    check_layout,
    log_in,
    shoot,
)
from tests.gateway.conftest import GatewayServer, committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

PROMPT = [{"role": "user", "content": "hello from the console journey"}]


def chat(server: GatewayServer, key: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10)
    return client.chat.completions.create(model="gpt-4o", messages=PROMPT, max_tokens=20)


def refused_soon(server: GatewayServer, key: str, timeout: float = 5.0) -> int:
    """The key is refused with 401 once every gateway worker has heard of the change (pub/sub,
    well under a second); a success before that is the old cached state, not a bug. Returns
    how many calls still succeeded (they are billed like any other)."""
    deadline = time.monotonic() + timeout
    succeeded = 0
    while True:
        try:
            chat(server, key)
        except openai.AuthenticationError as exc:
            assert exc.status_code == 401
            return succeeded
        succeeded += 1
        assert time.monotonic() < deadline, "the old key still works"
        time.sleep(0.2)


def tenant_gauge_today(page: Any) -> int:
    used = page.locator(
        '.gauge-card[data-scope="tenant"] .gauge[data-window="day"] .label strong'
    ).first
    return int(used.inner_text().replace(",", ""))


def issue_key_from_page(page: Any, project_name: str, key_name: str) -> str:
    section = page.locator("section.card", has=page.get_by_role("heading", name=project_name))
    section.get_by_label("Key name").fill(key_name)
    section.get_by_role("button", name="Issue key").click()
    secret = page.locator("input#new-key")
    expect(secret).to_be_visible()
    expect(page.get_by_text("You will not see it again")).to_be_visible()
    plaintext = secret.input_value()
    assert plaintext.startswith("tgk_")
    return plaintext


def screenshots_and_layout(page: Any, url: str, name: str) -> None:
    for viewport in (LAPTOP, PHONE):
        page.set_viewport_size(viewport)
        page.goto(url)
        check_layout(page)
        shoot(page, name)
    page.set_viewport_size(LAPTOP)


def test_console_journey(
    new_page: Callable[..., Any], make_account: MakeAccount, console_server: GatewayServer,
    django_db_blocker: Any,
) -> None:
    owner: Account = make_account("owner", name="Journey Inc")
    base = f"/console/t/{owner.tenant_id}"
    page = new_page()
    log_in(page, owner)
    page.wait_for_url(f"**{base}/")
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    before = tenant_gauge_today(page)

    # A project, then a key shown once.
    page.goto(f"{base}/projects/")
    page.get_by_label("Slug").fill("journey")
    page.get_by_label("Name", exact=True).fill("Journey app")
    page.get_by_role("button", name="Create project").click()
    expect(page.get_by_text("Project Journey app created.")).to_be_visible()
    plaintext = issue_key_from_page(page, "Journey app", "browser")
    page.get_by_role("link", name="Key details").click()
    key_url = page.url
    expect(page.get_by_role("heading", name="Key browser")).to_be_visible()
    assert plaintext not in page.content()
    # The projects page counts the project's keys and links to them; the keys page lists
    # them masked, and finds one by name.
    page.goto(f"{base}/projects/")
    assert plaintext not in page.content()
    page.get_by_role("link", name="1 key").click()
    expect(page.get_by_role("heading", name="API keys")).to_be_visible()
    expect(page.get_by_role("link", name="browser")).to_be_visible()
    assert plaintext not in page.content()
    expect(page.locator("code", has_text=plaintext[:16])).to_be_visible()  # the masked form
    page.reload()
    assert plaintext not in page.content()
    page.goto(f"{base}/keys/")
    page.get_by_label("Search").fill("brow")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_role("link", name="browser")).to_be_visible()
    page.get_by_label("Search").fill("no-such-key")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_text("No keys match these filters.")).to_be_visible()

    # /v1 through the official SDK, then the dashboard's gauge moves.
    reply = chat(console_server, plaintext)
    assert reply.choices[0].message.content and reply.usage is not None
    deadline = time.monotonic() + 10
    while True:
        page.goto(f"{base}/")
        now_used = tenant_gauge_today(page)
        if now_used > before or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert now_used >= before + reply.usage.total_tokens, (before, now_used, reply.usage)

    screenshots_and_layout(page, f"{base}/", "dashboard")
    screenshots_and_layout(page, f"{base}/projects/", "projects")
    screenshots_and_layout(page, f"{base}/keys/", "keys")

    # Rotate, immediately: the old secret is refused, the new one works.
    page.goto(key_url)
    page.get_by_label("Old secret stops working").select_option(label="Immediately")
    page.get_by_role("button", name="Rotate key").click()
    rotated = page.locator("input#new-key").input_value()
    assert rotated.startswith("tgk_") and rotated != plaintext
    late_calls = refused_soon(console_server, plaintext)
    assert chat(console_server, rotated).usage is not None

    # Revoke (the form asks for a tick and a confirmation): the next call is refused.
    page.goto(key_url)
    page.get_by_role("link", name="Revoke key…").click()
    page.get_by_label("I understand").check()
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Revoke key").click()
    expect(page.get_by_text("Key browser revoked.")).to_be_visible()
    late_calls += refused_soon(console_server, rotated)
    # The keys page's status filter: revoked now, no longer active.
    page.goto(f"{base}/keys/")
    page.get_by_label("Status").select_option("revoked")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_role("link", name="browser")).to_be_visible()
    page.get_by_label("Status").select_option("active")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_text("No keys match these filters.")).to_be_visible()

    # The month's CSV has the calls. The ledger is drained every 5 s by Celery; here directly.
    from billing.ledger import drain_all
    from quotas.runtime import get_engine

    committed(django_db_blocker, lambda: drain_all(get_engine().client))
    page.goto(f"{base}/reports/")
    with page.expect_download() as download_info:
        page.get_by_role("link", name="Download CSV").click()
    download = download_info.value
    assert download.suggested_filename.endswith(".csv")
    rows = list(csv.DictReader(open(download.path(), newline="", encoding="utf-8")))
    calls = [row for row in rows if row["project"] == "journey"]
    assert calls, rows
    assert calls[0]["day"] == datetime.now(UTC).date().isoformat()
    # One before and one after the rotation (and any the gateway let through before it heard).
    assert sum(int(row["requests"]) for row in calls) == 2 + late_calls
    assert all(row["model"] == "gpt-4o" for row in calls)
