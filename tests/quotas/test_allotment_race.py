"""Allotments under a race, on a standalone Redis and on the 3-node cluster: OS processes of
concurrent tasks reserve through the chains quotas.limits.allotment_chain builds (a key's
allotment, its project's, the tenant's shared pool; for the day and the cycle at once) and end
their holds every way a call ends (settled below, at, above its hold or at zero; released;
abandoned and swept, a sweeper running meanwhile, so some settles come after the sweep).

Asserted, from atomic snapshots taken all along the race (one script call reads every counter
of the tenant's slot at one instant):
- the chains agree with the counters at every instant: a tier's `taken` is its scope's
  used + pending minus what its allotted keys keep within their allotments, and the pool's is
  the tenant's used + pending minus what the top-level tiers keep within theirs;
- what is granted never exceeds a quota: the tenant's used + pending - over (what overruns
  added) never exceeds its quota; a project without an allotment never holds more than the pool
  plus its keys' own allotments: it never gets a token of another's unused allotment (a late
  settle after a sweep may add what the sweep had given back: that allowance is counted);
and at the end, from the processes' own record of every hold: nothing pending, each counter's
used is the sum of its calls' charges, each tier's taken and the pool's are those charges passed
up the chain (pool = the sum over scopes of max(0, taken - allotment), exactly), one usage
event (a swept one: two) per hold saying the same.

The protection race: while the unprotected project floods the tenant (reserving, shrinkable,
until refused, every hold kept open), the protected project asks for exactly its allotment:
every one of its calls is admitted, the flood gets exactly what the pool (and its own keys'
allotments) hold and not a token more, and the protected project can still borrow what the
flood left in a window's pool.
"""
from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from quotas import keys
from quotas.engine import UNLIMITED, QuotaEngine, ReserveRequest, ScopeLimit, Unit
from quotas.limits import allotment_chain
from quotas.windows import WindowKind
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import AllotmentSums
from tests.quotas import allotment_race_worker as worker

pytestmark = pytest.mark.slow

DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
WINDOWS = (DAY, MONTH)
PROCESSES = 4


