"""The index of active tenants: which tenants the background jobs must visit.

The ledger drain (every 5 s), the sweep (every minute) and the alert and health detectors used to
walk every tenant in PostgreSQL and ask Redis about each one: their cost grew with the number of
tenants, idle or not (20,000 idle tenants: a drain run 1.5 s; at 100,000 the drain no longer
finished within its period). They now visit the tenants of this index, so their work follows
activity, plus a slow full walk as a backstop.

The index: `TOLLGATE_ACTIVE_SHARDS` sorted sets `tg:active:{a<shard>}` (quotas/keys.py), each its
own hash tag, so on a Redis Cluster the shards spread over slots instead of making one hot key.
A tenant lives in shard crc32(tag) % shards, scored by when it was last marked (ms, on that
shard's Redis clock: lua/active_mark.lua).

Who marks. A tenant's scripts run in its own slot (`{t<id>}`), so on a cluster they cannot also
write a shard. The engines mark instead, *before* the script call of every reserve (admitted or
refused: a refusal feeds the threshold check's `quota.exhausted`), settle, release and fail-open
usage event, so a call whose task is cancelled while its script runs is marked too:
- `AsyncQuotaEngine` (the gateway) keeps the tenants in memory and a gateway worker flushes them
  every GATEWAY_ACTIVE_FLUSH_SECONDS (1 s), one script call per shard (gateway/startup.py), and
  once more at its lifespan shutdown; a failed flush keeps them for the next one. A tenant's
  first reserve in the worker for half the retention writes its mark first, at once
  (PendingMarks.unconfirmed): a mark that recent cannot have been forgotten, so the index holds
  every tenant a live worker has reserved for, also when that worker is killed before its
  flush.
- `QuotaEngine` (commands, tests, anything synchronous) marks at once, one call.

Who forgets. The sweep job, after sweeping, takes out the tenants last marked more than
TOLLGATE_ACTIVE_RETENTION_SECONDS ago (default QUOTA_STALE_HOLD_SECONDS + 300) that have no open
hold and no undrained usage event (lua/active_forget.lua removes a member only if its score is
still that old, on the shard's clock, so a mark made after the check keeps the tenant).

How a tenant with work could be missed, and what closes each way:
- a worker killed (SIGKILL, OOM) between a call's reserve and its next flush: the tenant's mark
  was written before its first reserve in that worker (above), and a later reserve's tenant
  was marked within half the retention;
- one member lost from a shard that was not lost whole: the backstop below, within
  TOLLGATE_ACTIVE_FULL_WALK_SECONDS (1 h);
- Redis losing the index (a flush, a failover to a replica behind), or a change of
  TOLLGATE_ACTIVE_SHARDS (tenants move between shards): every shard holds one
  `~<job>@<shards>` member per job, scored by that job's last full walk; a job that finds its
  member missing in any shard walks every tenant at once, and only then puts the member back;
- a settle, release or correction arriving late (a correction up to QUOTA_TOMBSTONE_SECONDS after
  the reserve), or a fail-open call's usage event appended when Redis answers again: each goes
  through the engine, which marks;
- the sweep's own usage events: the sweep visits only indexed tenants, which stay indexed while
  their stream has events;
- a removal racing a mark: compared on the shard's own clock (above);
- anything else that writes a tenant's stream or holds directly (a hand-made XADD): the backstop.
The full walk also marks again every tenant it finds with work, repairing the index.

The bound: a tenant with work is visited by each job within its own period while indexed, and in
any case within TOLLGATE_ACTIVE_FULL_WALK_SECONDS (+ the job's period) of being missed.
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quotas import keys, scripts

log = logging.getLogger(__name__)

# The jobs that visit the index; each has its own full-walk member in every shard.
DRAIN = "drain"
SWEEP = "sweep"
THRESHOLDS = "thresholds"
PENDING = "pending"
FORECASTS = "forecasts"
REBUILD = "rebuild"  # billing.rebuild.rebuild_lost_tenants
JOBS = (DRAIN, SWEEP, THRESHOLDS, PENDING, FORECASTS, REBUILD)

# Tenants per pipelined round trip when probing many (a full walk).
_CHUNK = 1000


@dataclass(frozen=True)
class ActiveSettings:
    shards: int = 16
    retention_s: int = 900
    full_walk_s: int = 3600

    @classmethod
    def from_django(cls) -> ActiveSettings:
        from django.conf import settings

        return cls(shards=settings.TOLLGATE_ACTIVE_SHARDS,
                   retention_s=settings.TOLLGATE_ACTIVE_RETENTION_SECONDS,
                   full_walk_s=settings.TOLLGATE_ACTIVE_FULL_WALK_SECONDS)


def shard_of(tenant: str, shards: int) -> int:
    """The shard of a tenant tag: crc32, so tags of any form (numeric ids, test uuids) spread."""
    return zlib.crc32(tenant.encode()) % shards


def by_shard(tenants: Iterable[str], shards: int) -> dict[int, list[str]]:
    grouped: dict[int, list[str]] = {}
    for tenant in dict.fromkeys(tenants):
        grouped.setdefault(shard_of(tenant, shards), []).append(tenant)
    return grouped


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# -- marking ------------------------------------------------------------------------------------


def mark(client: Any, tenants: Iterable[str], shards: int | None = None) -> None:
    """Mark tenants active now (one lua/active_mark.lua call per shard they fall in; `shards`
    default: TOLLGATE_ACTIVE_SHARDS)."""
    if shards is None:
        shards = ActiveSettings.from_django().shards
    script = client.register_script(scripts.ACTIVE_MARK.text)
    for shard, members in sorted(by_shard(tenants, shards).items()):
        script(keys=[keys.active_shard_key(shard)], args=members)


async def amark(client: Any, tenants: Iterable[str], shards: int) -> None:
    """`mark` on an asyncio client, the shards' calls concurrently."""
    script = client.register_script(scripts.ACTIVE_MARK.text)
    await asyncio.gather(*(script(keys=[keys.active_shard_key(shard)], args=members)
                           for shard, members in sorted(by_shard(tenants, shards).items())))


