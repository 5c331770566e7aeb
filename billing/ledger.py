"""The usage ledger: drain the gateway's per-tenant usage streams into PostgreSQL.

Settle, release and sweep append one event per ended hold to `tg:{t<id>}:usage` atomically with
the counters (lua/settle.lua). Draining reads a batch, writes it in one transaction, and only
then deletes it from the stream, so nothing is lost while PostgreSQL is down (events wait in
Redis: the engine never trims the stream, only this drain deletes what it committed) and a
redelivered event never makes a second row (request ids are unique).

Events (fields of the stream entries, lua/*.lua):

- settled / released: one row each. A settle whose hold Redis had lost (orphan=1) is an ordinary
  row: the call reached the upstream and is billed.
- swept: the sweep ended a hold whose gateway never did, charging what the hold knew (`in`,
  `out`, `basis`: reserved -> nothing, forwarded -> the whole hold, streaming -> the input and the
  last output checkpoint). Priced like every row; the row's sweep_basis says which.
- corrected: a settle or release that arrived after the sweep. It updates the swept row in place
  to the real tokens, cost and status and keeps what the sweep had charged (swept_input_tokens,
  swept_output_tokens, swept_cost_micros, corrected_at). Exactly once: only a swept row not yet
  corrected is updated, so a redelivered correction changes nothing. In stream order a hold's
  swept event comes before its correction; a batch inserts its rows before applying its
  corrections, so both in one batch converge, and a correction whose swept row never reached the
  ledger creates the corrected row itself (the swept event, if it ever comes, then conflicts and
  changes nothing).
- unmetered: a fail-open call (no hold existed); a row with status "unmetered", billed like a
  settled call.

Token classes: settled, unmetered and corrected events carry the call's usage by class
(gateway/usage.py: "in" and "out" totals, "ci" cached input, "cw" cache writes, "rs" reasoning,
each class part of its total); the row keeps them apart (cached_input_tokens,
cache_write_tokens, reasoning_tokens). The cost the scripts charged (`money`) is the gateway's
Price.cost_of of that usage; an unmetered call, which carries none, is priced here the same way.
Swept rows keep 0 in every class: the sweep knows only its hold's totals.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, transaction

from billing.models import UsageRecord
from billing.prices import PriceBook
from billing.rollups import LedgerRow, ZoneOf, Zones, insert_records, move_corrected
from gateway.bodies import Endpoint
from gateway.dialects import provider_kind
from gateway.models import ProviderKey, ProviderKind
from gateway.prices import Price
from gateway.usage import Usage
from quotas import active, keys
from quotas.cycles import calendar_for
from quotas.keys import tenant_tag
from quotas.windows import Calendar, Window, WindowKind
from tenants.models import Tenant

log = logging.getLogger(__name__)

_COMPLETE = "complete"
_CORRECTED = "corrected"
# The fields a correction replaces on the swept row; the rest (who, which model, when the hold
# was made and swept, the hold, the sweep's basis) stays as the sweep recorded it.
_CORRECTED_FIELDS = ("input_tokens", "output_tokens", "cached_input_tokens",
                     "cache_write_tokens", "reasoning_tokens", "cost_micros", "status", "detail",
                     "http_status", "latency_ms", "provider_key_id", "streamed", "over_soft_limit",
                     "over_hold_tokens", "swept_input_tokens", "swept_output_tokens",
                     "swept_cost_micros", "corrected_at")
# The windows an event's counters belong to, for the threshold check after a drain.
_ALERT_WINDOW_KINDS = (WindowKind.DAY, WindowKind.MONTH)


_decode = json.JSONDecoder().decode  # json.loads' own decoder, without its per-call checks


def _json(raw: Any) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = _decode(raw)
    except (TypeError, ValueError, AttributeError):
        return {}
    return value if isinstance(value, dict) else {}


# An event's meta (project, key, model, endpoint) is the same text for every call of one shape,
# so the drain decodes each distinct one once; ledger_row only reads the dict.
@functools.lru_cache(maxsize=10_000)
def _meta(raw: Any) -> dict[str, Any]:
    return _json(raw)


def _moment(ms: Any) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)


def _int(value: Any) -> int | None:
    """An integer from the event's JSON (which decodes to plain ints), else None (a boolean
    too)."""
    return value if value.__class__ is int else None


def _count(value: Any) -> int:
    """A token count from a stream field ("" or missing: 0)."""
    return max(int(value or 0), 0)


def _usage(details: dict[str, Any], actual: int) -> Usage:
    """The usage, by token class, of a call the gateway ended with the upstream's figures."""
    usage = Usage.from_event(details)
    if usage is None:
        # An event without the split (settled outside the gateway): all of it as input.
        return Usage(actual, 0)
    return usage


