"""The circuit-breaker scripts (lua/breaker_record.lua, lua/breaker_probe.lua) through
quotas/breakers.py, on the standalone Redis and the 3-node cluster: opening at the threshold
exactly, half-open after the cool-down, at most N probes however many race for them, closing on
the probes' success, re-opening on a probe's failure."""
from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from quotas import keys
from quotas.breakers import KEY_LEVEL, SLOT_BACK, BreakerRules, BreakerStore, Outcomes

MODEL = "gpt-4o"
RULES = BreakerRules(window_ms=60_000, min_calls=10, error_percent=50, cooldown_ms=60_000,
                     probes=3, lease_ms=60_000)
# A cool-down short enough to wait out in a test.
SHORT = BreakerRules(window_ms=60_000, min_calls=4, error_percent=50, cooldown_ms=200,
                     probes=3, lease_ms=60_000)


def provider_id() -> int:
    return uuid.uuid4().int % 10**9


@pytest.fixture
def store(client: redis.Redis | redis.RedisCluster) -> BreakerStore:
    return BreakerStore(client)


def fail_model(store: BreakerStore, pid: int, rules: BreakerRules, n: int = 1):
    return store.record(pid, MODEL, Outcomes(ok=n), Outcomes(failed=n), rules)


def open_model_breaker(store: BreakerStore, pid: int, rules: BreakerRules) -> None:
    result = fail_model(store, pid, rules, rules.min_calls)
    assert (result.model.transition, result.model.state) == ("opened", "open")


def wait_past_cooldown(rules: BreakerRules) -> None:
    time.sleep(rules.cooldown_ms / 1000 + 0.05)


def test_opens_at_min_calls_exactly_and_not_before(store: BreakerStore) -> None:
    pid = provider_id()
    # 5 successes, then 4 failures: 9 calls, 44 % errors, fewer than min_calls anyway.
    store.record(pid, MODEL, Outcomes(ok=5), Outcomes(ok=5), RULES)
    for _ in range(4):
        result = fail_model(store, pid, RULES)
        assert result.model.state == "closed" and result.model.transition == ""
    assert (result.model.calls, result.model.errors) == (9, 4)
    # The tenth call is a failure: 10 calls, 5 errors = 50 %: open.
    result = fail_model(store, pid, RULES)
    assert (result.model.transition, result.model.state) == ("opened", "open")
    assert (result.model.calls, result.model.errors) == (10, 5)
    assert 0 < result.model.until_ms - result.now_ms <= RULES.cooldown_ms
    # The key's own breaker counted the 5xx answers as transport successes.
    assert (result.key.state, result.key.calls, result.key.errors) == ("closed", 10, 0)


def test_a_high_rate_below_min_calls_does_not_open(store: BreakerStore) -> None:
    pid = provider_id()
    result = store.record(pid, MODEL, Outcomes(failed=9), Outcomes(), RULES)
    assert (result.key.state, result.key.calls, result.key.errors) == ("closed", 9, 9)
    result = store.record(pid, MODEL, Outcomes(failed=1), Outcomes(), RULES)
    assert (result.key.transition, result.key.state) == ("opened", "open")


def test_below_the_error_percent_stays_closed(store: BreakerStore) -> None:
    pid = provider_id()
    store.record(pid, MODEL, Outcomes(ok=11), Outcomes(ok=11), RULES)
    result = fail_model(store, pid, RULES, 10)
    # 21 calls, 10 errors: 47.6 % < 50 %.
    assert (result.model.state, result.model.calls, result.model.errors) == ("closed", 21, 10)


def test_the_window_starts_afresh_after_it_ends(store: BreakerStore) -> None:
    pid = provider_id()
    rules = BreakerRules(window_ms=150, min_calls=4, error_percent=50, cooldown_ms=60_000,
                         probes=1, lease_ms=60_000)
    fail_model(store, pid, rules, 3)
    time.sleep(0.2)
    result = fail_model(store, pid, rules)
    assert (result.model.state, result.model.calls, result.model.errors) == ("closed", 1, 1)


