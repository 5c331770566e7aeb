"""Rebuild a tenant's quota counters from the ledger after Redis lost them (DESIGN.md invariant 4).

Redis can forget: a restart without AOF, a failover to a replica that had not caught up, a flush.
Every tenant has an epoch marker in its own Redis slot (`quotas.keys.epoch_key`); the reserve
script refuses while it is missing (`QuotaEpochLost`), so no call is admitted on a counter that
restarted from zero. This module puts the current windows' counters back:

    used(scope, window) = the tokens of the ledger rows whose hold was made in the window
                        + the usage events still waiting in Redis for the drain

(fail-open calls included: no counter saw them, but the tenant spent those tokens) for every
counter the gateway checks (`quotas.limits.request_counters`: the tenant, its project,
its key and the model per day; the tenant per month, and the project and key per month where
they have a monthly limit; the tenant per minute under a tokens-per-minute limit), and the
monthly spend counter in micro-dollars from the rows' cost. Windows are the tenant's (its day
and cycle in its time zone, quotas.cycles.schedule_for) on the Redis clock
(`QuotaEngine.current_window`). `QuotaEngine.rebuild` then sets used = max(existing, figure) on
each and sets the epoch, in one script, so admission resumes.

One worker rebuilds a tenant at a time (a Redis lock in the tenant's slot, SET NX PX): the gateway
answers 503 `quota_store_rebuilding` to the tenant's other calls meanwhile. The gateway reaches
this module through settings.QUOTA_REBUILDER (it cannot import billing); the beat job
`rebuild_lost_tenants` and `manage.py quota_rebuild` use it directly.

What a rebuild cannot know: the holds that were open when Redis lost them (their calls are still
running; their settles arrive as orphans and are charged then), and the usage events that Redis
lost before the drain wrote them (persistence is required in production for that reason:
quotas/durability.py).
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db.models import Count, F, Q, Sum

from billing.ledger import record_from_event
from billing.models import UsageRecord
from billing.prices import PriceBook
from quotas import active, keys
from quotas.cycles import schedule_for
from quotas.engine import QuotaEngine, RebuildCounter, ScopeLimit, Unit
from quotas.keys import tenant_tag
from quotas.limits import KEY, MODEL, PROJECT, request_counters
from quotas.runtime import get_engine
from quotas.windows import Window, WindowKind
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits

log = logging.getLogger(__name__)

_KINDS = (WindowKind.DAY, WindowKind.MONTH, WindowKind.MINUTE)
_STREAM_PAGE = 1000
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class RebuildResult:
    tenant: str  # the tenant's Redis tag
    # False: another process holds the tenant's rebuild lock (its calls keep answering 503
    # until that one is done). True: the counters are back (rebuilt here, or found intact).
    rebuilt: bool
    counters: int = 0  # counters passed to the rebuild script
    raised: int = 0  # counters whose `used` it created or raised
    ledger_rows: int = 0  # ledger rows read (made in the current windows: the cycle's at the most)
    pending_events: int = 0  # undrained usage events read from the tenant's stream
    already_intact: bool = False  # the epoch was present: nothing to do (not forced)


# -- the figures --------------------------------------------------------------------------------


# (project id, api key id, model): the scopes one group of calls touched.
_Group = tuple[int | None, int | None, str]


@dataclass
class _Sums:
    tokens: dict[WindowKind, int] = field(default_factory=lambda: defaultdict(int))
    micros: dict[WindowKind, int] = field(default_factory=lambda: defaultdict(int))


def _windows(engine: QuotaEngine, tenant: Tenant) -> dict[WindowKind, Window]:
    # The tenant's windows, as the gateway reserves in them (KeyContext.schedule), on the Redis
    # clock.
    schedule = schedule_for(tenant)
    return {kind: engine.current_window(kind, schedule) for kind in _KINDS}


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _ledger_sums(tenant_id: int, windows: dict[WindowKind, Window]) -> tuple[dict[_Group, _Sums], int]:
    """Tokens and cost of the ledger rows whose hold was made in each current window."""
    start = min(w.start_ms for w in windows.values())
    end = max(w.end_ms for w in windows.values())
    tokens = F("input_tokens") + F("output_tokens")
    annotations: dict[str, Any] = {}
    for kind, window in windows.items():
        inside = Q(started_at__gte=_moment(window.start_ms), started_at__lt=_moment(window.end_ms))
        annotations[f"t_{kind.value}"] = Sum(tokens, filter=inside)
        annotations[f"c_{kind.value}"] = Sum("cost_micros", filter=inside)
    # A call ends after it starts: the ended_at bound lets PostgreSQL use (tenant, ended_at).
    rows = (UsageRecord.objects
            .filter(tenant_id=tenant_id, ended_at__gte=_moment(start),
                    started_at__gte=_moment(start), started_at__lt=_moment(end))
            .values("project_id", "api_key_id", "served_model")
            .annotate(rows=Count("pk"), **annotations)
            .order_by())
    sums: dict[_Group, _Sums] = defaultdict(_Sums)
    count = 0
    for row in rows:
        group = (row["project_id"], row["api_key_id"], row["served_model"])
        count += row["rows"] or 0
        for kind in windows:
            sums[group].tokens[kind] += row[f"t_{kind.value}"] or 0
            sums[group].micros[kind] += row[f"c_{kind.value}"] or 0
    return sums, count


def _stream_entries(engine: QuotaEngine, tenant: str) -> Iterator[dict[str, str]]:
    """The tenant's undrained usage events, oldest first, in bounded pages."""
    stream = keys.usage_stream_key(tenant)
    start = "-"
    while True:
        page = engine.client.xrange(stream, min=start, count=_STREAM_PAGE)
        for _entry_id, fields in page:
            yield fields
        if len(page) < _STREAM_PAGE:
            return
        start = "(" + page[-1][0]


