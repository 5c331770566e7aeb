"""/metrics: the request metrics (gateway/metrics.py: every worker's, in multiprocess mode) and
the gateway's background health below, read from PostgreSQL and Redis at each scrape by a
prometheus_client Collector, rendered by prometheus_client (text format 0.0.4).

    tollgate_open_holds                         gauge: holds open now, all tenants (ZCARD of the
                                                hold index of each tenant of the index of active
                                                tenants)
    tollgate_tenant_open_holds{tenant}          gauge: the same, only for the tenants listed in
                                                TOLLGATE_METRICS_TENANTS (absent when none is)
    tollgate_usage_records_total{status}        counter: ledger rows by the status they were
                                                recorded with (swept = leaks, corrected or not)
    tollgate_usage_corrections_total            counter: swept rows corrected by a settle or
                                                release that arrived after the sweep
    tollgate_over_hold_requests_total           counter: calls whose usage exceeded their hold
    tollgate_over_hold_tokens_total             counter: tokens used above the holds
    tollgate_usage_backlog_events               gauge: usage events waiting for the ledger drain
                                                (XLEN of every tenant's stream, summed)
    tollgate_usage_backlog_oldest_seconds       gauge: age of the oldest of them (0 when none)
    tollgate_webhook_deliveries_total{status}   counter: webhook deliveries by status
    tollgate_reconciliation_difference_rate     gauge: the latest reconciliation run's largest
                                                row difference rate (0 when none ran)
    tollgate_provider_breaker_state{provider_key,model}
                                                gauge: a circuit breaker's state (0 closed,
                                                1 half-open, 2 open); model "*" is the key's own
                                                breaker (transport failures), else one model's
                                                (bounded: see below)
    tollgate_provider_breaker_transitions_total{provider_key,model,to}
                                                counter: transitions to opened / half_opened /
                                                closed, counted by the breaker scripts in Redis

The counters are counts of PostgreSQL rows, so they only ever grow (rows are never deleted in
normal operation) and survive restarts; Prometheus' rate() works on them as usual. A corrected
row changes status (swept -> settled, partial or released) but stays counted as swept, so no
count ever goes down.

Over-hold usage (invariant 2: the hold bounds the bill, a tokenizer error may still exceed it)
comes from the ledger (UsageRecord.over_hold_tokens, filled by the drain), not from the counters'
`over` field: the counters expire two days after their window and every scope of a call (tenant,
project, key, model) adds the same excess to its own, so they can give neither a durable total
nor a count of calls.

The ledger families (rows by status, corrections, over-hold) are billing.LedgerTotal (the UTC
daily rollup's sums of every day before today - LIVE_DAYS, written once a day:
refresh_closed_days) plus the UTC rollup rows (billing.UsageRollup, kept by the drain:
billing/rollups.py) of the days since, summed per (status, corrected): a scrape reads the last
few days' rollup rows, however old the ledger is. Both outlive the raw rows that retention drops
(so the counters never go down when a month is dropped). Rows drained before the rollup existed
count once `manage.py rollup_rebuild` has run (and, for days before LedgerTotal's `through`, the
next daily refresh).

The breaker families list the provider keys from PostgreSQL and read each key's breakers from
Redis (gateway/circuit.py, quotas/breakers.py); their transition counts live in the breakers'
Redis hashes, so they start again from 0 if Redis loses its data (Prometheus' rate() treats that
as a counter reset). A breaker never used is not listed. Their `model` label is bounded as the
request metrics' is (gateway/metrics.py model_label): a catalog model (an alias counts as its
model), else "other". A key keeps a breaker per model name it served (a 5xx for one name must
not stop the others), and a key with a default price serves any name a client sends, so each
such name has a breaker: under "other" they are one series per key, its state the worst of
theirs, its transitions their sum (a breaker hash expires a day after its last record, which
can lower that sum: read as a counter reset).

The backlog gauges come from Redis only, so they are there while PostgreSQL is down (the very
time the backlog grows); the families read from PostgreSQL are left out then, and logged.
"""
from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta
from collections.abc import Iterable, Iterator
from typing import Any

from django.core.exceptions import FieldError
from django.db import DatabaseError, connection, transaction
from django.conf import settings
from django.db.models import Count, Q, Sum
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from billing.ledger import usage_backlog
from billing.models import LedgerTotal, UsageRecord, UsageRollup, WebhookDelivery
from billing.rollups import UTC_ZONE
from gateway import metrics as request_metrics
from gateway.catalog import load_catalog
from gateway.models import ProviderKey
from quotas import active
from quotas.breakers import KEY_LEVEL, BreakerStore
from quotas.runtime import get_engine
from tenants.models import Tenant