# -- the tenant's shape ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A tenant's quotas and allotments per window. Project "A" is the protected one; keys are
    named after their project ("a1" is a key of A)."""

    quota: dict[WindowKind, int]
    projects: dict[str, dict[WindowKind, int]]  # name -> its allotments (absent: none)
    keys: dict[str, tuple[str, dict[WindowKind, int]]]  # name -> (project, its allotments)
    # How often each key calls in the chaos race (1 when not given).
    weights: dict[str, int] = field(default_factory=dict)

    # scopes
    def pk(self, name: str) -> int:
        return (sorted(self.projects).index(name) + 1 if name in self.projects
                else 100 + sorted(self.keys).index(name))

    def scope(self, name: str) -> str:
        return (keys.project_scope(self.pk(name)) if name in self.projects
                else keys.api_key_scope(self.pk(name)))

    def keys_of(self, project: str) -> list[str]:
        return sorted(k for k, (p, _) in self.keys.items() if p == project)

    def project_of(self, key: str) -> str:
        return self.keys[key][0]

    # allotments
    def own(self, name: str, w: WindowKind) -> int:
        table = self.projects[name] if name in self.projects else self.keys[name][1]
        return table.get(w, 0)

    def top_allotted(self, w: WindowKind) -> int:
        """The projects' allotments and those of keys whose project has none."""
        return (sum(self.own(p, w) for p in self.projects)
                + sum(self.own(k, w) for k in self.keys if not self.own(self.project_of(k), w)))

    def chained(self, w: WindowKind) -> bool:
        return self.quota[w] != UNLIMITED and self.top_allotted(w) > 0

    def pool(self, w: WindowKind) -> int:
        return max(0, self.quota[w] - self.top_allotted(w))

    def tier_allot(self, name: str, w: WindowKind) -> int:
        """A key's allotment; a project's own part (its allotment minus its keys')."""
        if name in self.keys:
            return self.own(name, w)
        return max(0, self.own(name, w) - sum(self.own(k, w) for k in self.keys_of(name)))

    def tiers(self, w: WindowKind) -> list[str]:
        return [n for n in [*self.projects, *self.keys] if self.own(n, w)]

    def parent(self, name: str, w: WindowKind) -> str | None:
        """The tier a tier passes its excess to; None: the pool."""
        if name in self.keys and self.own(self.project_of(name), w):
            return self.project_of(name)
        return None

    def top_tiers_of(self, project: str, w: WindowKind) -> list[str]:
        """The tiers of a project that spill into the pool: its own, else its keys'."""
        if self.own(project, w):
            return [project]
        return [k for k in self.keys_of(project) if self.own(k, w)]

    def expected_taken(self, w: WindowKind, charge: dict[str, int]) -> dict[str | None, int]:
        """Each tier's `taken` (and the pool's, under None) when each key's calls were charged
        `charge[key]`: a tier takes what its callers and child tiers pass it and passes on
        max(0, taken - allotment)."""
        taken: dict[str | None, int] = defaultdict(int)
        for key, total in charge.items():
            name: str | None = key
            passed = total
            if not self.own(key, w):  # no tier: straight to its project's, or to the pool
                name = self.project_of(key) if self.own(self.project_of(key), w) else None
            taken[name] += passed
        for key in self.keys:  # keys spill first, into their project's tier or the pool
            if self.own(key, w):
                taken[self.parent(key, w)] += max(0, taken[key] - self.tier_allot(key, w))
        for project in self.projects:
            if self.own(project, w):
                taken[None] += max(0, taken[project] - self.tier_allot(project, w))
        return {n: taken[n] for n in [*self.tiers(w), None]}

    # what reserve is given
    def limits(self, key: str) -> tuple[ScopeLimit, ...]:
        """A call of `key`: the tenant's day and cycle counters, its project's and its own
        (unlimited, to count them), then the chains quotas.limits builds for the gateway."""
        project = self.project_of(key)
        found = [ScopeLimit("tenant", w, self.quota[w]) for w in WINDOWS]
        found += [ScopeLimit(self.scope(n), w, UNLIMITED) for n in (project, key) for w in WINDOWS]
        tenant, projects, api_keys = self.django_rows()
        limits = SimpleNamespace(tokens_per_day=self.quota[DAY],
                                 monthly_token_budget=self.quota[MONTH])
        sums = AllotmentSums(
            tenant_day=self.top_allotted(DAY), tenant_month=self.top_allotted(MONTH),
            project_keys_day=sum(self.own(k, DAY) for k in self.keys_of(project)),
            project_keys_month=sum(self.own(k, MONTH) for k in self.keys_of(project)))
        for w in WINDOWS:
            found += [c.scope_limit for c in allotment_chain(
                tenant, limits, projects[project], api_keys[key], w, sums)]
        return tuple(found)

    def django_rows(self) -> tuple[Tenant, dict[str, Project], dict[str, ApiKey]]:
        """Unsaved rows with this shape's allotments (allotment_chain reads only their fields)."""
        tenant = Tenant(pk=1, public_id="ten_race", slug="race", name="race")
        projects = {p: Project(pk=self.pk(p), public_id=f"prj_{p}", slug=p, name=p, tenant=tenant,
                               allotment_tokens_per_day=self.projects[p].get(DAY),
                               allotment_tokens_per_month=self.projects[p].get(MONTH))
                    for p in self.projects}
        api_keys = {k: ApiKey(pk=self.pk(k), public_id=f"key_{k}", name=k,
                              project=projects[self.project_of(k)],
                              allotment_tokens_per_day=self.keys[k][1].get(DAY),
                              allotment_tokens_per_month=self.keys[k][1].get(MONTH))
                    for k in self.keys}
        return tenant, projects, api_keys

    def callers(self) -> dict[str, tuple[ScopeLimit, ...]]:
        return {k: self.limits(k) for k in self.keys}