def _add_pending_events(sums: dict[_Group, _Sums], engine: QuotaEngine, tenant: str,
                        tenant_id: int, windows: dict[WindowKind, Window],
                        prices: PriceBook) -> int:
    """Add what the usage events still in Redis say, without counting a call twice.

    An event the drain has already committed (it deletes events only after the commit) is in
    the ledger too; a late settle's "corrected" event replaces what the sweep's row says. So
    per request the last event's figures win, minus whatever the ledger already counted.
    """
    final: dict[str, UsageRecord] = {}
    count = 0
    for fields in _stream_entries(engine, tenant):
        count += 1
        try:
            # The ledger's own reading of an event (tokens, cost, project, key, model): the
            # rebuilt counter says what the drained row will say.
            record = record_from_event(tenant_id, fields, prices)
        except (KeyError, ValueError, TypeError):
            log.error("malformed usage event %r of tenant %s: not counted", fields, tenant)
            continue
        final[record.request_id] = record
    if not final:
        return count
    counted = {r.request_id: r for r in UsageRecord.objects.filter(
        tenant_id=tenant_id, request_id__in=list(final)).only(
        "request_id", "project_id", "api_key_id", "served_model", "input_tokens",
        "output_tokens", "cost_micros", "started_at")}
    for request_id, record in final.items():
        _add_record(sums, record, windows, +1)
        if request_id in counted:
            _add_record(sums, counted[request_id], windows, -1)
    return count


def _add_record(sums: dict[_Group, _Sums], record: UsageRecord,
                windows: dict[WindowKind, Window], sign: int) -> None:
    started_ms = int(record.started_at.timestamp() * 1000)
    group = (record.project_id, record.api_key_id, record.served_model)
    for kind, window in windows.items():
        if window.contains(started_ms):
            sums[group].tokens[kind] += sign * (record.input_tokens + record.output_tokens)
            sums[group].micros[kind] += sign * record.cost_micros


# -- which counters: the gateway's own list -----------------------------------------------------


def _scopes(tenant: Tenant, limits: Any, project: Project | None, api_key: ApiKey | None,
            model: str) -> tuple[ScopeLimit, ...]:
    """The counters a call of this key and model was checked against, from the definition the
    gateway reserves (quotas.limits.request_counters), so the rebuild restores exactly what
    reserve reads.

    A row whose project or key has been deleted still counts for the tenant and the model; the
    deleted ones' counters are never read again. A model name that cannot be a scope (the
    gateway refuses those before reserving) counts for the other scopes."""
    stand_in = project is None or api_key is None
    if project is None:
        project = Project(tenant=tenant)
    if api_key is None:
        api_key = ApiKey(project=project)
    try:
        found = request_counters(tenant, limits, project, api_key, model)
        named_model = True
    except ValueError:
        found = request_counters(tenant, limits, project, api_key, "unnamed")
        named_model = False
    wanted = []
    for counter in found:
        if stand_in and counter.kind in {PROJECT, KEY}:
            continue
        if not named_model and counter.kind == MODEL:
            continue
        wanted.append(counter.scope_limit)
    return tuple(wanted)


