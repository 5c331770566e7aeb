"""Browser tests: the console in real headless Chromium (Debian's, never a Playwright download)
against a running system: uvicorn serving config.asgi (/console, /api and /v1), the mock
upstream, and the test session's Redis and PostgreSQL.

Two constraints shape these fixtures:
- The servers only see committed data, so browser tests never use the database on the main
  thread: every read and write goes through `committed()` (its own thread and connection). They
  are still marked `django_db`, which is what makes pytest-django create the test database; that
  mark opens and rolls back an (empty) transaction on the main thread around each test.
- Playwright's sync API keeps an asyncio loop marked as running on the main thread while it is
  started, and Django then refuses ORM calls on that thread (and asgiref would hand it another
  connection, which leaks). So Chromium is started per test, after that transaction is opened,
  and stopped before it is rolled back: about a second per test, and no ORM call ever meets
  Playwright's loop.
- Other e2e tests count calls on their own mock upstream. Each browser test's tenant gets a
  provider key dedicated to it (tenant-scoped), pointing at this package's own mock, so nothing
  here changes the upstreams other tenants use.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.mock_upstream import MockUpstream, start_subprocess
from tests.gateway.conftest import ROOT, GatewayServer, committed, start_gateway

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PASSWORD = "browser test passphrase 9"


def chromium_executable() -> str:
    path = os.environ.get("TOLLGATE_CHROMIUM", "/usr/bin/chromium")
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"Chromium not found at {path}: the browser tests drive the system's Chromium. "
            "Install it with `sudo apt-get install -y chromium` (.ci/run does this), or point "
            "TOLLGATE_CHROMIUM at a Chromium binary. Never `playwright install`.",
            pytrace=False,
        )
    return path


def screenshot_dir() -> Path:
    path = Path(os.environ.get("TOLLGATE_SCREENSHOT_DIR", ROOT / "build" / "screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium for one test (see the module's docstring for why not one per
    session). Playwright's launch() gives it a fresh temporary profile (user-data-dir) of its
    own, removed when it closes."""
    from playwright.sync_api import sync_playwright

    executable = chromium_executable()
    playwright = sync_playwright().start()
    try:
        launched = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()
    finally:
        playwright.stop()


@pytest.fixture(scope="package")
def browser_upstream() -> Iterator[MockUpstream]:
    with start_subprocess() as upstream:
        yield upstream


@pytest.fixture(scope="package")
def console_server(
    django_db_setup: None, browser_upstream: MockUpstream,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayServer]:
    """The whole web app as `make up` serves it (uvicorn, config.asgi), on the test database."""
    server = start_gateway(tmp_path_factory.mktemp("console"), workers=2)
    yield server
    server.stop()


@dataclass(frozen=True)
class Account:
    username: str
    password: str
    tenant_id: str  # public id
    tenant_name: str
    tenant_slug: str


MakeAccount = Callable[..., Account]


@pytest.fixture
def make_account(
    django_db_setup: None, django_db_blocker: Any, browser_upstream: MockUpstream
) -> MakeAccount:
    """make_account(role="owner", tenant=None, user=None): a committed new user (or `user`'s)
    with `role` in a fresh tenant (with a provider key dedicated to it, on this package's mock),
    or in `tenant`'s tenant."""
    from django.contrib.auth import get_user_model

    from gateway.providers import create_provider_key
    from tenants.models import Membership, Tenant
    from tenants.services import create_tenant

    def make(role: str = "owner", tenant: Account | None = None, name: str = "",
             user: Account | None = None) -> Account:
        suffix = uuid.uuid4().hex[:8]
        username = user.username if user else f"{role}-{suffix}"

        def create() -> Tenant:
            users = get_user_model().objects
            person = (users.get(username=username) if user else
                      users.create_user(username, f"{username}@example.test", PASSWORD))
            if tenant is None:
                target = create_tenant(f"b-{suffix}", plan_name="standard", actor="test",
                                       name=name or f"Browser {suffix}")
                create_provider_key(f"mock-{suffix}", base_url=browser_upstream.base_url,
                                    secret="sk-mock-upstream", tenant=target, actor="test")
            else:
                target = Tenant.objects.get(public_id=tenant.tenant_id)
            Membership.objects.create(user=person, tenant=target, role=role)
            return target

        target = committed(django_db_blocker, create)
        return Account(username, PASSWORD, target.public_id, target.name, target.slug)

    return make


@pytest.fixture
def new_page(browser: Any, console_server: GatewayServer) -> Iterator[Callable[..., Any]]:
    """new_page(viewport=LAPTOP): a page in a fresh browser context (its own cookies), with the
    server as base URL; contexts are closed after the test."""
    contexts: list[Any] = []

    def make(viewport: dict[str, int] | None = None, **options: Any) -> Any:
        context = browser.new_context(base_url=console_server.url, viewport=viewport or LAPTOP,
                                      accept_downloads=True, **options)
        context.set_default_timeout(10_000)
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


def log_in(page: Any, account: Account) -> None:
    page.goto("/console/login/")
    page.get_by_label("Username").fill(account.username)
    page.get_by_label("Password").fill(account.password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(lambda url: "/console/login/" not in url)


LAYOUT_PROBE = """() => {
  const unlabeled = [...document.querySelectorAll("input, select, textarea")].filter((el) => {
    if (["hidden", "submit", "button", "reset", "image"].includes(el.type)) return false;
    if (el.getClientRects().length === 0) return false;  // not rendered
    if (el.getAttribute("aria-label") || el.getAttribute("aria-labelledby")) return false;
    return !(el.labels && el.labels.length > 0);
  }).map((el) => el.outerHTML.slice(0, 160));
  // The outermost elements that stick out on the right, to say what overflows.
  const wide = [...document.body.querySelectorAll("*")].filter((el) =>
    el.getBoundingClientRect().right > window.innerWidth + 1
    && !(el.parentElement && el.parentElement.getBoundingClientRect().right > window.innerWidth + 1)
  ).map((el) => `${el.tagName.toLowerCase()}.${el.className}`).slice(0, 5);
  return {wide, scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth,
          unlabeled};
}"""


def check_layout(page: Any) -> None:
    """The page fits the viewport's width (no sideways scrolling) and every visible form field
    has a label."""
    probe = page.evaluate(LAYOUT_PROBE)
    assert probe["scrollWidth"] <= probe["innerWidth"] + 1, (
        f"{page.url} overflows: {probe['scrollWidth']}px wide in a {probe['innerWidth']}px "
        f"viewport; sticking out: {probe['wide']}")
    assert probe["unlabeled"] == [], f"{page.url} has fields without a label: {probe['unlabeled']}"


def shoot(page: Any, name: str) -> Path:
    width = page.viewport_size["width"]
    path = screenshot_dir() / f"{name}-{width}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
