"""Secure defaults (issue 11, items 9 and 10): production must be said explicitly and refuses
development settings; HSTS and https links behind a TLS proxy; the login throttle covers the
admin, takes its slot atomically, and trusts X-Forwarded-For only from trusted proxies."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client, override_settings

from tests.world import PASSWORD, World

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = {"TOLLGATE_ENV": "production", "SECRET_KEY": "s" * 50,
              "TOLLGATE_KEY_PEPPER": "p" * 50, "TOLLGATE_ENCRYPTION_KEYS": "k" * 44,
              "ALLOWED_HOSTS": "tollgate.example", "DEBUG": "false"}
PRINT = ("import config.settings as s; "
         "print(s.SECURE_HSTS_SECONDS, s.SECURE_PROXY_SSL_HEADER, s.ALLOWED_HOSTS)")


def load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRINT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.delete_pattern("login-fail:*")


# --- item 10: production mode is explicit ----------------------------------------------------

@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TOLLGATE_ENV": ""}, "TOLLGATE_ENV must be set to development, test or production"),
        ({**PRODUCTION, "DEBUG": "true"}, "DEBUG must be off in production"),
        ({**PRODUCTION, "ALLOWED_HOSTS": ""}, "ALLOWED_HOSTS must be set in production"),
        ({**PRODUCTION, "ALLOWED_HOSTS": "tollgate.example,testserver"},
         "must not contain 'testserver' or '*'"),
        ({**PRODUCTION, "ALLOWED_HOSTS": "*"}, "must not contain 'testserver' or '*'"),
        ({**PRODUCTION, "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto"},
         "SECURE_PROXY_SSL_HEADER must be 'HTTP_<HEADER>,<value>'"),
        ({**PRODUCTION, "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https"},
         "name it in TOLLGATE_TRUSTED_PROXIES"),
        ({**PRODUCTION, "SECURE_HSTS_SECONDS": "-1"}, "SECURE_HSTS_SECONDS must be >= 0"),
        # It under-charges a stream its upstream cuts (tests/gateway/test_upstream_http.py).
        ({**PRODUCTION, "GATEWAY_UPSTREAM_TRANSPORT": "aiohttp"},
         "GATEWAY_UPSTREAM_TRANSPORT=aiohttp is for benchmarks only"),
    ],
)
def test_unsafe_settings_refuse_to_start(env: dict[str, str], message: str) -> None:
    result = load_settings(**env)
    assert result.returncode != 0
    assert message in result.stderr


def test_production_defaults_hsts_and_a_named_proxy_header() -> None:
    result = load_settings(**PRODUCTION, SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https",
                           TOLLGATE_TRUSTED_PROXIES="10.0.0.0/8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == (
        "31536000 ('HTTP_X_FORWARDED_PROTO', 'https') ['tollgate.example']")
    development = load_settings(TOLLGATE_ENV="development")
    assert development.returncode == 0, development.stderr
    assert development.stdout.startswith("0 None ['localhost', '127.0.0.1', '[::1]', 'testserver']")


@override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"),
                   SECURE_HSTS_SECONDS=31_536_000)
def test_behind_a_tls_proxy_responses_carry_hsts_and_plain_http_does_not(world: World) -> None:
    via_proxy = Client().get("/console/login/", HTTP_X_FORWARDED_PROTO="https")
    assert via_proxy.status_code == 200
    assert via_proxy["Strict-Transport-Security"] == "max-age=31536000"
    plain = Client().get("/console/login/")
    assert "Strict-Transport-Security" not in plain


def _invite(client: Client, world: World, email: str, **extra: Any) -> str:
    response = client.post(f"/api/tenants/{world.acme.public_id}/invitations/",
                           {"email": email, "role": "member"}, content_type="application/json",
                           **extra)
    assert response.status_code == 201, response.content
    return response.json()["accept_url"]


def test_invitation_links_are_https_in_production(world: World) -> None:
    client = Client()
    client.force_login(world.owner)
    # Outside production the link follows the request (the quick start is plain http).
    assert _invite(client, world, "dev@acme.test").startswith("http://testserver/console/")
    with override_settings(TOLLGATE_ENV="production"):
        # A TLS proxy that does not tell Django (no SECURE_PROXY_SSL_HEADER): still https.
        assert _invite(client, world, "prod@acme.test").startswith(
            "https://testserver/console/invite/")
    with override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https")):
        # The proxy passes the public Host on, as real ones do.
        assert _invite(client, world, "proxy@acme.test", HTTP_HOST="localhost",
                       HTTP_X_FORWARDED_PROTO="https").startswith(
            "https://localhost/console/invite/")


def test_the_invite_command_links_are_https_in_production(world: World) -> None:
    from tenants.invitation_links import invitation_link

    with override_settings(TOLLGATE_ENV="production"):
        assert invitation_link("http://console.example:8000", "abc").startswith(
            "https://console.example:8000/console/invite/")
    assert invitation_link("http://127.0.0.1:8000", "abc").startswith("http://127.0.0.1:8000/")


# --- item 9: the admin login is throttled like the console's ---------------------------------

def _operator_can_use_admin(world: World) -> None:
    get_user_model().objects.filter(pk=world.operator.pk).update(is_superuser=True)


@override_settings(LOGIN_FAILURE_LIMIT=3)
def test_admin_login_is_throttled(world: World) -> None:
    _operator_can_use_admin(world)
    client = Client()
    for _ in range(3):
        wrong = client.post("/admin/login/", {"username": "operator", "password": "wrong"})
        assert wrong.status_code == 200  # the admin's own "please enter the correct..." page
    refused = client.post("/admin/login/", {"username": "operator", "password": PASSWORD})
    assert refused.status_code == 429
    assert "Too many failed logins" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    # The budgets are shared with the console: the same username is refused there too.
    assert Client().post("/console/login/",
                         {"username": "operator", "password": PASSWORD}).status_code == 429


@override_settings(LOGIN_FAILURE_LIMIT=3)
def test_admin_login_succeeds_within_the_budget(world: World) -> None:
    _operator_can_use_admin(world)
    client = Client()
    client.post("/admin/login/", {"username": "operator", "password": "wrong"})
    ok = client.post("/admin/login/?next=/admin/", {"username": "operator", "password": PASSWORD,
                                                    "next": "/admin/"})
    assert ok.status_code == 302 and ok["Location"] == "/admin/"
    assert client.session.get("_auth_user_id") == str(world.operator.pk)


@override_settings(LOGIN_FAILURE_LIMIT=3)
def test_a_signed_in_user_gets_no_extra_guesses_at_the_admin_login(world: World) -> None:
    # Django admin shows its login form to a signed-in user who is not staff, and a wrong
    # password leaves them signed in: that must not count as a success that refills budgets.
    _operator_can_use_admin(world)
    client = Client()
    client.force_login(world.member)
    statuses = [client.post("/admin/login/", {"username": "operator", "password": "wrong"}
                            ).status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    assert client.session.get("_auth_user_id") == str(world.member.pk)


@override_settings(LOGIN_FAILURE_LIMIT=2)
def test_ipv6_clients_of_one_64_share_a_login_budget(world: World) -> None:
    def attempt(peer: str) -> int:
        return Client(REMOTE_ADDR=peer).post(
            "/console/login/", {"username": f"user-{peer}", "password": "wrong"}).status_code

    # Rotating through one /64 (a subscriber's own allocation) buys no fresh budget.
    assert [attempt(f"2001:db8:1:2::{i}") for i in range(1, 4)] == [200, 200, 429]
    assert attempt("2001:db8:1:3::1") == 200  # the next /64 is someone else


class CountingBackend:
    """A real authentication backend that counts password checks and refuses them slowly, so
    concurrent attempts overlap the way a guesser's parallel requests do."""

    checks = 0
    lock = threading.Lock()

    def authenticate(self, request: Any, username: str | None = None,
                     password: str | None = None, **kwargs: Any) -> None:
        with CountingBackend.lock:
            CountingBackend.checks += 1
        threading.Event().wait(0.2)
        return None

    def get_user(self, user_id: int) -> None:
        return None