_Ident = tuple[str, WindowKind, Unit]


class _Chains:
    """The allotment tiers' `taken` from the ledger (lua/lib/tiers.lua): a chain's first tier
    takes the group's tokens; each tier passes on what it holds above its allotment to the next,
    so the figures follow the chains, keys before projects before the pool."""

    def __init__(self) -> None:
        self.direct: dict[_Ident, int] = defaultdict(int)
        self.feeds: dict[_Ident, set[_Ident]] = defaultdict(set)  # tier -> the tiers it spills to
        self.limits: dict[_Ident, int] = {}

    def add(self, scopes: tuple[ScopeLimit, ...], tokens: dict[WindowKind, int]) -> None:
        previous: _Ident | None = None
        for scope in scopes:
            if not scope.unit.tiered:
                previous = None
                continue
            ident = (scope.scope, scope.window, scope.unit)
            self.limits[ident] = scope.limit
            if previous is None:
                self.direct[ident] += tokens.get(scope.window, 0)
            else:
                self.feeds[previous].add(ident)
            previous = None if scope.unit is Unit.POOL else ident

    def taken(self) -> list[tuple[_Ident, int, int]]:
        taken: dict[_Ident, int] = defaultdict(int)
        for ident, tokens in self.direct.items():
            taken[ident] += tokens
        # Keys spill into projects or the pool, projects into the pool: in that order.
        order = sorted(self.limits, key=lambda i: (i[2] is Unit.POOL, i[0].startswith("project")))
        for ident in order:
            spill = max(0, taken[ident] - self.limits[ident]) if ident[2] is Unit.ALLOTMENT else 0
            for target in self.feeds.get(ident, ()):
                taken[target] += spill
        return [(ident, taken[ident], self.limits[ident]) for ident in order]


def _counters(tenant: Tenant, sums: dict[_Group, _Sums], windows: dict[WindowKind, Window],
              prices: PriceBook) -> list[RebuildCounter]:
    limits = effective_limits(tenant)
    projects = Project.objects.filter(tenant=tenant).in_bulk(
        {g[0] for g in sums if g[0] is not None})
    api_keys = ApiKey.objects.filter(project__tenant=tenant).in_bulk(
        {g[1] for g in sums if g[1] is not None})
    figures: dict[tuple[str, WindowKind, Unit], int] = defaultdict(int)
    scope_limits: dict[tuple[str, WindowKind, Unit], int] = {}
    chains = _Chains()
    for (project_id, api_key_id, model), group in sums.items():
        project = projects.get(project_id) if project_id is not None else None
        api_key = api_keys.get(api_key_id) if api_key_id is not None else None
        # The gateway counts a dated snapshot under its catalog model (gateway/admission.py).
        scopes = _scopes(tenant, limits, project, api_key, prices.canonical(model))
        chains.add(scopes, group.tokens)
        for scope in scopes:
            if scope.unit.tiered:
                continue  # not a sum: tiers pass on only what they take above their allotment
            ident = (scope.scope, scope.window, scope.unit)
            per_unit = group.micros if scope.unit is Unit.MICROS else group.tokens
            figures[ident] += per_unit.get(scope.window, 0)
            scope_limits[ident] = scope.limit
    for ident, taken, limit in chains.taken():
        figures[ident] = taken
        scope_limits[ident] = limit
    # A counter with nothing to restore is left to the next reserve, which creates it at 0; not
    # a tier or a pool: a missing pool is seeded from the tenant counter (lua/reserve.lua), which
    # would count the allotments' own use as borrowed.
    return [RebuildCounter(scope=scope, window=windows[kind], used=used,
                           limit=scope_limits[(scope, kind, unit)], unit=unit)
            for (scope, kind, unit), used in sorted(figures.items())
            if used > 0 or unit.tiered]


# -- the rebuild --------------------------------------------------------------------------------