log = logging.getLogger(__name__)

# What generate_latest writes (prometheus_client's CONTENT_TYPE_LATEST names a newer version).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

Samples = Iterable[tuple[dict[str, object], float | int]]


def _family(kind: type[Metric], name: str, help_text: str, samples: Samples) -> Metric:
    """A family of samples, each with its own labels (the same label names within a family)."""
    items = list(samples)
    labels = list(items[0][0]) if items else []
    family = kind(name, help_text, labels=labels)
    for sample_labels, value in items:
        family.add_metric([str(sample_labels[k]) for k in labels], value)
    return family


def _gauge(name: str, help_text: str, samples: Samples) -> Metric:
    return _family(GaugeMetricFamily, name, help_text, samples)


def _counter(name: str, help_text: str, samples: Samples) -> Metric:
    return _family(CounterMetricFamily, name, help_text, samples)


def open_holds(client: Any) -> int:
    """Every quota hold open now: the ZCARD of the hold index of each tenant of the index of
    active tenants (quotas/active.py: a tenant with an open hold stays in it), pipelined. So a
    scrape costs what activity does, not the number of tenants (at 100,000 idle tenants it read
    every one, and wrote a series for each). When the index is not whole for the sweep (lost,
    never walked), every tenant's, as the sweep's next run walks them all. A tenant the index
    missed (a gateway worker killed within a second of its first call) is counted from the
    sweep's next full walk on, which also sweeps its holds."""
    tenant_ids = active.indexed_tenant_ids(client, active.SWEEP)
    if tenant_ids is None:
        tenant_ids = active.all_tenant_ids()
    return sum(work.holds for work in active.probe(client, tenant_ids, events=False).values())


def listed_open_holds(client: Any) -> list[tuple[str, int]]:
    """(tenant label, holds open now) of the tenants listed in TOLLGATE_METRICS_TENANTS (by
    public id or slug; the label is the entry as written): a tenant label only where the
    operator bounded it (gateway/metrics.py, the request families' rule)."""
    listed = settings.TOLLGATE_METRICS_TENANTS
    if not listed:
        return []
    found = list(Tenant.objects.filter(Q(public_id__in=listed) | Q(slug__in=listed))
                 .order_by("pk").values_list("pk", "public_id", "slug"))
    work = active.probe(client, [pk for pk, _, _ in found], events=False)
    out: list[tuple[str, int]] = []
    for pk, public_id, slug in found:
        label = request_metrics.tenant_label(public_id, slug)
        if label is not None:
            out.append((label, work[pk].holds))
    return out


def _counts(model: Any, statuses: Iterable[str]) -> list[tuple[dict[str, object], int]]:
    found = dict(model.objects.order_by().values_list("status").annotate(n=Count("pk")))
    return [({"status": status}, int(found.get(status, 0))) for status in statuses]


Sums = dict[tuple[str, bool], tuple[int, int, int]]

# The days a scrape sums from the rollups itself; the days before are LedgerTotal's, written
# once a day. Three: a drain backlog or correction reaching further back is rare (see
# refresh_closed_days).
LIVE_DAYS = 3


def _rollup_sums(days: Q = Q()) -> Sums:
    """(status, corrected) -> (rows, over-hold calls, over-hold tokens), summed over the UTC
    rollups (billing.UsageRollup: every row once, a row per tenant, day and group) of `days`."""
    found = (UsageRollup.objects.filter(days, zone=UTC_ZONE).order_by()
             .values_list("status", "corrected")
             .annotate(n=Sum("requests"), calls=Sum("over_hold_requests"),
                       tokens=Sum("over_hold_tokens")))
    return {(status, bool(corrected)): (int(n or 0), int(calls or 0), int(tokens or 0))
            for status, corrected, n, calls, tokens in found}


def _plus(sums: Sums, more: Sums) -> Sums:
    """`sums` with `more` added, group by group."""
    out = dict(sums)
    for group, (n, calls, tokens) in more.items():
        base = out.get(group, (0, 0, 0))
        out[group] = (base[0] + n, base[1] + calls, base[2] + tokens)
    return out


def _ledger_sums() -> Sums:
    """The ledger counters' sums: LedgerTotal (every day before its `through`) plus the UTC
    rollups from `through` on, so a scrape reads the last few days' rollup rows whatever the
    ledger's age; every rollup row while LedgerTotal is empty. A refresh between the two reads
    changes no rollup row, so the pair is consistent either way."""
    totals = list(LedgerTotal.objects.all())
    if not totals:
        return _rollup_sums()
    closed: Sums = {(t.status, t.corrected): (t.requests, t.over_hold_requests,
                                               t.over_hold_tokens) for t in totals}
    return _plus(closed, _rollup_sums(Q(day__gte=totals[0].through)))


