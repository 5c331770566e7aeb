"""A change of cycle taking effect under concurrent load, on a standalone Redis and on the 3-node
cluster: 4 OS processes x 4 threads reserve a tenant's day and cycle counters for ~3 s, across
the switch of a CycleSchedule (a billing-day month in one time zone, then every 3 days in
another), and end their holds (tests/quotas/cycle_race_worker.py says how).

The two windows before the switch end at it; after it, the first day and the first cycle window
start at it with "@" ids. The limits admit whole holds only (every hold is AMOUNT, settled at 0
or in full), so the counters move by whole holds:
- before the switch the cycle binds: it starts the race with SEED_HOLDS holds' worth used
  earlier in the window, and has OLD_ROOM holds of room, the day more;
- after it the day binds (DAY_HOLDS holds): the new cycle starts empty, with more.

Asserted, exactly:
- every hold's counters are the windows containing its reservation instant (the Redis time the
  script ran at, which is also the hold's creation time), and every refusal is by the binding
  counter of its instant's window, with no room left in it (the window held exactly its limit),
  the other counter reporting its known distance from its own limit;
- at every instant (atomic snapshots all along, with the Redis time) no counter holds more than
  its limit, the day and cycle counters of a window move together, and the windows after the
  switch do not exist before it: no counter is shared across the switch;
- at the end: nothing pending, each window's used is the sum of the actuals of the holds
  reserved in it (holds kept across the switch end in their old windows), the first window
  after the switch ends exactly full; every counter has the TTL of its window plus the grace;
  one usage event per hold (plus the seed's), saying what it cost.
"""
from __future__ import annotations

import multiprocessing
import threading
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis

from quotas import keys
from quotas.engine import EngineSettings, QuotaEngine, ReserveRequest, ScopeLimit
from quotas.windows import Calendar, Cycle, CycleKind, CycleSchedule, Window, WindowKind
from tests.quotas import cycle_race_worker as worker

pytestmark = pytest.mark.slow

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
PROCESSES = 4
THREADS = 4
AMOUNT = 100
DAY_HOLDS = 8  # the day's limit, in holds
CYCLE_HOLDS = 12  # the cycle's limit, in holds
SEED_HOLDS = 6  # used in the old cycle window before the race
OLD_ROOM = CYCLE_HOLDS - SEED_HOLDS  # < DAY_HOLDS: the old cycle binds
LIMITS = (ScopeLimit("tenant", DAY, DAY_HOLDS * AMOUNT),
          ScopeLimit("tenant", MONTH, CYCLE_HOLDS * AMOUNT))
# Redis clock, relative to the switch: the race starts 1.5 s before it; holds reserved in the
# last 0.5 s before it are kept across it; the churn stops 1.5 s after it, then the fill.
START_MS, FILL_MS, STOP_MS = -1_500, -500, 1_500
ZONES = ("America/New_York", "Asia/Tokyo", "Europe/Paris", "Australia/Sydney",
         "America/Los_Angeles", "Asia/Kolkata")

# Test-only, read-only: the Redis time and every counter at one instant (a pipeline would
# interleave with the race's scripts).
SNAPSHOT = """
local t = redis.call('TIME')
local out = { tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) }
for i = 1, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'used', 'pending')
  out[#out + 1] = f[1] or ''
  out[#out + 1] = f[2] or ''
end
return out
"""


def redis_ms(client: redis.Redis | redis.RedisCluster) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def far_from_midnight(now_ms: int, skip: str = "") -> str:
    """A zone whose local midnight (the day's and the cycle's boundaries) is not within ten
    minutes of now: the race must see exactly two windows of each kind."""
    moment = datetime.fromtimestamp(now_ms / 1000, UTC)
    for zone in ZONES:
        local = moment.astimezone(ZoneInfo(zone))
        since = local - local.replace(hour=0, minute=0, second=0, microsecond=0)
        if zone != skip and timedelta(minutes=10) < since < timedelta(hours=23, minutes=50):
            return zone
    raise AssertionError("no zone far from midnight")  # six zones over 14 hours: never


def schedule(now_ms: int, switch_ms: int) -> CycleSchedule:
    old_zone = far_from_midnight(now_ms)
    new_zone = far_from_midnight(now_ms, skip=old_zone)
    return CycleSchedule(Cycle(CycleKind.MONTHLY, date(2026, 1, 15), zone=old_zone),
                         Cycle(CycleKind.DAYS, date(2026, 1, 1), 3, new_zone), switch_ms)