def _concurrent_guesses(count: int, peer: Any) -> list[int]:
    CountingBackend.checks = 0
    start = threading.Barrier(count)
    statuses: list[int] = []

    def guess(index: int) -> None:
        client = Client(REMOTE_ADDR=peer(index))
        start.wait()
        response = client.post("/console/login/", {"username": "victim",
                                                     "password": f"guess-{index}"})
        statuses.append(response.status_code)

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(statuses)


@override_settings(LOGIN_FAILURE_LIMIT=3, AUTHENTICATION_BACKENDS=[
    f"{__name__}.CountingBackend"])
def test_concurrent_guesses_get_exactly_the_limit_of_password_checks() -> None:
    # Twelve addresses guessing one username at once: only its budget is contended. Counting
    # failures after the check let all twelve read "under the limit" and be checked.
    statuses = _concurrent_guesses(12, lambda index: f"203.0.113.{index + 1}")
    assert CountingBackend.checks == 3
    assert statuses == [200] * 3 + [429] * 9


@override_settings(LOGIN_FAILURE_LIMIT=3, AUTHENTICATION_BACKENDS=[
    f"{__name__}.CountingBackend"])
def test_concurrent_guesses_on_both_budgets_never_exceed_the_limit() -> None:
    # One address and one username: each budget's slots are handed out atomically, but not
    # both in one step, so an attempt may win one budget's slot and lose the other's. Never
    # more checks than the limit; possibly fewer under such a burst (the safe side).
    statuses = _concurrent_guesses(12, lambda index: "198.51.100.9")
    assert CountingBackend.checks <= 3
    assert statuses.count(200) == CountingBackend.checks
    assert statuses.count(429) == 12 - CountingBackend.checks


# --- trusted proxies: whose address is counted ----------------------------------------------

@override_settings(LOGIN_FAILURE_LIMIT=2)
def test_forwarded_for_counts_only_from_a_trusted_proxy(world: World) -> None:
    def attempt(peer: str, forwarded: str, password: str = "wrong") -> int:
        return Client(REMOTE_ADDR=peer).post(
            "/console/login/", {"username": f"user-{forwarded}", "password": password},
            HTTP_X_FORWARDED_FOR=forwarded).status_code

    # An untrusted peer's header is ignored: every "client" it names shares the peer's budget.
    assert [attempt("198.51.100.7", f"203.0.113.{i}") for i in range(3)] == [200, 200, 429]
    with override_settings(TRUSTED_PROXIES=(ipaddress.ip_network("10.0.0.0/8"),)):
        # Through our proxy each client has its own budget, whatever the client prepended.
        assert [attempt("10.1.2.3", f"1.2.3.4, 203.0.113.{i}") for i in range(3)] == [200] * 3
        assert [attempt("10.1.2.3", "203.0.113.50") for _ in range(3)] == [200, 200, 429]