SHAPES = {
    # A allotted 16,000 of a 30,000 daily quota; B has none: its pool is 14,000. No cycle budget
    # (no cycle chain). B calls twice as often: the noisy neighbour, refused by the pool while
    # the tenant's counter still has A's unused allotment.
    "project": Shape(
        quota={DAY: 30_000, MONTH: UNLIMITED},
        projects={"A": {DAY: 16_000}, "B": {}},
        keys={"a1": ("A", {}), "b1": ("B", {})},
        weights={"b1": 2},
    ),
    # Every chain shape at once, and two chains per call. Day: A 12,000 of which its key a1
    # 6,000 (A's own part 6,000); b1 (of B, which has none) 4,000 at the top level; pool 14,000.
    # Cycle (binding: below the daily quota): A 15,000 (a1 none), b1 6,000; pool 5,000.
    "keys": Shape(
        quota={DAY: 30_000, MONTH: 26_000},
        projects={"A": {DAY: 12_000, MONTH: 15_000}, "B": {}},
        keys={"a1": ("A", {DAY: 6_000}), "a2": ("A", {}),
              "b1": ("B", {DAY: 4_000, MONTH: 6_000}), "b2": ("B", {})},
    ),
}


# -- reading the tenant's slot at one instant --------------------------------------------------------

# Test-only, read-only: one script call reads every hash at the same instant (a pipeline would
# interleave with the race's scripts).
SNAPSHOT = """
local out = {}
for i = 1, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'used', 'pending', 'over', 'taken', 'allot', 'limit')
  for j = 1, 6 do out[#out + 1] = f[j] or '' end
end
return out
"""
FIELDS = ("used", "pending", "over", "taken", "allot", "limit")


@dataclass(frozen=True)
class Slot:
    """The keys of one tenant's counters, tiers and pools in the race's windows."""

    tenant: str
    shape: Shape
    window_ids: dict[WindowKind, str]

    def counter(self, name: str | None, w: WindowKind) -> str:
        scope = "tenant" if name is None else self.shape.scope(name)
        return keys.counter_key(self.tenant, scope, self.window_ids[w])

    def tier(self, name: str | None, w: WindowKind) -> str:
        if name is None:
            return keys.pool_key(self.tenant, self.window_ids[w])
        return keys.allotment_key(self.tenant, self.shape.scope(name), self.window_ids[w])

    def all_keys(self) -> list[str]:
        found = []
        for w in WINDOWS:
            found += [self.counter(n, w) for n in [None, *self.shape.projects, *self.shape.keys]]
            if self.shape.chained(w):
                found += [self.tier(n, w) for n in [*self.shape.tiers(w), None]]
        return found

    def read(self, client: redis.Redis | redis.RedisCluster) -> dict[str, dict[str, int]]:
        names = self.all_keys()
        flat = client.eval(SNAPSHOT, len(names), *names)
        return {name: {f: int(flat[6 * i + j]) if flat[6 * i + j] != "" else 0
                       for j, f in enumerate(FIELDS)}
                for i, name in enumerate(names)}


