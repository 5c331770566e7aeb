"""Test fixtures: real services, started once per test session and stopped at its end, under
the session's own TOLLGATE_DATA_DIR (set by tests/session_env.py before settings load)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from django.conf import settings

from config import embedded

# The shared helpers assert too: their failures explain themselves as a test's would.
pytest.register_assert_rewrite("tests.support")

DATA_DIR = Path(os.environ["TOLLGATE_DATA_DIR"])
_OWN_DATA_DIR = os.environ.get("TOLLGATE_TEST_OWNS_DATA_DIR") == "1"
if settings.DATA_DIR != DATA_DIR.resolve():
    raise RuntimeError(
        f"settings were loaded with DATA_DIR={settings.DATA_DIR}, not the test session's "
        f"{DATA_DIR}: run pytest with `-p tests.session_env` (pyproject's addopts does)"
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before pytest-django creates the test database.
    embedded.start_all(DATA_DIR, persistent=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # End-to-end tests commit tenants and provider keys for the running gateway to see; run
    # them last so the other database tests start from the migrated state they expect.
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def pytest_unconfigure(config: pytest.Config) -> None:
    embedded.stop_all(DATA_DIR)
    if _OWN_DATA_DIR:
        shutil.rmtree(DATA_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return embedded.embedded_redis_url(DATA_DIR)


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A 3-node Redis Cluster (3 masters) on free loopback ports, started on first use."""
    info = embedded.start_cluster(DATA_DIR / "cluster")
    yield info.url
    embedded.stop_cluster(DATA_DIR / "cluster")


@pytest.fixture
def world(db: None) -> "World":
    """Two tenants and owner / member / outsider / operator users (tests/world.py)."""
    from tests.world import build_world

    return build_world()


@pytest.fixture(autouse=True)
def _no_request_ids_between_tests() -> Iterator[None]:
    """A synchronous test that makes a request id (gateway.errors.new_request_id binds it to the
    running context) would leave it bound in the main thread for every later test: log lines
    "outside a request" would then carry it. Each test starts and ends outside any request."""
    from gateway import request_context

    tokens = [var.set(None) for var in (request_context.request_id, request_context.tenant,
                                        request_context.api_key)]
    yield
    for var, token in zip((request_context.request_id, request_context.tenant,
                           request_context.api_key), tokens, strict=True):
        try:
            var.reset(token)
        except ValueError:  # set in another context (an async test's loop): nothing to undo
            var.set(None)