def _ended_status(details: dict[str, Any]) -> UsageRecord.Status:
    return (UsageRecord.Status.SETTLED if details.get("outcome", _COMPLETE) == _COMPLETE
            else UsageRecord.Status.PARTIAL)


def over_hold(held: int, input_tokens: int, output_tokens: int) -> int:
    """Tokens used above the hold (0 for a call without one: nothing bounded it)."""
    return max(input_tokens + output_tokens - held, 0) if held > 0 else 0


# Outcomes whose event carries the money the scripts charged the spend counters: the price the
# hot path resolved at admission (gateway/prices.py), so the ledger bills exactly what the budget
# counted, even when a price period changes while the call runs. Unmetered calls had no hold and
# carry no money: they are priced here, by the same price book.
_CHARGED_OUTCOMES = frozenset({"settled", "swept", _CORRECTED})


def _cost(outcome: str, fields: dict[str, str], price: Price, usage: Usage) -> int:
    if outcome in _CHARGED_OUTCOMES and fields.get("money", "") != "":
        return _count(fields["money"])
    return price.cost_of(usage)


@functools.lru_cache(maxsize=64)
def _kind_of(endpoint: str) -> str:
    """The provider key kind that served a call of `endpoint` (the event meta's "ep"), whose
    default prices price a model without its own: "anthropic" for messages, else "openai". An
    event without one (written before endpoints were recorded) was an OpenAI-compatible call."""
    try:
        return provider_kind(Endpoint(endpoint))
    except ValueError:
        return ProviderKind.OPENAI.value


def ledger_row(tenant_id: int, fields: dict[str, str], prices: PriceBook) -> LedgerRow:
    """The ledger row of one usage event (the one home of its computation; the drain inserts it
    as it is). For a "corrected" event: the row as the correction leaves it, swept_* holding
    what the sweep had charged (from the event)."""
    meta, details = _meta(fields.get("meta")), _json(fields.get("event"))
    outcome = fields["outcome"]
    actual = _count(fields.get("actual"))
    basis = ""
    if outcome in ("settled", "unmetered"):
        usage = _usage(details, actual)
        status = (_ended_status(details) if outcome == "settled"
                  else UsageRecord.Status.UNMETERED)
    elif outcome == _CORRECTED:
        if _int(details.get("in")) is None and actual == 0:
            # A release after the sweep: the upstream produced nothing after all.
            usage = Usage()
            status = UsageRecord.Status.RELEASED
        else:
            usage = _usage(details, actual)
            status = _ended_status(details)
    elif outcome == "swept":
        # What the sweep charged (lua/sweep.lua); events of holds swept before the sweep knew
        # phases carry neither split nor basis: nothing was charged for them.
        usage = Usage(_count(fields.get("in")), _count(fields.get("out")))
        basis = UsageRecord.SweepBasis(fields["basis"]) if fields.get("basis") else ""
        status = UsageRecord.Status.SWEPT
    else:
        status = UsageRecord.Status(outcome)
        usage = Usage()
    input_tokens, output_tokens = usage.input_tokens, usage.output_tokens
    ended = _moment(fields["ended"])
    created = fields.get("created") or fields["ended"]
    model = str(meta.get("m") or "")
    served = str(meta.get("served") or model)
    held = _count(fields.get("held"))
    price = prices.price(served, ended, _kind_of(str(meta.get("ep") or "")))
    record = LedgerRow(
        request_id=fields["request_id"],
        tenant_id=tenant_id,
        project_id=_int(meta.get("p")),
        api_key_id=_int(meta.get("k")),
        provider_key_id=_int(details.get("pk")),
        endpoint=str(meta.get("ep") or ""),
        model=model,
        served_model=served,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        held_tokens=held,
        cost_micros=_cost(outcome, fields, price, usage),
        status=status,
        detail=str(details.get("outcome") or outcome)[:64],
        http_status=_int(details.get("st")),
        latency_ms=_int(details.get("lat")),
        streamed=bool(details.get("stream")),
        over_soft_limit=bool(details.get("soft")),
        started_at=(ended if created == fields["ended"] else _moment(created)),
        ended_at=ended,
        sweep_basis=basis,
        over_hold_tokens=over_hold(held, input_tokens, output_tokens),
    )
    if outcome == _CORRECTED:
        # Used only when the swept row is not in the ledger (see the module docstring): the
        # event says how many tokens the sweep charged but not their split, so they count as
        # input, and the money is what the sweep charged the counters.
        swept = _count(fields.get("swept"))
        record.swept_input_tokens, record.swept_output_tokens = swept, 0
        record.swept_cost_micros = (_count(fields["swept_money"]) if fields.get("swept_money")
                                    else price.cost(swept, 0))
        record.corrected_at = ended
    return record


