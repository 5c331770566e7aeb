"""Prometheus text exposition (format 0.0.4) of the gateway's background health, for /metrics.

    tollgate_open_holds{tenant}                 gauge: holds open now (ZCARD of the hold index)
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
nor a count of calls. A partial index keeps the query cheap however long the ledger is.

The breaker families list the provider keys from PostgreSQL and read each key's breakers from
Redis (gateway/circuit.py, quotas/breakers.py); their transition counts live in the breakers'
Redis hashes, so they start again from 0 if Redis loses its data (Prometheus' rate() treats that
as a counter reset). A breaker never used is not listed.

The backlog gauges come from Redis only, so they are there while PostgreSQL is down (the very
time the backlog grows); the families read from PostgreSQL are left out then, and logged.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.core.exceptions import FieldError
from django.db import DatabaseError
from django.db.models import Count, Sum

from billing.ledger import usage_backlog
from billing.models import UsageRecord, WebhookDelivery
from gateway.models import ProviderKey
from quotas import keys
from quotas.breakers import KEY_LEVEL, BreakerStore
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from tenants.models import Tenant

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_CHUNK = 1000


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[dict[str, object], float | int]]) -> Iterator[str]:
    yield f"# HELP {name} {help_text}"
    yield f"# TYPE {name} {kind}"
    for labels, value in samples:
        inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        yield f"{name}{{{inner}}} {value}" if inner else f"{name} {value}"


def open_holds(client: Any) -> list[tuple[str, int]]:
    """(tenant slug, open holds) for every tenant, pipelined ZCARD in chunks."""
    tenants: Sequence[tuple[int, str]] = list(
        Tenant.objects.order_by("pk").values_list("pk", "slug"))
    result: list[tuple[str, int]] = []
    for start in range(0, len(tenants), _CHUNK):
        chunk = tenants[start:start + _CHUNK]
        pipe = client.pipeline(transaction=False)
        for tenant_id, _slug in chunk:
            pipe.zcard(keys.hold_index_key(tenant_tag(tenant_id)))
        result += [(slug, int(n)) for (_id, slug), n in zip(chunk, pipe.execute(), strict=True)]
    return result


def _counts(model: Any, statuses: Iterable[str]) -> list[tuple[dict[str, object], int]]:
    found = dict(model.objects.order_by().values_list("status").annotate(n=Count("pk")))
    return [({"status": status}, int(found.get(status, 0))) for status in statuses]


def usage_record_counts() -> list[tuple[dict[str, object], int]]:
    """Ledger rows by status, a corrected row counted as swept (what it was recorded as), so a
    correction never makes a counter go down."""
    found = dict(UsageRecord.objects.order_by().values_list("status").annotate(n=Count("pk")))
    corrected = dict(UsageRecord.objects.filter(corrected_at__isnull=False).order_by()
                     .values_list("status").annotate(n=Count("pk")))
    for status, n in corrected.items():
        found[status] = found.get(status, 0) - n
        found[UsageRecord.Status.SWEPT] = found.get(UsageRecord.Status.SWEPT, 0) + n
    return [({"status": status}, int(found.get(status, 0)))
            for status in UsageRecord.Status.values]


def corrections() -> int:
    return UsageRecord.objects.filter(corrected_at__isnull=False).count()


def over_hold() -> tuple[int, int]:
    """(calls whose usage exceeded their hold, tokens above the holds), from the ledger."""
    sums = UsageRecord.objects.filter(over_hold_tokens__gt=0).aggregate(
        n=Count("pk"), tokens=Sum("over_hold_tokens"))
    return int(sums["n"] or 0), int(sums["tokens"] or 0)


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


def breaker_samples(client: Any) -> tuple[list[tuple[dict[str, object], int]],
                                           list[tuple[dict[str, object], int]]]:
    """(state samples, transition samples) of every provider key's breakers that exist."""
    store = BreakerStore(client)
    states: list[tuple[dict[str, object], int]] = []
    transitions: list[tuple[dict[str, object], int]] = []
    for pk, public_id in ProviderKey.objects.order_by("pk").values_list("pk", "public_id"):
        for breaker in store.snapshots(pk):
            if breaker.model == KEY_LEVEL and not (breaker.calls or breaker.opened):
                continue  # the key's own breaker was never used: no hash
            labels = {"provider_key": public_id, "model": breaker.model or "*"}
            states.append((labels, _BREAKER_STATE_VALUE.get(breaker.state, 0)))
            counts = (breaker.opened, breaker.half_opened, breaker.closed)
            transitions += [({**labels, "to": to}, n)
                            for to, n in zip(_BREAKER_TRANSITIONS, counts, strict=True)]
    return states, transitions


def _database_families(client: Any) -> list[str]:
    lines: list[str] = []
    lines += _family("tollgate_open_holds", "gauge",
                     "Quota holds open now, per tenant (requests in flight or leaked).",
                     (({"tenant": slug}, n) for slug, n in open_holds(client)))
    lines += _family("tollgate_usage_records_total", "counter",
                     "Ledger rows by the status they were recorded with (swept: holds the "
                     "gateway never ended, corrected later or not).",
                     usage_record_counts())
    lines += _family("tollgate_usage_corrections_total", "counter",
                     "Swept ledger rows corrected by a settle or release that came after the "
                     "sweep.", [({}, corrections())])
    over_calls, over_tokens = over_hold()
    lines += _family("tollgate_over_hold_requests_total", "counter",
                     "Calls whose actual usage exceeded their hold (token estimate too low).",
                     [({}, over_calls)])
    lines += _family("tollgate_over_hold_tokens_total", "counter",
                     "Tokens used above the holds, summed over those calls.",
                     [({}, over_tokens)])
    lines += _family("tollgate_webhook_deliveries_total", "counter",
                     "Webhook deliveries by status (failed: gave up after every retry).",
                     _counts(WebhookDelivery, WebhookDelivery.Status.values))
    lines += _family("tollgate_reconciliation_difference_rate", "gauge",
                     "Largest difference rate of the latest reconciliation run (0..1).",
                     [({}, reconciliation_difference_rate())])
    states, transitions = breaker_samples(client)
    lines += _family("tollgate_provider_breaker_state", "gauge",
                     "Circuit breaker of an upstream provider key (model *: the key's own): "
                     "0 closed, 1 half-open, 2 open.", states)
    lines += _family("tollgate_provider_breaker_transitions_total", "counter",
                     "Circuit breaker transitions of an upstream provider key, by the state "
                     "entered.", transitions)
    return lines


def render(client: Any = None) -> str:
    client = client if client is not None else get_engine().client
    lines: list[str] = []
    try:
        lines += _database_families(client)
    except DatabaseError:
        log.exception("/metrics: PostgreSQL unreadable, its families are left out")
    backlog = usage_backlog(client)
    lines += _family("tollgate_usage_backlog_events", "gauge",
                     "Usage events waiting in Redis for the ledger drain, all tenants.",
                     [({}, backlog.events)])
    lines += _family("tollgate_usage_backlog_oldest_seconds", "gauge",
                     "Age of the oldest usage event waiting for the ledger drain (0: none).",
                     [({}, round(backlog.oldest_age_s, 3))])
    return "\n".join(lines) + "\n"