def inconsistencies(slot: Slot, snap: dict[str, dict[str, int]]) -> list[str]:
    """Where the chains disagree with the counters in one snapshot."""
    shape, found = slot.shape, []
    for w in WINDOWS:
        if not shape.chained(w):
            continue

        def held(name: str | None) -> int:
            c = snap[slot.counter(name, w)]
            return c["used"] + c["pending"]

        def kept(name: str) -> int:  # what a tier keeps within its allotment
            t = snap[slot.tier(name, w)]
            return min(t["taken"], shape.tier_allot(name, w))

        for name in shape.tiers(w):
            children = [k for k in shape.keys if shape.own(k, w) and shape.parent(k, w) == name]
            # Its scope's calls all come in (a key's through its own tier, which passes on
            # only what it takes beyond its allotment).
            expected = held(name) - sum(kept(k) for k in children)
            if snap[slot.tier(name, w)]["taken"] != expected:
                found.append(f"{w.value} tier {name}: taken {snap[slot.tier(name, w)]['taken']} "
                             f"!= {expected}")
        # Every tier keeps its part within its allotment; the rest reaches the pool.
        expected_pool = held(None) - sum(kept(t) for t in shape.tiers(w))
        if snap[slot.tier(None, w)]["taken"] != expected_pool:
            found.append(f"{w.value} pool: taken {snap[slot.tier(None, w)]['taken']} != "
                         f"{expected_pool}")
    return found


def granted_now(slot: Slot, snap: dict[str, dict[str, int]], name: str | None,
                w: WindowKind) -> int:
    """used + pending - over: what reserves granted and ends left charged, overruns aside."""
    c = snap[slot.counter(name, w)]
    return c["used"] + c["pending"] - c["over"]


def bound(shape: Shape, name: str | None, w: WindowKind) -> int:
    """The most a scope may be granted: the tenant its quota; a project the pool plus its own
    top-level allotments (never another's)."""
    if name is None:
        return shape.quota[w]
    return shape.pool(w) + sum(shape.own(t, w) for t in shape.top_tiers_of(name, w))


class Monitor:
    """Snapshots the slot in a loop while the race runs (a thread of the test process): every
    inconsistency, and per (scope, window) the most ever granted."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, slot: Slot) -> None:
        self.client, self.slot = client, slot
        self.snapshots = 0
        self.problems: list[str] = []
        self.peak: dict[tuple[str | None, WindowKind], int] = defaultdict(int)

    def take(self) -> dict[str, dict[str, int]]:
        snap = self.slot.read(self.client)
        self.snapshots += 1
        if len(self.problems) < 20:
            self.problems += inconsistencies(self.slot, snap)
        for w in WINDOWS:
            for name in [None, *self.slot.shape.projects]:
                key = (name, w)
                self.peak[key] = max(self.peak[key], granted_now(self.slot, snap, name, w))
        return snap


@contextmanager
def running(*loops: Callable[[], None], pause: float) -> Iterator[None]:
    """Run each loop body repeatedly on its own thread until the block ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(body: Callable[[], None]) -> None:
        try:
            while not stop.is_set():
                body()
                stop.wait(pause)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(body,), daemon=True) for body in loops]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors, errors


# -- the end state --------------------------------------------------------------------------------


def final_charge(row: dict[str, Any], swept: dict[str, int]) -> int:
    """What a hold finally cost: its settle's actual (a late one corrects the sweep's charge),
    0 for a release, the sweep's charge for an abandoned hold."""
    if row["end"] == "abandoned":
        return swept[row["rid"]]
    return row["actual"]