def _epoch_value(rows: int, events: int) -> str:
    now = datetime.now(UTC).isoformat(timespec="seconds")
    return (f"rebuilt {now} by {socket.gethostname()}:{os.getpid()} from {rows} ledger rows and "
            f"{events} pending events")


def rebuild_tenant(tenant: str, *, force: bool = False,
                   engine: QuotaEngine | None = None) -> RebuildResult:
    """Rebuild the current windows' counters of one tenant (its Redis tag) from the ledger.

    Without `force`, a tenant whose epoch marker is present is left alone (another worker
    rebuilt it since the caller saw the loss). Returns `rebuilt=False` at once when another
    process holds the tenant's rebuild lock. Raises QuotaError when Redis cannot be used and
    Tenant.DoesNotExist for an unknown tenant.

    This is settings.QUOTA_REBUILDER's default: the gateway calls it on its database threads
    when a reserve raised QuotaEpochLost.
    """
    engine = engine or get_engine()
    client = engine.client
    token = uuid.uuid4().hex
    lock = keys.rebuild_lock_key(tenant)
    if not client.set(lock, token, nx=True, px=settings.QUOTA_REBUILD_LOCK_SECONDS * 1000):
        return RebuildResult(tenant, rebuilt=False)
    try:
        if not force and engine.has_epoch(tenant):
            return RebuildResult(tenant, rebuilt=True, already_intact=True)
        record = Tenant.objects.select_related("plan").get(pk=int(tenant))
        windows = _windows(engine, record)
        # The stream before the ledger: an event the drain moves in between is then seen in
        # both (and counted once), never in neither.
        pending: dict[_Group, _Sums] = defaultdict(_Sums)
        prices = PriceBook.load()
        events = _add_pending_events(pending, engine, tenant, record.pk, windows, prices)
        sums, rows = _ledger_sums(record.pk, windows)
        for group, extra in pending.items():
            for kind in windows:
                sums[group].tokens[kind] += extra.tokens.get(kind, 0)
                sums[group].micros[kind] += extra.micros.get(kind, 0)
        counters = _counters(record, sums, windows, prices)
        raised = engine.rebuild(tenant, counters, _epoch_value(rows, events))
    finally:
        client.eval(_RELEASE, 1, lock, token)
    log.warning("quota counters of tenant %s rebuilt from %d ledger rows and %d pending usage "
                "events: %d counters, %d raised", tenant, rows, events, len(counters), raised)
    return RebuildResult(tenant, rebuilt=True, counters=len(counters), raised=raised,
                         ledger_rows=rows, pending_events=events)


def lost_tenants(engine: QuotaEngine, tenant_ids: Iterable[int]) -> list[int]:
    """The tenants among `tenant_ids` whose epoch marker is missing, in one pipelined round."""
    ids = list(tenant_ids)
    pipe = engine.client.pipeline(transaction=False)
    for tenant_id in ids:
        pipe.exists(keys.epoch_key(tenant_tag(tenant_id)))
    return [tenant_id for tenant_id, present in zip(ids, pipe.execute(), strict=True)
            if not present]


@shared_task
def rebuild_lost_tenants(limit: int = 200) -> int:
    """Beat job: rebuild up to `limit` tenants whose epoch marker is missing, so their next call
    finds its counters ready instead of waiting for the rebuild. Safe on several workers (the
    per-tenant lock); what is left over is taken by the next run.

    The tenants of the index of active tenants (quotas/active.py); every tenant on the job's
    full walk (TOLLGATE_ACTIVE_FULL_WALK_SECONDS), at once when the index was lost, which is what
    a Redis that lost its data shows (its index shards go with the counters). An idle tenant
    whose marker went alone is rebuilt by the full walk, or by its next call."""
    engine = get_engine()
    run = active.visit(engine.client, active.REBUILD)
    tenants = Tenant.objects.filter(status=Tenant.Status.ACTIVE)
    if not run.full:
        tenants = tenants.filter(pk__in=run.tenants)
    ids = list(tenants.order_by("pk").values_list("pk", flat=True))
    done = 0
    for start in range(0, len(ids), 1000):
        for tenant_id in lost_tenants(engine, ids[start:start + 1000]):
            if done >= limit:
                return done  # the walk goes on next run: not recorded as done
            if rebuild_tenant(tenant_tag(tenant_id), engine=engine).rebuilt:
                done += 1
    active.walked(engine.client, run)
    return done
