"""The usage ledger: drain the gateway's per-tenant usage streams into PostgreSQL.

Settle, release and sweep append one event per ended hold to `tg:{t<id>}:usage` atomically with
the counters (lua/settle.lua). Draining reads a batch, writes it in one transaction, and only
then deletes it from the stream, so nothing is lost while PostgreSQL is down (events wait in
Redis) and a redelivered event never makes a second row (request ids are unique).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from billing.models import UsageRecord
from billing.prices import PriceBook
from gateway.models import ProviderKey
from quotas import keys
from quotas.limits import tenant_tag
from tenants.models import ApiKey, Project, Tenant

log = logging.getLogger(__name__)

_COMPLETE = "complete"


def _json(raw: Any) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _moment(ms: Any) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_from_event(tenant_id: int, fields: dict[str, str], prices: PriceBook) -> UsageRecord:
    """The ledger row of one usage event (unsaved)."""
    meta, details = _json(fields.get("meta")), _json(fields.get("event"))
    outcome = fields["outcome"]
    actual = int(fields.get("actual") or 0)
    if outcome == "settled":
        status = (UsageRecord.Status.SETTLED if details.get("outcome", _COMPLETE) == _COMPLETE
                  else UsageRecord.Status.PARTIAL)
        input_tokens = _int(details.get("in"))
        output_tokens = _int(details.get("out"))
        if input_tokens is None or output_tokens is None:
            # An event without the split (settled outside the gateway): all of it as input.
            input_tokens, output_tokens = actual, 0
    else:
        status = UsageRecord.Status(outcome)
        input_tokens = output_tokens = 0
    ended = _moment(fields["ended"])
    model = str(meta.get("m") or "")
    served = str(meta.get("served") or model)
    return UsageRecord(
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
        held_tokens=int(fields.get("held") or 0),
        cost_micros=prices.price(served, ended).cost(input_tokens, output_tokens),
        status=status,
        detail=str(details.get("outcome") or outcome)[:64],
        http_status=_int(details.get("st")),
        latency_ms=_int(details.get("lat")),
        streamed=bool(details.get("stream")),
        over_soft_limit=bool(details.get("soft")),
        started_at=_moment(fields.get("created") or fields["ended"]),
        ended_at=ended,
    )


def _drop_dangling_references(records: list[UsageRecord]) -> None:
    """A project, key or provider key deleted since the call must not fail the whole batch."""
    for field, model in (("project_id", Project), ("api_key_id", ApiKey),
                         ("provider_key_id", ProviderKey)):
        wanted = {getattr(r, field) for r in records if getattr(r, field) is not None}
        if not wanted:
            continue
        existing = set(model.objects.filter(pk__in=wanted).values_list("pk", flat=True))
        for record in records:
            if getattr(record, field) not in existing:
                setattr(record, field, None)


@dataclass(frozen=True)
class DrainResult:
    events: int  # read from the streams and deleted after their rows were committed
    tenants: int


def drain_tenant(client: Any, tenant_id: int, *, batch: int = 500,
                 prices: PriceBook | None = None) -> int:
    """Move one batch of a tenant's usage events into the ledger; returns how many."""
    stream = keys.usage_stream_key(tenant_tag(tenant_id))
    entries = client.xrange(stream, count=batch)
    if not entries:
        return 0
    prices = prices or PriceBook.load()
    records = []
    for _entry_id, fields in entries:
        try:
            records.append(record_from_event(tenant_id, fields, prices))
        except (KeyError, ValueError):
            log.error("malformed usage event %r in %s: dropped", fields, stream)
    _drop_dangling_references(records)
    with transaction.atomic():
        UsageRecord.objects.bulk_create(records, ignore_conflicts=True)
    # Only after the commit: if PostgreSQL failed above, the events are still in the stream.
    client.xdel(stream, *[entry_id for entry_id, _ in entries])
    return len(entries)


def drain_all(client: Any, *, batch: int = 500, max_batches_per_tenant: int = 20) -> DrainResult:
    """Drain every tenant's stream (bounded work per run: the next run continues)."""
    prices = PriceBook.load()
    total = tenants = 0
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
        moved = 0
        for _ in range(max_batches_per_tenant):
            n = drain_tenant(client, tenant_id, batch=batch, prices=prices)
            moved += n
            if n < batch:
                break
        if moved:
            tenants += 1
            total += moved
    return DrainResult(total, tenants)