def refresh_closed_days(today: date | None = None) -> date:
    """Write LedgerTotal anew: the UTC rollups of every day before today - LIVE_DAYS (one sum of
    the rollups a day instead of at every scrape). Returns its `through`.

    The counters must never go down (Prometheus reads a drop as a reset). The days moving from
    the scrape's live part into the totals, [old through, new through), are summed with the
    rollups held still (SHARE lock: drains wait for that one sum): a drain committing into them
    during the sum would be in a scrape before this commit and in neither part after it. The
    days before the old `through` are summed without that lock: a late row committed meanwhile
    was in neither part before and is in neither now, until the next refresh. Refreshes run one
    at a time (EXCLUSIVE lock on LedgerTotal; scrapes still read it). A rollup row of a closed
    day that changes later (a drain backlog of more than LIVE_DAYS days, `rollup_rebuild`)
    reaches the counters at the next refresh; a rebuild that lowers a sum makes them go down
    then."""
    through = (today or datetime.now(UTC).date()) - timedelta(days=LIVE_DAYS)
    table = connection.ops.quote_name(LedgerTotal._meta.db_table)
    rollups = connection.ops.quote_name(UsageRollup._meta.db_table)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
        old = LedgerTotal.objects.values_list("through", flat=True).first()
        if old is not None and through <= old:
            return old  # nothing moves out of the live part (run twice a day, a clock back)
        sums = _rollup_sums(Q(day__lt=old)) if old is not None else {}
        with connection.cursor() as cursor:
            # Not for long: if drains hold the rollups, the refresh waits for the next day.
            cursor.execute("SET LOCAL lock_timeout = '10s'")
            cursor.execute(f"LOCK TABLE {rollups} IN SHARE MODE")
        sums = _plus(sums, _rollup_sums(Q(day__gte=old, day__lt=through) if old is not None
                                        else Q(day__lt=through)))
        LedgerTotal.objects.all().delete()
        LedgerTotal.objects.bulk_create(
            LedgerTotal(through=through, status=status, corrected=corrected, requests=n,
                        over_hold_requests=calls, over_hold_tokens=tokens)
            for (status, corrected), (n, calls, tokens) in sums.items())
        if not sums:  # nothing before `through` yet: a zero row keeps `through` on record
            LedgerTotal.objects.create(through=through, status=UsageRecord.Status.SETTLED,
                                       corrected=False, requests=0, over_hold_requests=0,
                                       over_hold_tokens=0)
    return through


def usage_record_counts(sums: Sums | None = None,
                        ) -> list[tuple[dict[str, object], int]]:
    """Ledger rows by status, a corrected row counted as swept (what it was recorded as), so a
    correction never makes a counter go down."""
    sums = _ledger_sums() if sums is None else sums
    found: dict[str, int] = {}
    for (status, corrected), (n, _calls, _tokens) in sums.items():
        recorded = UsageRecord.Status.SWEPT if corrected else status
        found[recorded] = found.get(recorded, 0) + n
    return [({"status": status}, int(found.get(status, 0)))
            for status in UsageRecord.Status.values]


def corrections(sums: Sums | None = None) -> int:
    sums = _ledger_sums() if sums is None else sums
    return sum(n for (_status, corrected), (n, _c, _t) in sums.items() if corrected)


def over_hold(sums: Sums | None = None,
              ) -> tuple[int, int]:
    """(calls whose usage exceeded their hold, tokens above the holds), from the rollup."""
    sums = _ledger_sums() if sums is None else sums
    return (sum(calls for _n, calls, _t in sums.values()),
            sum(tokens for _n, _c, tokens in sums.values()))


def reconciliation_difference_rate() -> float:
    """The latest reconciliation run's max difference rate; 0 when none ran or the
    reconciliation models are not installed."""
    try:
        from billing.models import ReconciliationRun  # type: ignore[attr-defined]
    except ImportError:
        return 0.0
    try:
        latest = (ReconciliationRun.objects.order_by("-started_at", "-pk")
                  .values_list("max_difference_rate", flat=True).first())
    except FieldError:
        log.warning("ReconciliationRun has no started_at / max_difference_rate: metric is 0")
        return 0.0
    return float(latest or 0)


_BREAKER_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}
_BREAKER_TRANSITIONS = ("opened", "half_opened", "closed")


