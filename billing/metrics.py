"""Prometheus text exposition (format 0.0.4) of the gateway's background health, for /metrics.

    tollgate_open_holds{tenant}                 gauge: holds open now (ZCARD of the hold index)
    tollgate_usage_records_total{status}        counter: ledger rows by status (swept = leaks)
    tollgate_webhook_deliveries_total{status}   counter: webhook deliveries by status
    tollgate_reconciliation_difference_rate     gauge: the latest reconciliation run's largest
                                                row difference rate (0 when none ran)

The counters are counts of PostgreSQL rows, so they only ever grow (rows are never deleted in
normal operation) and survive restarts; Prometheus' rate() works on them as usual.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.core.exceptions import FieldError
from django.db.models import Count

from billing.models import UsageRecord, WebhookDelivery
from quotas import keys
from quotas.limits import tenant_tag
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


def render(client: Any = None) -> str:
    client = client if client is not None else get_engine().client
    lines: list[str] = []
    lines += _family("tollgate_open_holds", "gauge",
                     "Quota holds open now, per tenant (requests in flight or leaked).",
                     (({"tenant": slug}, n) for slug, n in open_holds(client)))
    lines += _family("tollgate_usage_records_total", "counter",
                     "Ledger rows by status (swept: holds the gateway never ended).",
                     _counts(UsageRecord, UsageRecord.Status.values))
    lines += _family("tollgate_webhook_deliveries_total", "counter",
                     "Webhook deliveries by status (failed: gave up after every retry).",
                     _counts(WebhookDelivery, WebhookDelivery.Status.values))
    lines += _family("tollgate_reconciliation_difference_rate", "gauge",
                     "Largest difference rate of the latest reconciliation run (0..1).",
                     [({}, reconciliation_difference_rate())])
    return "\n".join(lines) + "\n"