class Windows:
    """The race's four windows: old (ending at the switch) and new (starting at it)."""

    def __init__(self, tenant: str, sched: CycleSchedule) -> None:
        calendar = Calendar(sched)
        switch = sched.switch_ms
        assert switch is not None
        self.tenant = tenant
        self.old = {kind: calendar.window(kind, switch - 1) for kind in (DAY, MONTH)}
        self.new = {kind: calendar.window(kind, switch) for kind in (DAY, MONTH)}
        self.calendar = calendar

    def key(self, window: Window) -> str:
        return keys.counter_key(self.tenant, "tenant", window.id)

    def all(self) -> list[Window]:
        return [self.old[DAY], self.old[MONTH], self.new[DAY], self.new[MONTH]]

    def at(self, now_ms: int) -> tuple[Window, Window]:
        return (self.calendar.window(DAY, now_ms), self.calendar.window(MONTH, now_ms))


def snapshots(client: redis.Redis | redis.RedisCluster, windows: Windows,
              stop: threading.Event) -> list[tuple[int, list[tuple[int, int] | None]]]:
    """Atomic reads of the four counters until `stop`: (Redis ms, per counter (used, pending)
    or None while it does not exist)."""
    names = [windows.key(w) for w in windows.all()]
    found = []
    while not stop.is_set():
        flat = client.eval(SNAPSHOT, len(names), *names)
        counters = [None if flat[1 + 2 * i] == "" else
                    (int(flat[1 + 2 * i]), int(flat[2 + 2 * i]))
                    for i in range(len(names))]
        found.append((int(flat[0]), counters))
        stop.wait(0.003)
    return found