@dataclass
class PendingMarks:
    """A gateway worker's tenants marked since its last flush (AsyncQuotaEngine), and when each
    tenant's mark was last written to the index by this worker (`confirmed`, monotonic seconds,
    oldest first): a tenant not confirmed within `confirm_s` is marked at once before its
    reserve (`unconfirmed`), so a worker killed before its next flush leaves no hold the index
    does not know."""

    tenants: set[str] = field(default_factory=set)
    confirm_s: float = 450.0
    confirmed: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def add(self, tenant: str) -> None:
        self.tenants.add(tenant)

    def unconfirmed(self, tenant: str) -> bool:
        """Whether the index may not hold the tenant: this worker has not written its mark
        within confirm_s (half the index's retention: a member marked since cannot have been
        forgotten, lua/active_forget.lua). One dict lookup on the hot path."""
        at = self.confirmed.get(tenant)
        return at is None or time.monotonic() - at > self.confirm_s

    def confirm(self, tenants: Iterable[str], at: float) -> None:
        """These tenants' marks were written (sent at monotonic `at`: their scores are no
        older); entries older than confirm_s are dropped, so the map holds the tenants of the
        last confirm_s only."""
        for tenant in tenants:
            self.confirmed[tenant] = at
            self.confirmed.move_to_end(tenant)
        cutoff = time.monotonic() - self.confirm_s
        while self.confirmed:
            tenant, when = next(iter(self.confirmed.items()))
            if when >= cutoff:
                break
            del self.confirmed[tenant]

    async def flush(self, client: Any, shards: int) -> int:
        """Write the pending marks; on failure they stay pending for the next flush (the
        backstop covers a worker that dies first). Returns how many tenants were written."""
        if not self.tenants:
            return 0
        taken, self.tenants = self.tenants, set()
        sent = time.monotonic()
        try:
            await amark(client, taken, shards)
        except BaseException:
            self.tenants |= taken
            raise
        self.confirm(taken, sent)
        return len(taken)