def record_from_event(tenant_id: int, fields: dict[str, str], prices: PriceBook) -> UsageRecord:
    """The ledger row of one usage event as an (unsaved) UsageRecord: `ledger_row`'s values."""
    return UsageRecord(**ledger_row(tenant_id, fields, prices).values())


def _drop_dangling_provider_keys(records: list[LedgerRow]) -> None:
    """A provider key deleted since the call must not fail the whole batch. For corrections,
    whose provider key goes onto the swept row by an UPDATE; the insert resolves its own rows'
    references (billing.rollups.insert_records)."""
    wanted = {r.provider_key_id for r in records if r.provider_key_id is not None}
    if not wanted:
        return
    existing = set(ProviderKey.objects.filter(pk__in=wanted).order_by()
                   .values_list("pk", flat=True))
    for record in records:
        if record.provider_key_id not in existing:
            record.provider_key_id = None


def _apply_corrections(corrections: list[LedgerRow], zone_of: ZoneOf | None = None) -> int:
    """Correct the swept rows of these "corrected" events, each once; returns how many rows
    this call corrected. Runs inside the batch's transaction, after its rows were inserted; the
    rollup moves with each row (billing/rollups.py)."""
    by_id: dict[str, LedgerRow] = {}
    for record in corrections:
        by_id.setdefault(record.request_id, record)  # a redelivered duplicate: the same event
    # A correction whose swept row is not in the ledger becomes the row, already corrected (and
    # is summed as such). Where the swept row exists this inserts nothing (and waits for a
    # concurrent drainer's insert of it to commit, so the update below sees that row).
    insert_records(list(by_id.values()), zone_of)
    _drop_dangling_provider_keys(list(by_id.values()))
    rows = list(UsageRecord.objects.select_for_update().filter(
        request_id__in=list(by_id), status=UsageRecord.Status.SWEPT, corrected_at__isnull=True)
        .order_by("pk"))
    moves = []
    for row in rows:
        before = copy.copy(row)
        correction = by_id[row.request_id]
        row.swept_input_tokens = row.input_tokens
        row.swept_output_tokens = row.output_tokens
        row.swept_cost_micros = row.cost_micros
        for name in _CORRECTED_FIELDS:
            if not name.startswith("swept_"):
                setattr(row, name, getattr(correction, name))
        row.over_hold_tokens = over_hold(row.held_tokens, row.input_tokens, row.output_tokens)
        moves.append((before, row))
    if rows:
        # Bounded by the rows' own ended_at: PostgreSQL prunes the UPDATE to their partitions
        # when planning it. Without the bound it takes ROW EXCLUSIVE on every month's partition,
        # so it waits behind the retention's SHARE lock on an old month (billing/retention.py)
        # for as long as that month's check takes.
        (UsageRecord.objects
         .filter(ended_at__gte=min(r.ended_at for r in rows),
                 ended_at__lte=max(r.ended_at for r in rows))
         .bulk_update(rows, _CORRECTED_FIELDS))
        move_corrected(moves, zone_of)
    return len(rows)


@dataclass(frozen=True)
class DrainResult:
    events: int  # read from the streams and deleted after their rows were committed
    tenants: int
    # Per tenant, the day and month windows its drained events were charged to (the windows of
    # their holds' creation): where the threshold check after the drain must look, also when a
    # window has ended since (a settle at 23:59:59.9 drained after midnight).
    windows: dict[int, frozenset[Window]] = field(default_factory=dict)
    corrected: int = 0  # swept rows corrected by late settles or releases
    probed: int = 0  # tenants whose stream was looked at (one pipelined XLEN each)
    # Tenants whose batch PostgreSQL refused (logged; their events wait in their streams).
    refused: tuple[int, ...] = ()