def race(request: pytest.FixtureRequest, kind: str, tenant: str) -> tuple[
        Windows, list[dict[str, Any]], list[tuple[int, list[tuple[int, int] | None]]], int]:
    cluster = kind == "cluster"
    url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
    client = request.getfixturevalue("cluster" if cluster else "standalone")
    engine = QuotaEngine(client)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        ready, go = manager.Barrier(PROCESSES + 1), manager.Barrier(PROCESSES + 1)
        shared = manager.dict()
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
            futures = [pool.submit(worker.run, url, cluster, tenant, w, THREADS, AMOUNT, LIMITS,
                                   ready, go, shared) for w in range(PROCESSES)]
            ready.wait(timeout=120)
            # Every process is up: the switch ~1.5 s from now, on a whole second as
            # quotas.cycles sets them.
            now = redis_ms(client)
            switch = ((now + 1_600) // 1000 + 1) * 1000
            sched = schedule(now, switch)
            windows = Windows(tenant, sched)
            # Used earlier in the old cycle window (not in today's): the old cycle binds.
            seed = engine.reserve(ReserveRequest(tenant, "seed", SEED_HOLDS * AMOUNT,
                                                 (LIMITS[1],), schedule=sched))
            assert seed.admitted and seed.hold.counter_keys == (windows.key(windows.old[MONTH]),)
            engine.settle(seed.hold, SEED_HOLDS * AMOUNT)
            shared.update(schedule=sched, switch_ms=switch, start_ms=switch + START_MS,
                          fill_ms=switch + FILL_MS, stop_ms=switch + STOP_MS)
            stop = threading.Event()
            found: list[Any] = []
            reader = threading.Thread(target=lambda: found.extend(
                snapshots(client, windows, stop)))
            reader.start()
            try:
                go.wait(timeout=60)
                rows = [row for f in futures for row in f.result(timeout=180)]
            finally:
                stop.set()
                reader.join()
    return windows, rows, found, switch


@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_a_cycle_switch_under_concurrent_load_cuts_every_window_exactly(
        request: pytest.FixtureRequest, kind: str, tenant: str) -> None:
    windows, rows, found, switch = race(request, kind, tenant)
    client = request.getfixturevalue("cluster" if kind == "cluster" else "standalone")
    old, new = windows.old, windows.new

    # The windows: the old ones end at the switch, the first new ones start at it with "@" ids;
    # none shares a counter with another.
    for kind_ in (DAY, MONTH):
        assert old[kind_].end_ms == switch and "@" not in old[kind_].id
        assert new[kind_].start_ms == switch and new[kind_].id.endswith(f"@{switch // 1000}")
    assert old[MONTH].id.startswith("c") and new[MONTH].id.startswith("c")
    assert len({windows.key(w) for w in windows.all()}) == 4

    # Every call decided in the windows of its instant; refusals by the binding counter, at
    # exactly its limit. Day and cycle rooms differ by what is known: before the switch the
    # cycle has SEED_HOLDS used and its limit CYCLE_HOLDS, after it both start empty.
    admitted = [r for r in rows if r["admitted"]]
    room_gap = {"old": (DAY_HOLDS - OLD_ROOM) * AMOUNT, "new": (CYCLE_HOLDS - DAY_HOLDS) * AMOUNT}
    per_window: dict[str, Counter[str]] = {"old": Counter(), "new": Counter()}
    for row in rows:
        day, cycle = windows.at(row["server_ms"])
        era = "old" if row["server_ms"] < switch else "new"
        assert (day, cycle) == ((old[DAY], old[MONTH]) if era == "old" else (new[DAY], new[MONTH]))
        assert row["windows"] == [day.id, cycle.id], row
        day_room, cycle_room = row["remaining"]
        if era == "old":
            assert day_room - cycle_room == room_gap["old"], row
        else:
            assert cycle_room - day_room == room_gap["new"], row
        per_window[era]["admitted" if row["admitted"] else "refused"] += 1
        if row["admitted"]:
            assert row["granted"] == AMOUNT and row["created_ms"] == row["server_ms"]
            assert row["keys"] == [windows.key(day), windows.key(cycle)], row
            assert min(day_room, cycle_room) >= 0, row
        else:
            assert row["outcome"] == "quota", row
            binding = MONTH if era == "old" else DAY
            assert row["refused"] == binding.value, row
            # No room at all in it: the window held exactly its limit.
            assert (cycle_room if era == "old" else day_room) == 0, row
    # Enough demand: each window was admitted into and filled to its limit (refusals) before
    # and after the switch.
    assert all(per_window[e]["admitted"] > 0 and per_window[e]["refused"] > 0
               for e in ("old", "new")), per_window

    # Holds kept across the switch, ended in their old windows.
    crossing = [r for r in admitted if r["crossing"]]
    assert crossing and all(switch + FILL_MS <= r["server_ms"] < switch for r in crossing)
    assert {r["end"] for r in admitted} <= {"settled", "released"}
    assert all(r["actual"] in (0, AMOUNT) for r in admitted)

    # At every instant: within the limits, day and cycle of a window together, and no counter
    # of the new windows before the switch.
    assert len(found) > 20, len(found)
    seen_new_before = []
    for now, (old_day, old_cycle, new_day, new_cycle) in found:
        taken = {name: (c[0] + c[1] if c else 0) for name, c in
                 (("od", old_day), ("oc", old_cycle), ("nd", new_day), ("nc", new_cycle))}
        assert old_cycle is not None  # the seed made it
        assert taken["oc"] <= CYCLE_HOLDS * AMOUNT and taken["od"] <= DAY_HOLDS * AMOUNT
        assert taken["nd"] <= DAY_HOLDS * AMOUNT and taken["nc"] <= CYCLE_HOLDS * AMOUNT
        assert taken["oc"] - taken["od"] == SEED_HOLDS * AMOUNT, (now, taken)
        assert taken["nc"] == taken["nd"], (now, taken)
        if now < switch and (new_day is not None or new_cycle is not None):
            seen_new_before.append(now)
    assert seen_new_before == []
    assert any(now < switch for now, _ in found) and any(now >= switch for now, _ in found)

    # The end: nothing open or pending; used = the actuals of the holds reserved in the window.
    engine = QuotaEngine(client)
    assert engine.open_hold_ids(tenant) == []
    used: dict[str, int] = defaultdict(int)
    for row in admitted:
        for key in row["keys"]:
            used[key] += row["actual"]
    used[windows.key(old[MONTH])] += SEED_HOLDS * AMOUNT
    settings = EngineSettings()
    now_s = redis_ms(client) // 1000
    for window in windows.all():
        snap = engine.counter_at(windows.key(window))
        assert (snap.pending, snap.used) == (0, used[windows.key(window)]), (window, snap)
        assert snap.over == 0
        # Its window's end plus the grace (a second of slack for the clock's tick).
        expected_ttl = window.end_ms // 1000 + settings.counter_grace_s - now_s
        assert expected_ttl - 2 <= snap.ttl_s <= expected_ttl, (window, snap.ttl_s)
    # The first window after the switch ends exactly full (the fill), its cycle with it.
    assert used[windows.key(new[DAY])] == DAY_HOLDS * AMOUNT
    assert used[windows.key(new[MONTH])] == DAY_HOLDS * AMOUNT

    # One usage event per hold (and the seed's), saying what it cost, on the Redis clock.
    events: dict[str, list[dict[str, str]]] = defaultdict(list)
    for _, fields in client.xrange(keys.usage_stream_key(tenant)):
        events[fields["request_id"]].append(fields)
    assert set(events) == {r["rid"] for r in admitted} | {"seed"}
    assert [e["actual"] for e in events.pop("seed")] == [str(SEED_HOLDS * AMOUNT)]
    for row in admitted:
        [event] = events[row["rid"]]
        assert (event["outcome"], int(event["actual"]), int(event["held"]),
                int(event["created"])) == (row["end"], row["actual"], AMOUNT, row["server_ms"])
        if row["crossing"]:
            assert int(event["ended"]) >= switch, (row, event)
