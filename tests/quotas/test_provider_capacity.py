"""Supply side: an upstream provider key's RPM / TPM capacity, taken atomically per call."""
from __future__ import annotations

import uuid

import pytest
import redis

from quotas.engine import UNLIMITED, QuotaEngine


def provider_id() -> int:
    return uuid.uuid4().int % 10**9


def test_rpm_capacity_refuses_the_request_beyond_it_and_refills(engine: QuotaEngine) -> None:
    pid = provider_id()
    taken = [engine.take_capacity(pid, 3, None, 100) for _ in range(4)]
    assert [t.taken for t in taken] == [True, True, True, False]
    assert [t.requests_left for t in taken[:3]] == [2, 1, 0]
    assert taken[0].tokens_left == UNLIMITED
    assert 0 < taken[3].retry_after_ms <= 20_000  # a third of a minute refills one request


def test_tpm_capacity_counts_the_held_tokens_and_takes_all_or_nothing(engine: QuotaEngine) -> None:
    pid = provider_id()
    assert engine.take_capacity(pid, 100, 1000, 700).tokens_left == 300
    refused = engine.take_capacity(pid, 100, 1000, 400)
    assert not refused.taken and refused.retry_after_ms > 0
    # Nothing was taken by the refusal: the request bucket still has 99 (one minute refills 100).
    assert engine.take_capacity(pid, 100, 1000, 300).requests_left in (98, 99)


def test_a_call_larger_than_the_whole_tpm_passes_on_a_full_bucket(engine: QuotaEngine) -> None:
    pid = provider_id()
    assert engine.take_capacity(pid, None, 1000, 5000).taken
    assert not engine.take_capacity(pid, None, 1000, 5000).taken


def test_capacity_keys_expire_a_minute_after_the_last_call(engine: QuotaEngine,
                                                           client: redis.Redis) -> None:
    pid = provider_id()
    engine.take_capacity(pid, 10, 10, 1)
    assert 0 < client.pttl(f"tg:{{p{pid}}}:cap") <= 60_000


@pytest.mark.parametrize("bad", [(0, None, 1), (None, -5, 1), (None, None, -1), (1.5, None, 1)])
def test_bad_capacity_arguments_are_refused(engine: QuotaEngine, bad: tuple) -> None:
    with pytest.raises(ValueError):
        engine.take_capacity(provider_id(), *bad)


def test_concurrent_takes_never_exceed_the_capacity(engine: QuotaEngine) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pid = provider_id()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: engine.take_capacity(pid, 25, None, 1).taken,
                                range(200)))
    # 25 per minute refills one request every 2.4 s; the 200 calls take far less.
    assert sum(results) == 25