@dataclass
class DrainProgress:
    """What a drain run has committed so far, counted at each commit (the one place a run's
    figures are added up). drain_all returns it as a DrainResult; a caller that passes its own
    still has it when the run raises part-way (PostgreSQL gone mid-run), so the threshold check
    can look at the windows of the batches that did commit (billing.tasks.drain_usage)."""

    events: dict[int, int] = field(default_factory=dict)  # per tenant, committed and deleted
    windows: dict[int, set[Window]] = field(default_factory=dict)
    corrected: int = 0
    refused: list[int] = field(default_factory=list)
    probed: int = 0

    def committed(self, batches: Sequence[_Parsed], corrected: int) -> None:
        """These batches' transaction committed (their XDEL may still fail: the next run reads
        them again and inserts nothing twice)."""
        self.corrected += corrected
        for one in batches:
            if one.entry_ids:
                self.events[one.tenant_id] = self.events.get(one.tenant_id, 0) + len(
                    one.entry_ids)
            if one.windows:
                self.windows.setdefault(one.tenant_id, set()).update(one.windows)

    def result(self) -> DrainResult:
        return DrainResult(sum(self.events.values()), len(self.events),
                           {t: frozenset(w) for t, w in self.windows.items()}, self.corrected,
                           probed=self.probed, refused=tuple(self.refused))


@dataclass
class _Parsed:
    """One batch of a tenant's stream, read and turned into ledger rows, not yet written."""

    tenant_id: int
    stream: str
    entry_ids: list[str]  # every entry read (malformed ones too: deleted with the rest)
    records: list[LedgerRow]
    corrections: list[LedgerRow]
    windows: set[Window]


def _parse(tenant_id: int, stream: str, entries: list[Any], prices: PriceBook,
           calendar: Calendar) -> _Parsed:
    """The batch's ledger rows (ledger_row) and the day and month windows its events were
    charged to. No database and no Redis: the drain runs it in a thread of its own while the
    previous batch is written (_drain_stream)."""
    out = _Parsed(tenant_id, stream, [entry_id for entry_id, _ in entries], [], [], set())
    # The instants [lo, hi) where the windows last added are the event's too (the day's is
    # within the month's): most events of a batch fall in them, and skip the lookups.
    lo = hi = 0
    for _entry_id, fields in entries:
        try:
            record = ledger_row(tenant_id, fields, prices)
        except (KeyError, ValueError):
            log.error("malformed usage event %r in %s: dropped", fields, stream)
            continue
        (out.corrections if fields["outcome"] == _CORRECTED else out.records).append(record)
        created_ms = int(fields.get("created") or fields["ended"])
        if not lo <= created_ms < hi:
            found = [calendar.window(kind, created_ms) for kind in _ALERT_WINDOW_KINDS]
            out.windows.update(found)
            lo, hi = max(w.start_ms for w in found), min(w.end_ms for w in found)
    return out


def _write(batches: Sequence[_Parsed], zones: Zones) -> int:
    """These batches' rows (one tenant's, or the first batches of several) in ONE transaction:
    one INSERT for all of them, only the rows it inserted summed into the rollups, then the
    corrections (after the inserts: a hold's swept event precedes its correction in the stream,
    and both may be in these batches). Returns how many swept rows were corrected."""
    records = [r for b in batches for r in b.records]
    corrections = [r for b in batches for r in b.corrections]
    with transaction.atomic():
        insert_records(records, zones.at)
        return _apply_corrections(corrections, zones.at) if corrections else 0


def _delete(client: Any, batches: Sequence[_Parsed]) -> None:
    """XDEL the written batches' entries, only after their commit (if PostgreSQL failed, the
    events are still in the stream); several streams in one pipelined round trip."""
    batches = [b for b in batches if b.entry_ids]
    if len(batches) == 1:
        client.xdel(batches[0].stream, *batches[0].entry_ids)
    elif batches:
        pipe = client.pipeline(transaction=False)
        for b in batches:
            pipe.xdel(b.stream, *b.entry_ids)
        pipe.execute()


def _stream_of(tenant_id: int) -> str:
    return keys.usage_stream_key(tenant_tag(tenant_id))


