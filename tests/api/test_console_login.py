"""Console login and logout: CSRF on, throttled failures, redirects."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client, override_settings

from tests.world import PASSWORD, World


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.delete_pattern("login-fail:*")


def test_login_page_renders_with_labels(world: World) -> None:
    page = Client().get("/console/login/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<label for="id_username">' in html and '<label for="id_password">' in html
    assert "csrfmiddlewaretoken" in html


def test_login_needs_csrf_token(world: World) -> None:
    client = Client(enforce_csrf_checks=True)
    response = client.post("/console/login/", {"username": "owner", "password": PASSWORD})
    assert response.status_code == 403


def test_login_and_logout(world: World) -> None:
    client = Client()
    response = client.post("/console/login/", {"username": "owner", "password": PASSWORD})
    assert response.status_code == 302
    assert client.session.get("_auth_user_id") == str(world.owner.pk)
    response = client.post("/console/logout/")
    assert response.status_code == 302 and response["Location"] == "/console/login/"
    assert "_auth_user_id" not in client.session


def test_console_pages_need_login(world: World) -> None:
    response = Client().get("/console/")
    assert response.status_code == 302 and response["Location"].startswith("/console/login/")


@override_settings(LOGIN_FAILURE_LIMIT=3)
def test_login_is_throttled_after_failures(world: World) -> None:
    client = Client()
    for _ in range(3):
        assert client.post("/console/login/",
                           {"username": "owner", "password": "wrong"}).status_code == 200
    # Now even the right password is refused, without being checked.
    refused = client.post("/console/login/", {"username": "owner", "password": PASSWORD})
    assert refused.status_code == 429
    assert "Too many failed logins" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    # Another username from the same address is refused too (the address is counted).
    other = client.post("/console/login/", {"username": "member", "password": PASSWORD})
    assert other.status_code == 429


def test_passwords_are_hashed_with_argon2(world: World) -> None:
    world.owner.refresh_from_db()
    assert world.owner.password.startswith("argon2$")