def breaker_samples(client: Any, catalog: Any = None,
                    ) -> tuple[list[tuple[dict[str, object], int]],
                               list[tuple[dict[str, object], int]]]:
    """(state samples, transition samples) of every provider key's breakers that exist, by
    provider key and bounded model label (see the module docstring); `catalog`: the model
    catalog the labels are of (read now when None)."""
    if catalog is None:
        catalog = load_catalog()
    store = BreakerStore(client)
    states: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    for pk, public_id in ProviderKey.objects.order_by("pk").values_list("pk", "public_id"):
        for breaker in store.snapshots(pk):
            if breaker.model == KEY_LEVEL:
                if not (breaker.calls or breaker.opened):
                    continue  # the key's own breaker was never used: no hash
                model = "*"
            else:
                model = request_metrics.model_label(catalog, breaker.model)
            series = (public_id, model)
            states[series] = max(states.get(series, 0),
                                 _BREAKER_STATE_VALUE.get(breaker.state, 0))
            total = counts.setdefault(series, [0] * len(_BREAKER_TRANSITIONS))
            for i, n in enumerate((breaker.opened, breaker.half_opened, breaker.closed)):
                total[i] += n
    return ([({"provider_key": key, "model": model}, value)
             for (key, model), value in states.items()],
            [({"provider_key": key, "model": model, "to": to}, n)
             for (key, model), total in counts.items()
             for to, n in zip(_BREAKER_TRANSITIONS, total, strict=True)])


def _database_families(client: Any) -> list[Metric]:
    """The families read from PostgreSQL (each with Redis figures), all or none: built before
    any is handed to the scrape, so an outage halfway leaves them all out."""
    ledger = _ledger_sums()
    over_calls, over_tokens = over_hold(ledger)
    states, transitions = breaker_samples(client)
    listed = listed_open_holds(client)
    tenant_holds = [_gauge("tollgate_tenant_open_holds",
                           "Quota holds open now of the tenants listed in "
                           "TOLLGATE_METRICS_TENANTS.",
                           (({"tenant": label}, n) for label, n in listed))] if listed else []
    return [
        _gauge("tollgate_open_holds",
               "Quota holds open now, all tenants (requests in flight or leaked).",
               [({}, open_holds(client))]),
        *tenant_holds,
        _counter("tollgate_usage_records_total",
                 "Ledger rows by the status they were recorded with (swept: holds the gateway "
                 "never ended, corrected later or not).", usage_record_counts(ledger)),
        _counter("tollgate_usage_corrections_total",
                 "Swept ledger rows corrected by a settle or release that came after the sweep.",
                 [({}, corrections(ledger))]),
        _counter("tollgate_over_hold_requests_total",
                 "Calls whose actual usage exceeded their hold (token estimate too low).",
                 [({}, over_calls)]),
        _counter("tollgate_over_hold_tokens_total",
                 "Tokens used above the holds, summed over those calls.", [({}, over_tokens)]),
        _counter("tollgate_webhook_deliveries_total",
                 "Webhook deliveries by status (failed: gave up after every retry).",
                 _counts(WebhookDelivery, WebhookDelivery.Status.values)),
        _gauge("tollgate_reconciliation_difference_rate",
               "Largest difference rate of the latest reconciliation run (0..1).",
               [({}, reconciliation_difference_rate())]),
        _gauge("tollgate_provider_breaker_state",
               "Circuit breaker of an upstream provider key (model *: the key's own; other: "
               "every name outside the catalog, the worst of their states): 0 closed, "
               "1 half-open, 2 open.", states),
        _counter("tollgate_provider_breaker_transitions_total",
                 "Circuit breaker transitions of an upstream provider key, by the state "
                 "entered (model other: summed over the names outside the catalog).",
                 transitions),
    ]


class BillingCollector:
    """The families read at scrape time: PostgreSQL's (left out, and logged, while it is
    down) and the usage backlog from Redis (there during that very outage)."""

    def __init__(self, client: Any = None) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        client = self.client if self.client is not None else get_engine().client
        try:
            yield from _database_families(client)
        except DatabaseError:
            log.exception("/metrics: PostgreSQL unreadable, its families are left out")
        backlog = usage_backlog(client)
        yield _gauge("tollgate_usage_backlog_events",
                     "Usage events waiting in Redis for the ledger drain, all tenants.",
                     [({}, backlog.events)])
        yield _gauge("tollgate_usage_backlog_oldest_seconds",
                     "Age of the oldest usage event waiting for the ledger drain (0: none).",
                     [({}, round(backlog.oldest_age_s, 3))])


class _RequestCollector:
    def collect(self) -> Iterator[Metric]:
        return iter(request_metrics.families())


def exposition(*collectors: Any) -> str:
    """Prometheus' text format of these collectors' families."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


def render(client: Any = None) -> str:
    """The whole /metrics page: the request metrics, then the families read now."""
    return exposition(_RequestCollector(), BillingCollector(client))