def _read(client: Any, stream: str, batch: int, after: str | None = None) -> list[Any]:
    """The stream's next `batch` entries: from its start, or after entry `after` (exclusive),
    which the drain has read but not deleted yet (its commit is still running)."""
    return client.xrange(stream, min=f"({after}" if after else "-", count=batch)


def _drain_batch(client: Any, tenant_id: int, batch: int, prices: PriceBook,
                 calendar_of_tenant: Callable[[], Calendar], zones: Zones,
                 progress: DrainProgress) -> None:
    """One batch of the tenant's stream in one transaction. Round trips: XRANGE; then, when it
    has events, CREATE TEMP TABLE IF NOT EXISTS, COPY, the insert with its rollups (one
    statement) and COMMIT (billing.rollups.insert_records; corrections add theirs); XDEL after
    the commit."""
    stream = _stream_of(tenant_id)
    entries = _read(client, stream, batch)
    if not entries:
        return
    # The tenant's windows (its day and cycle: quotas.cycles), read only when it has events.
    calendar = calendar_of_tenant()
    zones.add_schedule(tenant_id, calendar.schedule)
    parsed = _parse(tenant_id, stream, entries, prices, calendar)
    progress.committed([parsed], _write([parsed], zones))
    _delete(client, [parsed])


def _drain_stream(client: Any, tenant_id: int, batch: int, batches: int, prices: PriceBook,
                  calendar: Calendar, zones: Zones, progress: DrainProgress, *,
                  first: _Parsed | None = None, after: str = "") -> None:
    """Up to `batches` batches of the tenant's stream, each in its own transaction as in
    _drain_batch: `first` (read and parsed, not written yet) and those after it, or those after
    entry `after`. The next batch is read from Redis and parsed in a thread while the last one
    is written, so the parsing (Python) and PostgreSQL's insert overlap (docs/benchmarks.md,
    "The ledger at scale"). The thread touches no database; a batch that fails to write stops
    the tenant's drain (refused rows: _write_alone), its events and the ones read ahead still in
    the stream."""
    stream = _stream_of(tenant_id)

    def read_and_parse(since: str) -> tuple[int, _Parsed]:
        entries = _read(client, stream, batch, since)
        return len(entries), _parse(tenant_id, stream, entries, prices, calendar)

    with ThreadPoolExecutor(1, thread_name_prefix="drain-read") as pool:
        read, parsed = ((len(first.entry_ids), first) if first is not None
                        else pool.submit(read_and_parse, after).result())
        for n in range(batches):
            ahead = (pool.submit(read_and_parse, parsed.entry_ids[-1])
                     if read == batch and n + 1 < batches else None)
            if read and not _write_alone(client, parsed, zones, progress):
                break
            if ahead is None:
                break
            read, parsed = ahead.result()


def _calendar_of(tenant_id: int, tenant: Tenant | None = None) -> Callable[[], Calendar]:
    """The tenant's Calendar, from `tenant` (loaded with its plan by the caller) or loaded (one
    query) on first use, and kept for the drain run."""
    loaded: list[Calendar] = []

    def calendar() -> Calendar:
        if not loaded:
            one = tenant or Tenant.objects.select_related("plan").get(pk=tenant_id)
            loaded.append(calendar_for(one))
        return loaded[0]

    return calendar


# The first batch of this many busy tenants is read in one pipelined round trip and written in
# one transaction (a bound on the events held in memory at once: this many batches).
_PREFETCH_TENANTS = 20


def _first_batches(client: Any, tenant_ids: Sequence[int], batch: int) -> dict[int, list[Any]]:
    """Each tenant's first batch, read in one round trip (XRANGE each, pipelined). An entry a
    concurrent drain deletes meanwhile is inserted by neither twice (unique request ids)."""
    pipe = client.pipeline(transaction=False)
    for tenant_id in tenant_ids:
        pipe.xrange(_stream_of(tenant_id), count=batch)
    return dict(zip(tenant_ids, pipe.execute(), strict=True))


def drain_tenant(client: Any, tenant_id: int, *, batch: int = 500,
                 prices: PriceBook | None = None) -> int:
    """Move one batch of a tenant's usage events into the ledger; returns how many."""
    progress = DrainProgress()
    _drain_batch(client, tenant_id, batch, prices or PriceBook.load(), _calendar_of(tenant_id),
                 Zones(), progress)
    return sum(progress.events.values())