def test_records_while_open_are_ignored(store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, RULES)
    result = fail_model(store, pid, RULES, 5)
    assert (result.model.transition, result.model.state) == ("", "open")
    assert store.record(pid, MODEL, Outcomes(ok=50), Outcomes(ok=50), RULES).model.state == "open"


def test_no_probe_before_the_cooldown_then_half_open(store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, SHORT)
    early = store.probe(pid, MODEL, SHORT)
    assert (early.granted, early.state) == (False, "open")
    assert 0 < early.wait_ms <= SHORT.cooldown_ms
    wait_past_cooldown(SHORT)
    first = store.probe(pid, MODEL, SHORT)
    assert (first.granted, first.transition, first.state) == (True, "half_opened", "half_open")
    second = store.probe(pid, MODEL, SHORT)
    assert (second.granted, second.transition) == (True, "")


def test_the_probes_succeeding_close_it(store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, SHORT)
    wait_past_cooldown(SHORT)
    for _ in range(SHORT.probes):
        assert store.probe(pid, MODEL, SHORT).granted
    transitions = [store.record(pid, MODEL, Outcomes(ok=1), Outcomes(ok=1, probe=True),
                                SHORT).model for _ in range(SHORT.probes)]
    assert [(t.transition, t.state) for t in transitions] == [
        ("", "half_open"), ("", "half_open"), ("closed", "closed")]
    assert store.probe(pid, MODEL, SHORT).state == "closed"  # an ordinary call again
    [key, model] = store.snapshots(pid)
    assert (model.model, model.state, model.opened, model.half_opened, model.closed) == (
        MODEL, "closed", 1, 1, 1)
    assert (key.model, key.state) == (KEY_LEVEL, "closed")


def test_a_failed_probe_reopens_it(store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, SHORT)
    wait_past_cooldown(SHORT)
    assert store.probe(pid, MODEL, SHORT).granted
    store.record(pid, MODEL, Outcomes(ok=1), Outcomes(ok=1, probe=True), SHORT)
    result = store.record(pid, MODEL, Outcomes(ok=1), Outcomes(failed=1, probe=True), SHORT)
    assert (result.model.transition, result.model.state) == ("opened", "open")
    assert result.model.until_ms > result.now_ms
    # A late probe success from the previous half-open period changes nothing.
    late = store.record(pid, MODEL, Outcomes(ok=1), Outcomes(ok=1, probe=True), SHORT)
    assert (late.model.transition, late.model.state) == ("", "open")
    assert not store.probe(pid, MODEL, SHORT).granted
    [_, model] = store.snapshots(pid)
    assert (model.opened, model.half_opened, model.closed) == (2, 1, 0)


def test_the_key_breaker_opens_on_transport_failures_and_probes_alone(
        store: BreakerStore) -> None:
    pid = provider_id()
    result = store.record(pid, MODEL, Outcomes(failed=SHORT.min_calls), Outcomes(), SHORT)
    assert (result.key.transition, result.key.state) == ("opened", "open")
    assert result.model.state == "closed"
    wait_past_cooldown(SHORT)
    assert store.probe(pid, KEY_LEVEL, SHORT).transition == "half_opened"
    closed = store.record(pid, MODEL, Outcomes(ok=1, probe=True), Outcomes(ok=1), SHORT)
    assert closed.key.state == "half_open"  # one of three probes


def test_at_most_n_probes_when_many_race(store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, SHORT)
    wait_past_cooldown(SHORT)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda _: store.probe(pid, MODEL, SHORT), range(200)))
    granted = [r for r in results if r.granted]
    assert len(granted) == SHORT.probes
    assert [r.transition for r in results].count("half_opened") == 1
    assert all(r.wait_ms > 0 for r in results if not r.granted)


