"""Random sequences of reserve / settle / release / sweep / day changes against the real scripts.

After every step, for every counter ever touched:
    used + pending <= limit + credit   (settled amounts never exceed their hold here)
    pending == the sum of the open holds made in it (tokens, or micro-dollars in the money
    counter of the monthly spend budget)
    no counter is negative
    the usage stream holds exactly one event per ended hold, plus one per corrected sweep
and every reply matches a plain Python model of what the answer must be, including what the sweep
charges (nothing for a hold never forwarded, the whole hold for a forwarded call, the input plus
the last checkpoint for a stream) and the one correction a settle or release after the sweep
makes (the counters then hold the call's real usage).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from quotas import keys
from quotas.engine import (
    UNLIMITED,
    EngineSettings,
    Hold,
    Phase,
    QuotaEngine,
    ReserveRequest,
    ScopeLimit,
    Unit,
)
from quotas.windows import DAILY, UTC_MONTHLY, CycleSchedule, WindowKind

SCOPES = ["tenant", "project:p1", "project:p2", "key:k1", "model:m1"]
limit_values = st.one_of(st.just(UNLIMITED), st.integers(min_value=0, max_value=400))


@dataclass
class Expected:
    limit: int
    used: int = 0
    pending: int = 0
    credit: int = 0
    money: bool = False  # a spend-budget counter: holds the request's money_amount
    # What late settles charged above their sweeps (positive corrections only). The sweep
    # freed the hold's room, a later reserve may have taken it, and the late settle then charges
    # the upstream's real usage all the same (DESIGN.md 3: the ledger converges to it): the one
    # way a counter passes its limit without any reserve admitting past it.
    corrected_over: int = 0


_RANK = {Phase.RESERVED: 0, Phase.FORWARDED: 1, Phase.STREAMING: 2}


@dataclass
class OpenHold:
    hold: Hold
    input_tokens: int
    price_in: int
    price_out: int
    open: bool = True
    phase: Phase = Phase.RESERVED
    progress: int = 0
    swept: bool = False  # ended by the sweep, with `charged` / `charged_money`
    corrected: bool = False  # a late settle or release has corrected the sweep
    charged: int = 0
    charged_money: int = 0

    def sweep_charge(self) -> tuple[int, int]:
        """What lua/sweep.lua must charge: (tokens, micro-dollars)."""
        amount = self.hold.amount
        tokens_in = min(self.input_tokens, amount)
        if self.phase is Phase.FORWARDED:
            tokens_out = amount - tokens_in
        elif self.phase is Phase.STREAMING:
            tokens_out = min(self.progress, amount - tokens_in)
        else:
            tokens_in = tokens_out = 0
        micros = (tokens_in * self.price_in + tokens_out * self.price_out + 500_000) // 1_000_000
        return tokens_in + tokens_out, micros


class QuotaMachine(RuleBasedStateMachine):
    client: redis.Redis  # set by the test below
    holds = Bundle("holds")

    def __init__(self) -> None:
        super().__init__()
        self.tenant = uuid.uuid4().hex[:12]
        self.engine = QuotaEngine(self.client, EngineSettings(tombstone_s=600, sweep_batch=7))
        # A change of cycle that took effect a moment ago is how a test makes "tomorrow" arrive
        # on a Redis clock it cannot set: every window ends there and new ones (ids of their own)
        # start, exactly as at a real midnight (next_day).
        self.schedule = UTC_MONTHLY
        self.days = 0
        self.counters: dict[str, Expected] = {}
        self.open: dict[str, OpenHold] = {}
        self.n = 0
        self.ended = 0

    @initialize(
        day=st.fixed_dictionaries({s: limit_values for s in SCOPES}),
        month=st.one_of(st.just(UNLIMITED), st.integers(min_value=0, max_value=1500)),
        budget=st.one_of(st.just(UNLIMITED), st.integers(min_value=0, max_value=3000)),
    )
    def set_limits(self, day: dict[str, int], month: int, budget: int) -> None:
        self.day_limits = day
        self.month_limit = month
        self.budget = budget

    def _limits(self, scopes: list[str]) -> tuple[ScopeLimit, ...]:
        chosen = [ScopeLimit(s, WindowKind.DAY, self.day_limits[s]) for s in scopes]
        return (*chosen, ScopeLimit("tenant", WindowKind.MONTH, self.month_limit),
                ScopeLimit("tenant", WindowKind.MONTH, self.budget, Unit.MICROS))

    @rule(
        target=holds,
        scopes=st.lists(st.sampled_from(SCOPES), min_size=1, max_size=5, unique=True),
        amount=st.integers(min_value=1, max_value=150),
        input_tokens=st.integers(min_value=0, max_value=150),
        price_in=st.integers(min_value=0, max_value=2_500_000),
        price_out=st.integers(min_value=0, max_value=2_500_000),
        shrink=st.booleans(),
        dry_run=st.booleans(),
    )
    def reserve(self, scopes: list[str], amount: int, input_tokens: int, price_in: int,
                price_out: int, shrink: bool, dry_run: bool) -> OpenHold | None:
        self.n += 1
        min_amount = max(1, amount // 3) if shrink else None
        # As the gateway holds it: every token at the dearer price, so any charge fits.
        money = -(-amount * max(price_in, price_out) // 1_000_000)
        request = ReserveRequest(
            self.tenant, f"r{self.n}", amount, self._limits(scopes), min_amount=min_amount,
            dry_run=dry_run, schedule=self.schedule, money_amount=money,
            input_tokens=input_tokens, price_in=price_in, price_out=price_out,
        )
        result = self.engine.reserve(request)

        is_money = [c.key.split(":q:")[1].startswith("tenant:usd:") for c in result.counters]
        expected = [self.counters.get(c.key) or Expected(c.limit, money=m)
                    for c, m in zip(result.counters, is_money, strict=True)]
        room = [(e.limit + e.credit - e.used - e.pending, m)
                for e, c, m in zip(expected, result.counters, is_money, strict=True) if c.limit != UNLIMITED]
        token_rooms = [h for h, m in room if not m]
        tightest = min(token_rooms) if token_rooms else None
        floor = min_amount or amount
        should_admit = ((tightest is None or tightest >= floor)
                        and all(h >= money for h, m in room if m))
        assert result.admitted == should_admit, (result, expected)
        if not result.admitted:
            return None
        assert result.granted == (amount if tightest is None else min(amount, tightest))
        if dry_run:
            assert result.hold is None
            return None
        for c, m in zip(result.counters, is_money, strict=True):
            e = self.counters.setdefault(c.key, Expected(c.limit, money=m))
            e.limit = c.limit
            e.pending += money if m else result.granted
        entry = OpenHold(result.hold, input_tokens, price_in, price_out)
        self.open[result.request_id] = entry
        return entry

    @rule(entry=holds, phase=st.sampled_from([Phase.FORWARDED, Phase.STREAMING]),
          tokens=st.integers(min_value=0, max_value=200))
    def progress(self, entry: OpenHold | None, phase: Phase, tokens: int) -> None:
        if entry is None:
            return
        state = self.engine.progress(entry.hold, phase, tokens)
        assert (state == "open") == entry.open, (state, entry)
        if entry.open:
            if _RANK[phase] > _RANK[entry.phase]:
                entry.phase = phase
            entry.progress = max(entry.progress, tokens)

    def _correct(self, entry: OpenHold, actual: int, actual_money: int) -> None:
        """A settle (or a release: 0, 0) after the sweep: the difference, once."""
        for key in entry.hold.counter_keys:
            e = self.counters[key]
            difference = (actual_money - entry.charged_money) if e.money else (actual - entry.charged)
            e.used += difference
            e.corrected_over += max(0, difference)
        entry.corrected = True
        self.ended += 1  # its "corrected" event

    def _end(self, entry: OpenHold, used: int | None, used_money: int = 0) -> None:
        for key in entry.hold.counter_keys:
            e = self.counters[key]
            e.pending -= entry.hold.money_amount if e.money else entry.hold.amount
            if used is not None:
                e.used += used_money if e.money else used
        entry.open = False
        self.open.pop(entry.hold.request_id, None)
        self.ended += 1

    @rule(entry=holds, fraction=st.floats(min_value=0, max_value=1))
    def settle(self, entry: OpenHold | None, fraction: float) -> None:
        if entry is None:
            return
        actual = int(entry.hold.amount * fraction)
        actual_money = int(entry.hold.money_amount * fraction)
        was_open = entry.open
        late = entry.swept and not entry.corrected
        result = self.engine.settle(entry.hold, actual, actual_money=actual_money)
        assert (result.outcome == "settled" and result.held > 0) == was_open
        assert result.corrected == late, (result, entry)
        if was_open:
            self._end(entry, actual, actual_money)
        elif late:
            assert result.charged == actual - entry.charged
            self._correct(entry, actual, actual_money)

    @rule(entry=consumes(holds))
    def release(self, entry: OpenHold | None) -> None:
        if entry is None:
            return
        was_open = entry.open
        late = entry.swept and not entry.corrected
        result = self.engine.release(entry.hold)
        assert result.applied == was_open
        assert result.corrected == late, (result, entry)
        if was_open:
            self._end(entry, None)
        elif late:
            assert result.released == entry.charged
            self._correct(entry, 0, 0)

    @rule()
    def sweep_everything_stale(self) -> None:
        time.sleep(0.002)  # every open hold is now at least 1 ms old on the Redis clock
        result = self.engine.sweep(self.tenant, stale_s=0, max_batches=100)
        assert {h.request_id for h in result.swept} == set(self.open)
        by_id = {h.request_id: h for h in result.swept}
        for entry in list(self.open.values()):
            charged, charged_money = entry.sweep_charge()
            swept = by_id[entry.hold.request_id]
            assert (swept.charged, swept.basis) == (charged, entry.phase.value), (swept, entry)
            entry.swept, entry.charged, entry.charged_money = True, charged, charged_money
            self._end(entry, charged, charged_money)

    @rule(amount=st.integers(min_value=1, max_value=100))
    def recharge_tenant(self, amount: int) -> None:
        limit = ScopeLimit("tenant", WindowKind.DAY, self.day_limits["tenant"])
        result = self.engine.recharge(self.tenant, limit, amount, schedule=self.schedule)
        key = self.engine._calls.counter_key_now(self.tenant, "tenant", WindowKind.DAY,
                                                 self.schedule)
        e = self.counters.setdefault(key, Expected(limit.limit))
        e.credit += amount
        assert result.credit == e.credit

    @rule()
    def next_day(self) -> None:
        # Switched a whole number of seconds ago, one second earlier each time: every switch
        # names its first windows differently (their ids carry the switch's second).
        self.days += 1
        seconds, _ = self.client.time()
        switch_ms = (int(seconds) - self.days) * 1000
        self.schedule = CycleSchedule(UTC_MONTHLY.current, DAILY, switch_ms)

    @invariant()
    def counters_match_the_model_and_never_overdraw(self) -> None:
        for key, e in self.counters.items():
            snap = self.engine.counter_at(key)
            assert (snap.used, snap.pending, snap.credit) == (e.used, e.pending, e.credit), key
            assert snap.used >= 0 and snap.pending >= 0
            if e.limit != UNLIMITED:
                # No reserve admits past the limit (checked exactly at each reserve, above); a late
                # settle's correction may, by what it charged above its sweep.
                assert snap.used + snap.pending <= e.limit + e.credit + e.corrected_over, key

    @invariant()
    def pending_equals_the_sum_of_open_holds(self) -> None:
        per_key: dict[str, int] = {}
        for entry in self.open.values():
            for key in entry.hold.counter_keys:
                held = entry.hold.money_amount if self.counters[key].money else entry.hold.amount
                per_key[key] = per_key.get(key, 0) + held
        for key in self.counters:
            assert self.engine.counter_at(key).pending == per_key.get(key, 0)
        assert sorted(self.engine.open_hold_ids(self.tenant)) == sorted(self.open)

    @invariant()
    def one_usage_event_per_ended_hold(self) -> None:
        assert self.client.xlen(keys.usage_stream_key(self.tenant)) == self.ended


@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_quota_state_machine(request: pytest.FixtureRequest, kind: str) -> None:
    QuotaMachine.client = request.getfixturevalue(kind)
    runner = QuotaMachine.TestCase
    runner.settings = settings(
        max_examples=60 if kind == "standalone" else 25,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    runner().runTest()
