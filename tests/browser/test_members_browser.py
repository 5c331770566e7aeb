"""The console's members page in Chromium: invite an admin, who accepts in a second browser
context; a member sees no write forms; a user in two tenants switches between them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import LAPTOP, PHONE, MakeAccount, check_layout, log_in, shoot

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

NEW_PASSWORD = "an invited admin's passphrase 3"


def test_invite_an_admin_who_accepts_in_another_browser(
    new_page: Callable[..., Any], make_account: MakeAccount
) -> None:
    owner = make_account("owner")
    page = new_page()
    log_in(page, owner)
    page.goto(f"/console/t/{owner.tenant_id}/members/")
    expect(page.get_by_role("heading", name="Members")).to_be_visible()
    check_layout(page)

    page.get_by_label("Email address").fill("new-admin@example.test")
    page.get_by_label("Role", exact=True).select_option("admin")
    page.get_by_role("button", name="Send invitation").click()
    link = page.locator("#invite-link").input_value()
    assert "/console/invite/" in link
    expect(page.get_by_text("You will not see it again")).to_be_visible()
    expect(page.get_by_role("button", name="Copy")).to_be_visible()
    check_layout(page)
    shoot(page, "members-invited")
    # Shown once: reloading (the browser sends the form again) neither shows the link nor
    # invites again; the members page lists the invitation, not the link.
    page.reload()
    expect(page.get_by_text("This form was sent already")).to_be_visible()
    expect(page.locator("#invite-link")).to_have_count(0)
    expect(page.get_by_role("cell", name="new-admin@example.test")).to_have_count(1)
    page.goto(f"/console/t/{owner.tenant_id}/members/")
    expect(page.get_by_role("cell", name="new-admin@example.test")).to_be_visible()
    assert link.rsplit("/", 2)[-2] not in page.content()

    # The invitee, logged out in a browser of their own, creates an account and joins.
    invitee = new_page(viewport=PHONE)
    invitee.goto(link)
    expect(invitee.get_by_role("heading", name=f"Join {owner.tenant_name}")).to_be_visible()
    check_layout(invitee)
    username = f"invited-{owner.username}"
    invitee.get_by_label("Username").fill(username)
    invitee.get_by_label("Password", exact=True).fill(NEW_PASSWORD)
    invitee.get_by_label("Password again").fill(NEW_PASSWORD)
    invitee.get_by_role("button", name="Create account and join").click()
    invitee.wait_for_url(f"**/console/t/{owner.tenant_id}/**")
    expect(invitee.get_by_text(f"Welcome to {owner.tenant_name}")).to_be_visible()
    invitee.goto(f"/console/t/{owner.tenant_id}/members/")
    expect(invitee.get_by_text(f"{username} (admin)")).to_be_visible()  # the frame's "who"
    expect(invitee.get_by_role("button", name="Send invitation")).to_be_visible()

    # The link is spent: another visitor gets a clear error and nothing happens.
    stranger = new_page()
    stranger.goto(link)
    expect(stranger.get_by_role("alert")).to_contain_text("used already")

    page.reload()
    expect(page.get_by_role("cell", name=username, exact=False)).to_be_visible()
    expect(page.get_by_text("No pending invitations.")).to_be_visible()


def test_a_member_sees_no_write_forms(
    new_page: Callable[..., Any], make_account: MakeAccount
) -> None:
    owner = make_account("owner")
    member = make_account("member", tenant=owner)
    page = new_page()
    log_in(page, member)
    page.goto(f"/console/t/{owner.tenant_id}/members/")
    expect(page.get_by_role("cell", name=owner.username, exact=True)).to_be_visible()
    # The page's own content has no forms and no buttons: only the frame (tenant switcher and
    # log out) has forms.
    assert page.locator("main form").count() == 0
    assert page.locator("main button").count() == 0
    for width in (LAPTOP, PHONE):
        page.set_viewport_size(width)
        check_layout(page)
    page.set_viewport_size(LAPTOP)
    # Every page of the console: nothing that would POST a change (a GET form, like the
    # reports' month picker, only reads).
    pages = page.locator("nav.sidenav a").evaluate_all("links => links.map(a => a.href)")
    assert len(pages) >= 5
    for url in pages:
        page.goto(url)
        assert page.locator("main form[method=post]").count() == 0, url
        expect(page.get_by_role("button", name="Create project")).to_have_count(0)


def test_first_login_after_make_up(
    new_page: Callable[..., Any], django_db_blocker: Any
) -> None:
    """`make up` runs demo_setup, which prints the console's address, user and password."""
    from io import StringIO

    from django.core.management import call_command

    from tests.gateway.conftest import committed

    def setup() -> str:
        out = StringIO()
        call_command("demo_setup", stdout=out)
        return out.getvalue()

    printed = committed(django_db_blocker, setup)
    console_line = next(line for line in printed.splitlines() if line.startswith("Console:"))
    assert "http://127.0.0.1:8000/console/ user 'demo'" in console_line
    password = console_line.split("password (shown once): ")[1].strip()
    page = new_page()
    page.goto("/console/")
    page.wait_for_url("**/console/login/**")
    page.get_by_label("Username").fill("demo")
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    expect(page.get_by_label("Tenant")).to_contain_text("Demo tenant")
    expect(page.get_by_text("demo (owner)")).to_be_visible()
    # A second run keeps the account and never prints the password again.
    again = committed(django_db_blocker, setup)
    assert password not in again and "manage.py changepassword demo" in again


def test_a_user_in_two_tenants_switches_between_them(
    new_page: Callable[..., Any], make_account: MakeAccount
) -> None:
    alpha = make_account("owner", name="Alpha works")
    beta = make_account("member", user=alpha, tenant=make_account("owner", name="Beta labs"))
    make_account("owner", name="Gamma outside")  # a tenant this user is not in
    page = new_page()
    log_in(page, alpha)
    page.goto(f"/console/t/{alpha.tenant_id}/members/")
    switcher = page.get_by_label("Tenant")
    assert switcher.locator("option").all_inner_texts() == ["Alpha works", "Beta labs"]
    expect(page.get_by_role("button", name="Send invitation")).to_be_visible()  # owner here

    switcher.select_option(label="Beta labs")  # submits itself (data-autosubmit)
    page.wait_for_url(f"**/console/t/{beta.tenant_id}/")
    page.goto(f"/console/t/{beta.tenant_id}/members/")
    expect(page.get_by_label("Tenant")).to_have_value(beta.tenant_id)
    expect(page.get_by_text(f"{alpha.username} (member)")).to_be_visible()
    assert page.locator("main form").count() == 0  # a member there
    # /console/ remembers the tenant last worked on.
    page.goto("/console/")
    page.wait_for_url(f"**/console/t/{beta.tenant_id}/")
