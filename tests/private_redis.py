"""A Redis server of a test's own, for tests that flush it or change its configuration
(FLUSHALL, CONFIG SET maxmemory-policy ...): the session's shared server stays untouched."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from config import embedded


@dataclass(frozen=True)
class PrivateRedis:
    folder: Path

    @property
    def url(self) -> str:
        return f"unix://{self.folder / 'redis.sock'}?db=0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


@pytest.fixture
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    # A short path: the socket's path must fit in 108 bytes.
    folder = Path(tmp_path_factory.mktemp("r"))
    embedded.start_redis(folder, persistent=False)
    try:
        yield PrivateRedis(folder)
    finally:
        embedded.stop_redis(folder)