def test_slots_without_a_result_are_handed_out_again_after_the_lease(
        store: BreakerStore) -> None:
    pid = provider_id()
    rules = BreakerRules(window_ms=60_000, min_calls=1, error_percent=50, cooldown_ms=100,
                         probes=1, lease_ms=200)
    open_model_breaker(store, pid, rules)
    wait_past_cooldown(rules)
    assert store.probe(pid, MODEL, rules).granted
    assert not store.probe(pid, MODEL, rules).granted
    time.sleep(0.25)
    assert store.probe(pid, MODEL, rules).granted


def test_keys_share_the_provider_keys_slot_and_expire(
        store: BreakerStore, client: redis.Redis | redis.RedisCluster) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, RULES)
    names = [keys.provider_breaker_key(pid), keys.provider_model_breaker_key(pid, MODEL),
             keys.provider_breaker_models_key(pid)]
    assert all(f"{{p{pid}}}" in name for name in names)
    assert all(0 < client.pttl(name) <= 86_400_000 for name in names)
    assert client.smembers(names[2]) == {MODEL}


@pytest.mark.parametrize("bad", [
    dict(window_ms=0), dict(min_calls=0), dict(error_percent=101), dict(probes=0),
    dict(cooldown_ms=1.5),
])
def test_bad_rules_are_refused(bad: dict) -> None:
    fields = dict(window_ms=1, min_calls=1, error_percent=50, cooldown_ms=1, probes=1,
                  lease_ms=1) | bad
    with pytest.raises(ValueError):
        BreakerRules(**fields)


def test_negative_outcomes_are_refused() -> None:
    with pytest.raises(ValueError):
        Outcomes(ok=-1)


def test_a_probe_without_a_result_hands_its_slot_back_and_counts_for_nothing(
        store: BreakerStore) -> None:
    pid = provider_id()
    open_model_breaker(store, pid, SHORT)
    wait_past_cooldown(SHORT)
    for _ in range(SHORT.probes):
        assert store.probe(pid, MODEL, SHORT).granted
    assert not store.probe(pid, MODEL, SHORT).granted  # all three slots out
    # One call gives its slot up (no capacity, client gone, a transport failure for a model
    # probe): it is neither a success nor a failure.
    back = store.record(pid, MODEL, Outcomes(), SLOT_BACK, SHORT)
    assert (back.model.transition, back.model.state) == ("", "half_open")
    for _ in range(SHORT.probes - 1):
        result = store.record(pid, MODEL, Outcomes(), Outcomes(ok=1, probe=True), SHORT)
        assert (result.model.transition, result.model.state) == ("", "half_open")
    # The slot handed back is free at once (not a lease later), and its probe closes it.
    assert store.probe(pid, MODEL, SHORT).granted
    assert not store.probe(pid, MODEL, SHORT).granted
    result = store.record(pid, MODEL, Outcomes(), Outcomes(ok=1, probe=True), SHORT)
    assert (result.model.transition, result.model.state) == ("closed", "closed")


def test_handing_back_a_slot_not_held_changes_nothing(
        store: BreakerStore, client: redis.Redis | redis.RedisCluster) -> None:
    pid = provider_id()
    # Closed (no breaker yet): no hash is made.
    result = store.record(pid, MODEL, SLOT_BACK, SLOT_BACK, SHORT)
    assert (result.key.state, result.model.state) == ("closed", "closed")
    assert client.exists(keys.provider_breaker_key(pid)) == 0
    # Half-open with no slot taken (a lease renewed since): the count stays at 0, not -1.
    open_model_breaker(store, pid, SHORT)
    wait_past_cooldown(SHORT)
    assert store.probe(pid, MODEL, SHORT).granted
    for _ in range(2):
        store.record(pid, MODEL, Outcomes(), SLOT_BACK, SHORT)
    assert client.hget(keys.provider_model_breaker_key(pid, MODEL), "taken") in ("0", b"0")
    assert sum(store.probe(pid, MODEL, SHORT).granted for _ in range(5)) == SHORT.probes