# Errors of a batch's own rows (a value PostgreSQL refuses, a reference gone): the tenant's events
# stay in its stream and the run goes on with the other tenants. Anything else (PostgreSQL down,
# a lost connection) fails the run, as every tenant would fail the same way.
_ROWS_REFUSED = (DataError, IntegrityError)


def _write_alone(client: Any, one: _Parsed, zones: Zones, progress: DrainProgress) -> bool:
    """One tenant's batch in its own transaction, then its XDEL; if PostgreSQL refuses its rows,
    logged, the tenant added to `progress.refused` and its events left in its stream (the
    backlog's age then grows: check_ledger_backlog alerts). Returns whether it was written."""
    try:
        corrected = _write([one], zones)
    except _ROWS_REFUSED:
        log.exception("usage events of tenant %s refused by PostgreSQL: left in %s",
                      one.tenant_id, one.stream)
        progress.refused.append(one.tenant_id)
        return False
    progress.committed([one], corrected)
    _delete(client, [one])
    return True


def _write_first_batches(client: Any, parsed: list[_Parsed], zones: Zones,
                         progress: DrainProgress) -> None:
    """The first batches of several tenants in one transaction (one commit for the group, the
    round trips of one batch: at 10 active tenants a run costs about what one tenant's batch
    does), then one pipelined XDEL. If that transaction fails (one tenant's rows refused, a
    deadlock with another drain), each tenant's batch is written in its own (_write_alone), so
    one tenant's bad rows hold back no other."""
    if len(parsed) > 1:
        try:
            corrected = _write(parsed, zones)
        except DatabaseError:
            log.warning("the first batches of %d tenants failed together: written one tenant "
                        "at a time", len(parsed), exc_info=True)
        else:
            progress.committed(parsed, corrected)
            _delete(client, parsed)
            return
    for one in parsed:
        _write_alone(client, one, zones, progress)


# A run's batches: 1,000 events a transaction, at most 10 a tenant (10,000 events a tenant per
# run, every 5 s). Measured: 500-event batches drained 12,000-14,700 rows/s, 1,000-event ones
# 15,000-19,000 (each commit's flush and round trips paid half as often).
DRAIN_BATCH = 1_000
DRAIN_BATCHES_PER_TENANT = 10


def drain_all(client: Any, *, batch: int = DRAIN_BATCH,
              max_batches_per_tenant: int = DRAIN_BATCHES_PER_TENANT,
              tenant_ids: Sequence[int] | None = None,
              progress: DrainProgress | None = None) -> DrainResult:
    """Drain these tenants' streams (default: every tenant in PostgreSQL; the drain_usage job
    passes the index of active tenants', quotas/active.py), bounded work per run: the next run
    continues. Which streams have events is asked first, pipelined (active.probe: one round trip
    per thousand tenants), so only those are read; the price book and those tenants (one query,
    with their plans: their calendars) are loaded only then, once per run. The busy tenants'
    first batches are read 20 tenants a round trip and written in one transaction per 20
    (_write_first_batches); a tenant with more than a batch waiting goes on alone, the next
    batch read while the last is written (_drain_stream). What commits is counted in
    `progress` (a new one if not given), which a caller keeps when the run raises."""
    progress = progress if progress is not None else DrainProgress()
    ids = list(tenant_ids) if tenant_ids is not None else active.all_tenant_ids()
    work = active.probe(client, ids, holds=False)
    progress.probed = len(ids)
    # In id order: concurrent drains insert a group's rows (and take their locks) in one order.
    busy = sorted({tenant_id for tenant_id in ids if work[tenant_id].events})
    if not busy:
        return progress.result()
    prices = PriceBook.load()
    loaded = Tenant.objects.select_related("plan").in_bulk(busy)
    # Per run: the tenants' schedules, and a Timeline where a row predates its cycle in force.
    zones = Zones()
    for tenant in loaded.values():
        zones.add(tenant)
    for start in range(0, len(busy), _PREFETCH_TENANTS):
        group = busy[start:start + _PREFETCH_TENANTS]
        first = _first_batches(client, group, batch)
        parsed: list[_Parsed] = []
        calendars: dict[int, Calendar] = {}
        for tenant_id in group:
            if not first[tenant_id]:
                continue
            # The windows the events were charged to, in the tenant's own (the gateway's)
            # calendar; a tenant deleted since the probe fails the run as before (its .get()
            # raises) before anything of its group is written.
            calendar = calendars[tenant_id] = _calendar_of(tenant_id, loaded.get(tenant_id))()
            zones.add_schedule(tenant_id, calendar.schedule)
            parsed.append(_parse(tenant_id, _stream_of(tenant_id), first[tenant_id], prices,
                                 calendar))
        if len(parsed) == 1 and len(parsed[0].entry_ids) == batch:
            # One busy tenant with more than a batch waiting: its stream from the first batch,
            # the second read while the first is written.
            [one] = parsed
            _drain_stream(client, one.tenant_id, batch, max_batches_per_tenant, prices,
                          calendars[one.tenant_id], zones, progress, first=one)
            continue
        _write_first_batches(client, parsed, zones, progress)
        if max_batches_per_tenant < 2:
            continue
        for one in parsed:
            if len(one.entry_ids) == batch and one.tenant_id not in progress.refused:
                _drain_stream(client, one.tenant_id, batch, max_batches_per_tenant - 1, prices,
                              calendars[one.tenant_id], zones, progress,
                              after=one.entry_ids[-1])
    return progress.result()


