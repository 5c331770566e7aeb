"""Test fixtures: real services, started once per test session and stopped at its end.

Each session gets its own data directory (TOLLGATE_DATA_DIR, set before Django reads its settings),
so a test run never touches the data of `make up` nor of another run.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if "TOLLGATE_DATA_DIR" not in os.environ:
    # Short path: PostgreSQL and Redis listen on unix sockets inside it (108-byte limit).
    os.environ["TOLLGATE_DATA_DIR"] = tempfile.mkdtemp(prefix="tgt-", dir="/tmp")
    _OWN_DATA_DIR = True
else:
    _OWN_DATA_DIR = False
os.environ.setdefault("TOLLGATE_ENV", "test")

from config import embedded  # noqa: E402

DATA_DIR = Path(os.environ["TOLLGATE_DATA_DIR"])


def pytest_configure(config: pytest.Config) -> None:
    # Before pytest-django creates the test database.
    embedded.start_all(DATA_DIR, persistent=False)


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
