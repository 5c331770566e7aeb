import pytest
import redis
from django.db import connection


@pytest.mark.django_db
def test_database_is_real_postgresql() -> None:
    with connection.cursor() as cur:
        cur.execute("select version()")
        assert "PostgreSQL" in cur.fetchone()[0]


def test_redis_is_a_real_server(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    assert client.info("server")["redis_version"]