def assert_ended_exactly(client: redis.Redis | redis.RedisCluster, slot: Slot,
                         rows: list[dict[str, Any]], swept: dict[str, int]) -> None:
    shape = slot.shape
    engine = QuotaEngine(client)
    admitted = [r for r in rows if r["admitted"]]
    assert engine.open_hold_ids(slot.tenant) == []
    # Every hold was made in the race's windows (a run across midnight would say so here).
    assert {k for r in admitted for k in r["keys"]} <= set(slot.all_keys())

    charge = defaultdict(int)
    for row in admitted:
        charge[row["caller"]] += final_charge(row, swept)
    # Every counter, tier and pool expires (with its window and grace): none is left forever.
    for key in slot.all_keys():
        assert client.ttl(key) > 0, (key, client.ttl(key))
    snap = slot.read(client)
    assert inconsistencies(slot, snap) == []
    for w in WINDOWS:
        # Nothing pending; each counter's used is the sum of its calls' charges.
        for name in [None, *shape.projects, *shape.keys]:
            callers = (list(shape.keys) if name is None else shape.keys_of(name)
                       if name in shape.projects else [name])
            counter = snap[slot.counter(name, w)]
            assert counter["pending"] == 0, (name, w)
            assert counter["used"] == sum(charge[k] for k in callers), (name, w)
        if not shape.chained(w):
            continue
        # The chains: every tier's taken is its callers' charges passed up the chain; the pool
        # is the sum over the scopes of max(0, taken - allotment), exactly.
        expected = shape.expected_taken(w, {k: charge[k] for k in shape.keys})
        for name, taken in expected.items():
            tier = snap[slot.tier(name, w)]
            assert tier["taken"] == taken, (w, name, tier, expected)
            if name is None:
                assert tier["limit"] == shape.pool(w)
            else:
                assert tier["allot"] == shape.tier_allot(name, w)

    # One usage event per hold (a swept hold a second one when its late end corrected it),
    # saying what it cost.
    events = defaultdict(list)
    for _, fields in client.xrange(keys.usage_stream_key(slot.tenant)):
        events[fields["request_id"]].append(fields)
    assert set(events) == {r["rid"] for r in admitted}
    for row in admitted:
        outcomes = [e["outcome"] for e in events[row["rid"]]]
        last = events[row["rid"]][-1]
        assert int(last["actual"]) == final_charge(row, swept), (row, outcomes)
        if row["end"] == "abandoned":
            assert outcomes == ["swept"]
        elif row["end"] == "corrected":
            assert outcomes == ["swept", "corrected"]
            assert int(events[row["rid"]][0]["actual"]) == row["swept_charge"] == swept[row["rid"]]
        else:
            assert outcomes == [row["end"]]


def window_ids(engine: QuotaEngine) -> dict[WindowKind, str]:
    return {w: engine.current_window(w).id for w in WINDOWS}


def url_and_client(request: pytest.FixtureRequest, kind: str) -> tuple[str, Any]:
    cluster = kind == "cluster"
    return (request.getfixturevalue("redis_cluster_url" if cluster else "redis_url"),
            request.getfixturevalue("cluster" if cluster else "standalone"))


# -- 1. the chaos race ----------------------------------------------------------------------------