async def flush_forever(flush: Callable[[], Any], interval_s: float) -> None:
    """A gateway worker's background task: flush its marks every `interval_s`."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await flush()
        except Exception:  # noqa: BLE001 - kept for the next flush; the backstop bounds the rest
            log.warning("could not flush the active-tenant marks; retrying", exc_info=True)


# -- visiting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Indexed:
    shard: int
    tenant: str  # the member: a tenant tag
    score_ms: int


@dataclass(frozen=True)
class Visit:
    """The tenants one run of a job visits."""

    job: str
    full: bool  # the backstop: every tenant in PostgreSQL
    tenants: tuple[int, ...]  # the tenant ids to visit (the index's, in PostgreSQL), ascending
    indexed: tuple[Indexed, ...]  # every tenant member of the index, as read
    now_ms: int  # the Redis clock when the index was read (the full walk's time)
    why: str = ""  # why a full walk: "due", "index lost"


def _tenant_ids(members: Iterable[str]) -> list[int]:
    return sorted({int(m) for m in members if m.isdigit()})


def existing_tenant_ids(ids: Sequence[int]) -> list[int]:
    """The ids of these that are tenants in PostgreSQL, ascending (an index member may be a
    tenant since deleted: nothing for the jobs to do there)."""
    from tenants.models import Tenant  # Django's models: not needed for marking

    found: list[int] = []
    for start in range(0, len(ids), 10_000):
        found += Tenant.objects.filter(pk__in=ids[start:start + 10_000]).values_list("pk",
                                                                                   flat=True)
    return sorted(found)


def all_tenant_ids() -> list[int]:
    from tenants.models import Tenant

    return list(Tenant.objects.order_by("pk").values_list("pk", flat=True))


def read_index(client: Any, shards: int) -> tuple[list[Indexed], list[dict[str, int]], int]:
    """Every shard's members in one pipelined round trip: the tenants, each shard's job
    members (job -> ms), and the Redis clock."""
    now_ms = _server_ms(client)
    pipe = client.pipeline(transaction=False)
    for shard in range(shards):
        pipe.zrange(keys.active_shard_key(shard), 0, -1, withscores=True)
    replies = pipe.execute()
    tenants: list[Indexed] = []
    walks: list[dict[str, int]] = []
    for shard, reply in enumerate(replies):
        walked: dict[str, int] = {}
        for member, score in reply:
            name = _text(member)
            if keys.is_active_walk_member(name):
                walked[name] = int(score)
            else:
                tenants.append(Indexed(shard, name, int(score)))
        walks.append(walked)
    return tenants, walks, now_ms



def is_whole(walks: Sequence[dict[str, int]], job: str, shards: int) -> bool:
    """Whether every shard (read_index's walks) holds `job`'s full-walk member: if one lacks it,
    the index was lost there (a flush, a failover behind, a new shard count) or never walked."""
    member = keys.active_walk_member(job, shards)
    return all(member in walked for walked in walks)


def indexed_tenant_ids(client: Any, job: str,
                       settings: ActiveSettings | None = None) -> list[int] | None:
    """The index's tenants still in PostgreSQL, ascending, for a reader that needs the tenants
    with work now (not a job's run: no full walk is started or recorded); None when the index is
    not whole for `job` (a shard without its full-walk member: lost, never walked), so the
    reader takes every tenant, as the job's next run does."""
    settings = settings or ActiveSettings.from_django()
    indexed, walks, _now_ms = read_index(client, settings.shards)
    if not is_whole(walks, job, settings.shards):
        return None
    return existing_tenant_ids(_tenant_ids(i.tenant for i in indexed))

def visit(client: Any, job: str, settings: ActiveSettings | None = None) -> Visit:
    """Which tenants this run of `job` visits: the index's (those in PostgreSQL), or every
    tenant when the job's full walk is due (its last one older than full_walk_s) or the index
    was lost (a shard without the job's member). Call `walked` after a full walk completes."""
    settings = settings or ActiveSettings.from_django()
    member = keys.active_walk_member(job, settings.shards)
    indexed, walks, now_ms = read_index(client, settings.shards)
    why = ""
    if not is_whole(walks, job, settings.shards):
        why = "index lost"  # or never walked: a new installation, a new shard count
    elif min(walked[member] for walked in walks) <= now_ms - settings.full_walk_s * 1000:
        why = "due"
    if why:
        ids = all_tenant_ids()
    else:
        ids = existing_tenant_ids(_tenant_ids(i.tenant for i in indexed))
    return Visit(job, bool(why), tuple(ids), tuple(indexed), now_ms, why)


def walked(client: Any, run: Visit, settings: ActiveSettings | None = None) -> None:
    """Record that `run`'s full walk completed (as of when it read the index), in every shard:
    a run that died mid-way leaves the walk due."""
    if not run.full:
        return
    settings = settings or ActiveSettings.from_django()
    member = keys.active_walk_member(run.job, settings.shards)
    pipe = client.pipeline(transaction=False)
    for shard in range(settings.shards):
        pipe.zadd(keys.active_shard_key(shard), {member: run.now_ms})
    pipe.execute()
    log.info("%s: full walk of %d tenants done (%s)", run.job, len(run.tenants), run.why)


# -- probing and forgetting ---------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    holds: int  # open holds
    events: int  # usage events waiting for the drain

    @property
    def any(self) -> bool:
        return bool(self.holds or self.events)


def probe(client: Any, tenant_ids: Sequence[int], *, holds: bool = True,
          events: bool = True) -> dict[int, Work]:
    """Each tenant's open holds (ZCARD) and undrained events (XLEN), pipelined, `_CHUNK`
    tenants per round trip (on a cluster, redis-py splits each pipeline by node)."""
    found = _probe_tags(client, [keys.tenant_tag(t) for t in tenant_ids], holds, events)
    return {tenant_id: found[keys.tenant_tag(tenant_id)] for tenant_id in tenant_ids}


def _probe_tags(client: Any, tags: Sequence[str], holds: bool = True,
                events: bool = True) -> dict[str, Work]:
    found: dict[str, Work] = {}
    for start in range(0, len(tags), _CHUNK):
        part = tags[start:start + _CHUNK]
        pipe = client.pipeline(transaction=False)
        for tag in part:
            if holds:
                pipe.zcard(keys.hold_index_key(tag))
            if events:
                pipe.xlen(keys.usage_stream_key(tag))
        replies = iter(pipe.execute())
        for tag in part:
            found[tag] = Work(int(next(replies)) if holds else 0,
                              int(next(replies)) if events else 0)
    return found


def remark_busy(client: Any, work: dict[int, Work], shards: int) -> list[int]:
    """After a full walk's probe: mark again the tenants found with work (the index missed them
    or lost them). Returns their ids."""
    busy = [tenant_id for tenant_id, found in work.items() if found.any]
    if busy:
        mark(client, (keys.tenant_tag(t) for t in busy), shards)
    return busy


def forget_idle(client: Any, run: Visit, settings: ActiveSettings | None = None) -> int:
    """Take out of the index the tenants of `run` last marked more than retention_s ago that
    have no open hold and no undrained event; each removal is checked against a fresh mark in
    the shard itself (lua/active_forget.lua). Returns how many were removed. Redis only: a
    member whose tenant was deleted from PostgreSQL with work left in Redis stays (no job
    visits it: one probe per sweep)."""
    settings = settings or ActiveSettings.from_django()
    cutoff = run.now_ms - settings.retention_s * 1000
    old = [i for i in run.indexed if i.score_ms <= cutoff]
    if not old:
        return 0
    work = _probe_tags(client, sorted({i.tenant for i in old}))
    idle: dict[int, list[str]] = {}
    for item in old:
        if not work[item.tenant].any:
            idle.setdefault(item.shard, []).append(item.tenant)
    script = client.register_script(scripts.ACTIVE_FORGET.text)
    removed = 0
    for shard, members in sorted(idle.items()):
        gone, _now = script(keys=[keys.active_shard_key(shard)],
                            args=[settings.retention_s * 1000, *members])
        removed += int(gone)
    return removed
