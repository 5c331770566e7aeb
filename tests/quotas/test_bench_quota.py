"""bench_quota with allotment chains (a Redis of the test's own: the command resets its
INFO commandstats): a request with chains costs no extra round trip, and the chains it fed hold
exactly what its calls settled."""
from __future__ import annotations

import redis

from quotas.management.commands.bench_quota import measure, request_limits, script_times
from quotas.engine import Unit
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture


def test_chains_add_no_round_trip_and_hold_what_was_settled(
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    limits = request_limits("key")
    assert [(s.scope, s.unit) for s in limits if s.unit.tiered] == [
        ("key:1", Unit.ALLOTMENT), ("project:1", Unit.ALLOTMENT), ("tenant", Unit.POOL)] * 2
    for allotments in ("none", "key"):
        # First, as the command does: it loads both scripts into the new server.
        alone = script_times(private_redis.url, 20, allotments)
        assert alone["reserve_us"] > 0 and alone["settle_us"] > 0
        figures = measure(private_redis.url, 400, 4, 1, allotments)
        # One reserve and one settle per request, chains or not (and the INFO that reads the
        # server's time).
        assert round(figures["round_trips"] * 400) == 2 * 400 + 1

    client: redis.Redis = private_redis.client()
    pools = [k for k in client.scan_iter(match="tg:*:pool:*")]
    # Two runs with chains (the measure's and the script times'), each in a day and a cycle
    # window. Allotments of 1: every call spilled to the pool all it kept after settling.
    assert len(pools) == 4
    totals = sorted(int(client.hget(k, "taken")) for k in pools)
    # The pool takes all but the two tiers' 1 token each: script_times settled its warm-up
    # call at 5 and 20 calls at 700; measure left its 4 warm-up holds of 10 open and settled
    # 400 calls at 700.
    assert totals == [5 + 20 * 700 - 2] * 2 + [4 * 10 + 400 * 700 - 2] * 2
    client.close()