TASKS = 16  # per process
ROUNDS = 30  # reservations per task: 1,920 in all
MAX_AMOUNT = 100


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_chains_stay_exact_under_a_race_of_every_ending(
    request: pytest.FixtureRequest, kind: str, shape_name: str, tenant: str
) -> None:
    shape = SHAPES[shape_name]
    url, client = url_and_client(request, kind)
    engine = QuotaEngine(client)
    slot = Slot(tenant, shape, window_ids(engine))
    monitor = Monitor(client, slot)
    swept: dict[str, int] = {}
    sweeper = QuotaEngine(client)

    def sweep() -> None:
        # Holds older than a second: the abandoned ones, and now and then (on a loaded
        # machine) a live one, whose end then corrects the sweep's charge.
        for hold in sweeper.sweep(tenant, stale_s=1).swept:
            swept[hold.request_id] = hold.charged

    ctx = multiprocessing.get_context("spawn")
    callers = shape.callers()
    started = time.monotonic()
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool, \
                running(monitor.take, sweep, pause=0.005):
            futures = [pool.submit(worker.chaos, url, kind == "cluster", tenant, w, TASKS,
                                   ROUNDS, MAX_AMOUNT, callers, shape.weights, barrier,
                                   seed=len(tenant) + w)
                       for w in range(PROCESSES)]
            rows = [row for f in futures for row in f.result(timeout=300)]
    for hold in engine.sweep(tenant, stale_s=0).swept:  # what the dead processes left
        swept[hold.request_id] = hold.charged
    elapsed = time.monotonic() - started

    assert len(rows) == PROCESSES * TASKS * ROUNDS
    admitted = [r for r in rows if r["admitted"]]
    refused = [r for r in rows if not r["admitted"]]
    # The race had something to decide: calls admitted whole and shrunk, refusals by the pool
    # and by the tenant's counters, and every way of ending.
    assert any(r["granted"] < r["amount"] for r in admitted)
    assert {r["end"] for r in admitted} >= {"settled", "released", "abandoned", "corrected"}
    assert {r["refused"][1] for r in refused} >= {Unit.POOL.value}, refused[:3]
    # Every refusal is a full token quota: the tenant's, or a chain's pool.
    assert all(r["outcome"] == "quota" and (r["refused"][0], r["refused"][1]) in
               {("tenant", Unit.TOKENS.value), ("tenant", Unit.POOL.value)} for r in refused)

    assert monitor.snapshots >= 20, (monitor.snapshots, elapsed)
    assert monitor.problems == []
    # Never granted beyond a bound (the late ends of live holds a sweep took may add what the
    # sweep gave back to the others: counted per scope).
    allowance: dict[str | None, int] = defaultdict(int)
    for row in admitted:
        if row["swept_charge"] is not None and row["end"] == "corrected":
            extra = max(0, min(row["actual"], row["granted"]) - row["swept_charge"])
            allowance[None] += extra
            allowance[shape.project_of(row["caller"])] += extra
    for (name, w), peak in monitor.peak.items():
        if name is None and shape.quota[w] == UNLIMITED:
            continue
        if name is not None and not shape.chained(w):
            continue
        assert peak <= bound(shape, name, w) + allowance[name], (name, w, peak)

    assert_ended_exactly(client, slot, rows, swept)
    print(f"\n{kind}/{shape_name}: {len(rows)} reserves ({len(admitted)} admitted, "
          f"{sum(r['granted'] < r['amount'] for r in admitted)} shrunk, {len(refused)} refused), "
          f"{len(swept)} swept ({sum(r['end'] == 'corrected' for r in admitted)} corrected "
          f"late), {monitor.snapshots} snapshots, {elapsed:.1f} s; peaks (bound + allowance): "
          + ", ".join(f"{name or 'tenant'}/{w.value} {peak} ({bound(shape, name, w)} + "
                      f"{allowance[name]})" for (name, w), peak in sorted(
                          monitor.peak.items(), key=lambda i: (i[0][1], str(i[0][0])))
                      if shape.chained(w)))


# -- 2. the protection race -----------------------------------------------------------------------

PIECE = 100  # the protected calls' size, never shrunk
FLOOD_TASKS = 6  # per process


def protected_asks(shape: Shape) -> dict[str, int]:
    """The protected project asks for exactly its daily allotment: each key with an allotment
    its own, the keys without one the project's own part."""
    asks = {}
    for key in shape.keys_of("A"):
        asks[key] = shape.own(key, DAY) or shape.tier_allot("A", DAY)
    return asks


def flood_share(shape: Shape, asked: int) -> int:
    """What the flood of B's keys can get while A holds `asked`: in each window, the pool plus
    B's own top-level allotments, and no more than the tenant's quota leaves."""
    return min(min(shape.pool(w) + sum(shape.own(t, w) for t in shape.top_tiers_of("B", w)),
                   shape.quota[w] - asked)
               for w in WINDOWS if shape.chained(w))