# -- the backlog: events waiting in Redis for the drain ----------------------------------------


@dataclass(frozen=True)
class Backlog:
    events: int  # undrained usage events, all tenants
    streams: int  # tenants with undrained events
    oldest_age_s: float  # age of the oldest undrained event on the Redis clock; 0 when none
    oldest_stream: str = ""  # the stream holding it


def _usage_streams(client: Any) -> list[str]:
    """The usage streams that may hold events: those of the index of active tenants
    (quotas/active.py: a tenant stays in it while its stream has events), the ones of tenants
    still in PostgreSQL. When PostgreSQL is down (the very time events pile up) the index alone,
    read from Redis. When the index is not whole (a shard without the drain's full-walk member:
    lost, or never walked), every tenant's stream, from PostgreSQL, or found by a SCAN of Redis
    while PostgreSQL is down. A stream the index missed (a gateway worker killed before its
    flush) is counted from the drain's next full walk on, which drains it too."""
    settings = active.ActiveSettings.from_django()
    indexed, walks, _now_ms = active.read_index(client, settings.shards)
    whole = active.is_whole(walks, active.DRAIN, settings.shards)
    try:
        if whole:
            tenant_ids = active.existing_tenant_ids(
                sorted({int(i.tenant) for i in indexed if i.tenant.isdigit()}))
        else:
            tenant_ids = list(Tenant.objects.order_by("pk").values_list("pk", flat=True))
    except DatabaseError:
        if whole:
            log.warning("tenants unreadable (PostgreSQL down?): the usage streams of the index "
                        "of active tenants")
            return sorted({keys.usage_stream_key(i.tenant) for i in indexed})
        log.warning("tenants unreadable (PostgreSQL down?): scanning Redis for usage streams")
        pattern = keys.usage_stream_pattern()
        return sorted(str(k) for k in client.scan_iter(match=pattern, count=1000,
                                                       _type="STREAM"))
    return [keys.usage_stream_key(tenant_tag(t)) for t in tenant_ids]


def _entry_ms(entry_id: Any) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0])


def usage_backlog(client: Any, streams: Iterable[str] | None = None, *,
                  chunk: int = 1000) -> Backlog:
    """How much the drain has not moved yet: XLEN of every usage stream, summed, and the age of
    the oldest entry (its id is the Redis server's time of the XADD). Pipelined, one round trip
    per `chunk` tenants."""
    names = list(streams) if streams is not None else _usage_streams(client)
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    events = busy = 0
    oldest_ms, oldest_stream = now_ms, ""
    for start in range(0, len(names), chunk):
        part = names[start:start + chunk]
        pipe = client.pipeline(transaction=False)
        for name in part:
            pipe.xlen(name)
            pipe.xrange(name, count=1)
        replies = pipe.execute()
        for i, name in enumerate(part):
            length, first = int(replies[2 * i]), replies[2 * i + 1]
            if not length or not first:
                continue
            events += length
            busy += 1
            first_ms = _entry_ms(first[0][0])
            if first_ms < oldest_ms:
                oldest_ms, oldest_stream = first_ms, name
    return Backlog(events, busy, max(now_ms - oldest_ms, 0) / 1000 if events else 0.0,
                   oldest_stream)
