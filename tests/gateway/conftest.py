"""End-to-end fixtures: the mock upstream and the gateway as real servers (uvicorn, several worker
processes) over the test session's Redis and PostgreSQL, called with the official openai SDK.

Tenants, keys and provider keys used by the running gateway must be committed, while the test
itself runs inside pytest-django's transaction (its `django_db` mark is what makes pytest-django
create the test database). So they are written by `committed()`, on a thread of its own with its
own autocommitting connection. Every test makes its own tenant with a unique slug.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings

from config.embedded import embedded_database_url, free_port
from gateway.mock_upstream import MockUpstream, start_subprocess
from quotas.cycles import schedule_for
from quotas.engine import QuotaEngine
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import UTC_MONTHLY, CycleSchedule

ROOT = Path(__file__).resolve().parents[2]
# The mock provider key's default price (micro-dollars per million tokens), for unpriced models.
MOCK_DEFAULT_INPUT_PRICE = 1_000_000
MOCK_DEFAULT_OUTPUT_PRICE = 2_000_000
ANTHROPIC_MOCK_SECRET = "sk-ant-mock-upstream"


@dataclass
class GatewayServer:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]


def gateway_env(**overrides: str) -> dict[str, str]:
    test_db = settings.DATABASES["default"]["NAME"]
    database_url = embedded_database_url(settings.DATA_DIR).replace("/tollgate?", f"/{test_db}?")
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(ROOT),
           "LOG_LEVEL": os.environ.get("TOLLGATE_TEST_GATEWAY_LOG_LEVEL", "WARNING"),
           "GATEWAY_LAST_USED_FLUSH_SECONDS": "0.5"}
    env.update(overrides)
    return env


def start_gateway(tmp: Path, *, workers: int = 4, **env: str) -> GatewayServer:
    port = free_port()
    log = tmp / f"gateway-{port}.log"
    # As config/serve.py runs it: a worker told to stop lets its calls finish for this long.
    drain = env.get("GATEWAY_SHUTDOWN_DRAIN_SECONDS", str(settings.GATEWAY_SHUTDOWN_DRAIN_SECONDS))
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--workers", str(workers), "--loop", "uvloop", "--http",
         "httptools", "--log-level", "warning", "--no-access-log",
         "--no-proxy-headers", "--timeout-graceful-shutdown", drain],
        cwd=ROOT, env=gateway_env(**env), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    server = GatewayServer(port, process, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"gateway did not start: {log.read_text()[-2000:]}")


def committed(django_db_blocker: Any, work: Callable[[], Any]) -> Any:
    """Run `work` on a fresh thread and database connection, so its writes are committed and
    visible to the gateway processes at once."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def run() -> Any:
        try:
            return work()
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


@pytest.fixture(scope="session")
def mock_upstream() -> Iterator[MockUpstream]:
    with start_subprocess() as upstream:
        yield upstream


@pytest.fixture(scope="session")
def provider_key(django_db_setup: None, django_db_blocker: Any, mock_upstream: MockUpstream) -> str:
    """A provider key for the mock upstream, shared by every end-to-end test. Like the one the
    quick start makes, it names a default price: the tests call models the catalog does not
    know (the mock's fault-injection suffixes, unique names), which are otherwise refused."""
    from gateway.prices import Price
    from gateway.providers import create_provider_key

    key = committed(django_db_blocker, lambda: create_provider_key(
        "mock", base_url=mock_upstream.base_url, secret="sk-mock-upstream",
        default_price=Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)))
    # The same mock speaks Anthropic's Messages API: a key of that kind serves /v1/messages
    # (ANTHROPIC_MOCK_SECRET is its x-api-key, for per-key faults and the bill).
    committed(django_db_blocker, lambda: create_provider_key(
        "mock-anthropic", base_url=mock_upstream.base_url, secret=ANTHROPIC_MOCK_SECRET,
        kind="anthropic",
        default_price=Price(MOCK_DEFAULT_INPUT_PRICE, MOCK_DEFAULT_OUTPUT_PRICE)))
    return key.public_id


@pytest.fixture(scope="session")
def gateway(provider_key: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    server = start_gateway(tmp_path_factory.mktemp("gateway"), workers=4)
    yield server
    server.stop()


@dataclass(frozen=True)
class TenantKey:
    tenant_id: int
    slug: str
    project_id: int
    api_key_id: int
    api_key_public_id: str
    plaintext: str
    # The tenant's windows as created (quotas.cycles.schedule_for): the free plan resets its
    # 'month' counters daily, so a test reading a cycle counter reads it in these windows.
    schedule: CycleSchedule = UTC_MONTHLY

    @property
    def tag(self) -> str:
        return tenant_tag(self.tenant_id)


MakeTenant = Callable[..., TenantKey]


@pytest.fixture
def make_tenant(django_db_blocker: Any, provider_key: str) -> MakeTenant:
    """Create a committed tenant with one project and one key: make_tenant(plan="free", **limits).

    Keyword arguments go to create_tenant (overrides), except `key_options` (for issue_key) and
    `project_options` (for create_project)."""
    from tenants.services import create_project, create_tenant, issue_key

    def make(plan: str = "free", key_options: dict[str, Any] | None = None,
             project_options: dict[str, Any] | None = None, **overrides: Any) -> TenantKey:
        slug = f"t-{uuid.uuid4().hex[:10]}"

        def create() -> tuple[Any, Any, Any]:
            tenant = create_tenant(slug, plan_name=plan, actor="test", **overrides)
            project = create_project(tenant, "app", actor="test", **(project_options or {}))
            return tenant, project, issue_key(project, actor="test", **(key_options or {}))

        tenant, project, issued = committed(django_db_blocker, create)
        return TenantKey(tenant.pk, slug, project.pk, issued.api_key.pk,
                         issued.api_key.public_id, issued.plaintext, schedule_for(tenant))

    return make


@pytest.fixture
def engine() -> QuotaEngine:
    return get_engine()


def client_for(server: GatewayServer, key: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, **options)


def async_client_for(server: GatewayServer, key: str, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, **options)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
