"""A deployment on a Redis Cluster, end to end through a real server (uvicorn, two workers): the
quota store is the 3-master test cluster (REDIS_CLUSTER=true, REDIS_URL one node), the Django
cache and Celery's broker a standalone Redis (CACHE_REDIS_URL, CELERY_BROKER_URL: settings
require them with a cluster). Over plain HTTP with CSRF enforced, as a browser would:

- the console login, whose failure throttle lives in the cache Redis (its key is seen there);
- a key issued on the console's projects page, a one-use form (its id remembered in the cache
  Redis: the same form sent again issues nothing);
- a /v1 call with that key, metered on the cluster (its tenant's counter is read there);
- /readyz naming the cluster, the cache and the broker, all ok.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.mock_upstream import MockUpstream
from quotas.keys import tenant_tag
from tests.gateway.conftest import (
    GatewayServer,
    MakeTenant,
    client_for,
    committed,
    start_gateway,
)
from tests.support.console_http import issue_key, log_in, owner_of

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

CACHE_DB, BROKER_DB = 9, 10


@pytest.fixture
def cluster_server(redis_cluster_url: str, redis_url: str, provider_key: str,
                   tmp_path: Path) -> Iterator[GatewayServer]:
    standalone = redis_url.partition("?")[0]
    server = start_gateway(tmp_path, workers=2, REDIS_CLUSTER="true", REDIS_URL=redis_cluster_url,
                           CACHE_REDIS_URL=f"{standalone}?db={CACHE_DB}",
                           CELERY_BROKER_URL=(f"redis+socket://{standalone[len('unix://'):]}"
                                              f"?virtual_host={BROKER_DB}"))
    yield server
    server.stop()


def test_console_login_key_issue_and_a_call_on_a_cluster(
        cluster_server: GatewayServer, make_tenant: MakeTenant, mock_upstream: MockUpstream,
        redis_url: str, redis_cluster_url: str, django_db_blocker: Any) -> None:
    from tenants.models import ApiKey

    t = make_tenant()
    owner = owner_of(django_db_blocker, t)
    cache = redis.Redis.from_url(f"{redis_url.partition('?')[0]}?db={CACHE_DB}",
                                 decode_responses=True)
    cluster = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    # config/console/login_throttle.py's key for this username, under the cache's prefix.
    hashed = hashlib.sha256(owner.username.encode()).hexdigest()[:32]
    throttle_key = f"tg:cache:1:login-fail:user:{hashed}"
    try:
        with httpx.Client(base_url=cluster_server.url, timeout=30) as browser:
            # A wrong password: refused, and counted in the cache Redis (the login throttle).
            wrong = log_in(browser, owner.username, "wrong")
            assert wrong.status_code == 200 and "sessionid" not in browser.cookies
            assert cache.get(throttle_key) == "1"

            signed_in = log_in(browser, owner.username)
            assert signed_in.status_code == 302 and "sessionid" in browser.cookies

            issued = issue_key(browser, owner, "on-cluster")
            plaintext = issued.plaintext
            assert cache.exists(f"tg:cache:1:console:form-once:{issued.form['form_id']}")

            # The same rendered form again (a reload): nothing is issued a second time.
            again = browser.post(issued.action, data={
                **issued.form, f"{owner.project_public_id}-name": "on-cluster"})
            assert again.status_code == 302
        assert committed(django_db_blocker, lambda: ApiKey.objects.filter(
            project_id=t.project_id, name="on-cluster").count()) == 1

        answer = client_for(cluster_server, plaintext, timeout=30).chat.completions.create(
            model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": "cluster"}])
        assert answer.usage is not None and answer.usage.total_tokens > 0
        # Metered on the cluster: the tenant's keys are there (one hash tag, one slot).
        tagged = [k for k in cluster.scan_iter(match=f"*{tenant_tag(t.tenant_id)}*", count=1000,
                                               target_nodes=redis.RedisCluster.ALL_NODES)]
        assert tagged, "the tenant's counters live on the cluster"

        ready = httpx.get(f"{cluster_server.url}/readyz", timeout=20)
        assert ready.status_code == 200
        assert ready.json() == {"status": "ok", "redis": "ok", "redis_cluster": "ok",
                                "redis_config": "ok", "cache_redis": "ok", "broker": "ok",
                                "database": "ok"}
    finally:
        cache.delete(throttle_key, "tg:cache:1:login-fail:addr:127.0.0.1")
        cache.close()
        cluster.close()