def protected_room_after(shape: Shape, asked: int, flood: int) -> int:
    """What A can still take once the flood is refused: per window, the rest of A's allotment
    plus what the flood left in the pool (B's own allotments are full: it took beyond them)."""
    rooms = []
    for w in WINDOWS:
        if not shape.chained(w):
            continue
        b_own = sum(shape.own(t, w) for t in shape.top_tiers_of("B", w))
        assert flood >= b_own
        pool_left = shape.pool(w) - (flood - b_own)
        rooms.append(shape.own("A", w) - asked + pool_left)
    return min(rooms)


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_a_flood_never_takes_the_protected_allotment(
    request: pytest.FixtureRequest, kind: str, shape_name: str, tenant: str
) -> None:
    shape = SHAPES[shape_name]
    url, client = url_and_client(request, kind)
    engine = QuotaEngine(client)
    slot = Slot(tenant, shape, window_ids(engine))
    callers = shape.callers()
    asks = protected_asks(shape)
    asked = sum(asks.values())
    pieces = [(key, PIECE, PIECE) for key, total in sorted(asks.items())
              for _ in range(total // PIECE)]
    assert sum(p[1] for p in pieces) == asked
    flooders = shape.keys_of("B")
    monitor = Monitor(client, slot)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        ended = manager.Barrier(PROCESSES + 1)  # the workers and this test
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
            with running(monitor.take, pause=0.002):
                futures = [pool.submit(worker.flood, url, kind == "cluster", tenant, w, callers,
                                       pieces[w::PROCESSES], flooders, PIECE, FLOOD_TASKS,
                                       barrier, ended)
                           for w in range(PROCESSES)]
                ended.wait(timeout=300)  # every call decided; the holds are all open
            decided = slot.read(client)
            # What A can still borrow, taken from this process (shrinkable), then nothing more.
            more = engine.reserve(ReserveRequest(tenant, "a-more", 10**6, callers["a1"],
                                                 min_amount=1))
            last = engine.reserve(ReserveRequest(tenant, "a-last", 1, callers["a1"]))
            ended.wait(timeout=60)  # read: the workers end their holds
            rows = [row for f in futures for row in f.result(timeout=300)]

    mine = [r for r in rows if r["caller"] in asks]
    theirs = [r for r in rows if r["caller"] not in asks]
    # Every protected call was admitted whole, however the flood raced it.
    assert len(mine) == len(pieces)
    assert all(r["admitted"] and r["granted"] == PIECE for r in mine), \
        [r for r in mine if not r["admitted"]][:3]
    # The flood got exactly its share, not a token of A's allotment: refused by a pool (or by
    # the tenant's counter, reported first, once A's calls had filled it).
    flood = sum(r["granted"] for r in theirs)
    assert flood == flood_share(shape, asked)
    assert {r["refused"][:2] for r in theirs if not r["admitted"]} <= {
        ("tenant", Unit.POOL.value), ("tenant", Unit.TOKENS.value)}
    assert inconsistencies(slot, decided) == []
    for w in WINDOWS:
        tenant_counter = decided[slot.counter(None, w)]
        assert tenant_counter["pending"] == asked + flood
        assert tenant_counter["pending"] <= shape.quota[w] or shape.quota[w] == UNLIMITED
    assert monitor.problems == []
    assert all(peak <= bound(shape, name, w) for (name, w), peak in monitor.peak.items()
               if (name is None and shape.quota[w] != UNLIMITED) or
               (name is not None and shape.chained(w)))

    # A can still borrow what the flood left in each window's pool, and then nothing.
    room = protected_room_after(shape, asked, flood)
    assert more.granted == room and more.admitted == (room > 0)
    # (the tenant's counter is full too, and comes first in the order of refusals)
    assert not last.admitted and last.refused.scope == "tenant"
    extra_rows = []
    if more.admitted:
        engine.settle(more.hold, more.granted)
        extra_rows.append({"rid": "a-more", "caller": "a1", "admitted": True, "end": "settled",
                           "actual": more.granted, "keys": list(more.hold.counter_keys),
                           "granted": more.granted, "swept_charge": None})
    assert_ended_exactly(client, slot, rows + extra_rows, {})
    print(f"\n{kind}/{shape_name}: protected {asked} in {len(pieces)} calls, all admitted; flood "
          f"{flood} in {sum(r['admitted'] for r in theirs)} holds, "
          f"{sum(not r['admitted'] for r in theirs)} refusals; then {room} more borrowed; "
          f"{monitor.snapshots} snapshots; {json.dumps(decided[slot.tier(None, DAY)])}")
