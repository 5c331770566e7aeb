"""/readyz checks every Redis the process uses, each by name (gateway/readiness.py): the quota
store (`redis`, `redis_config`, and `redis_cluster` on a Redis Cluster: every master answers
cluster_state:ok), the Django cache (`cache_redis`) and Celery's broker (`broker`). One of them
down makes the process not ready (503) and the answer names which, the others still `ok`.

Each Redis a test stops is its own (a private server, a private 3-master cluster): the session's
shared servers stay up for the other tests."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from config import embedded
from tests.gateway.conftest import GatewayServer, start_gateway

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def _socket_url(folder: Path, db: int = 0) -> str:
    return f"unix://{folder / 'redis.sock'}?db={db}"


@pytest.fixture
def two_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Two throwaway Redis servers (short socket paths: 108 bytes at most)."""
    folders = (Path(tmp_path_factory.mktemp("c")), Path(tmp_path_factory.mktemp("b")))
    for folder in folders:
        embedded.start_redis(folder, persistent=False)
    try:
        yield folders
    finally:
        for folder in folders:
            embedded.stop_redis(folder)


def ready(server: GatewayServer) -> tuple[int, dict[str, str]]:
    answer = httpx.get(f"{server.url}/readyz", timeout=20)
    return answer.status_code, answer.json()


def test_the_cache_or_the_broker_down_is_not_ready_and_named(
        two_redis: tuple[Path, Path], provider_key: str, tmp_path: Path) -> None:
    cache_dir, broker_dir = two_redis
    # kombu's spelling of a socket broker, as settings derive it from a unix:// REDIS_URL.
    broker_url = f"redis+socket://{broker_dir / 'redis.sock'}"
    server = start_gateway(tmp_path, workers=1, CACHE_REDIS_URL=_socket_url(cache_dir),
                           CELERY_BROKER_URL=broker_url)
    try:
        assert ready(server) == (200, {"status": "ok", "redis": "ok", "redis_config": "ok",
                                       "cache_redis": "ok", "broker": "ok", "database": "ok"})

        embedded.stop_redis(broker_dir)
        status, body = ready(server)
        assert status == 503
        assert body["status"] == "unavailable"
        assert body["broker"].startswith("error: ")  # a ConnectionError, named
        assert {k: v for k, v in body.items() if k not in ("status", "broker")} == {
            "redis": "ok", "redis_config": "ok", "cache_redis": "ok", "database": "ok"}

        embedded.start_redis(broker_dir, persistent=False)
        assert ready(server)[0] == 200

        embedded.stop_redis(cache_dir)
        status, body = ready(server)
        assert status == 503
        assert body["cache_redis"].startswith("error: ")
        assert {k: v for k, v in body.items() if k not in ("status", "cache_redis")} == {
            "redis": "ok", "redis_config": "ok", "broker": "ok", "database": "ok"}
        assert "readiness: the cache Redis" in server.log.read_text()

        embedded.start_redis(cache_dir, persistent=False)
        assert ready(server)[0] == 200
    finally:
        server.stop()


def test_a_broker_that_is_not_redis_is_checked_through_kombu(
        redis_url: str, provider_key: str, tmp_path: Path) -> None:
    # Nothing listens on the port: kombu's amqp transport cannot connect. (Settings want a Redis
    # for the beat's schedule with a non-Redis broker; the gateway process does not use it.)
    server = start_gateway(tmp_path, workers=1,
                           CELERY_BROKER_URL=f"amqp://guest:guest@127.0.0.1:{embedded.free_port()}//",
                           REDBEAT_REDIS_URL=f"{redis_url.partition('?')[0]}?db=12")
    try:
        status, body = ready(server)
        assert status == 503
        assert body["broker"].startswith("error: ")
        assert body["redis"] == body["cache_redis"] == body["database"] == "ok"
    finally:
        server.stop()


def test_a_cluster_master_down_is_not_ready_and_named(
        redis_url: str, provider_key: str, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    folder = Path(tmp_path_factory.mktemp("cl"))
    cluster = embedded.start_cluster(folder)
    # The cache and the broker on the session's standalone server (databases the tests' own
    # quota counters, in database 0, do not use).
    standalone = redis_url.partition("?")[0]
    server = start_gateway(tmp_path, workers=1, REDIS_CLUSTER="true", REDIS_URL=cluster.url,
                           CACHE_REDIS_URL=f"{standalone}?db=7",
                           CELERY_BROKER_URL=(f"redis+socket://{standalone[len('unix://'):]}"
                                              "?virtual_host=8"))
    try:
        assert ready(server) == (200, {
            "status": "ok", "redis": "ok", "redis_cluster": "ok", "redis_config": "ok",
            "cache_redis": "ok", "broker": "ok", "database": "ok"})

        embedded.stop_redis(folder / "node2")
        status, body = ready(server)
        assert status == 503
        assert body["status"] == "unavailable"
        # The dead master, counted among the three; no address in the public answer.
        assert body["redis_cluster"].startswith("error: a master unreachable")
        assert "of 3 masters" in body["redis_cluster"]
        assert "127.0.0.1" not in str(body)
        assert body["cache_redis"] == body["broker"] == body["database"] == "ok"
        assert "readiness: Redis Cluster master 127.0.0.1:" in server.log.read_text()
    finally:
        server.stop()
        embedded.stop_cluster(folder)
