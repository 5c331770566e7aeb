"""Usage events as the quota scripts append them to a tenant's stream (lua/settle.lua,
lua/sweep.lua: the fields billing.ledger.record_from_event reads), written straight to the
stream so that a test can place calls on any day, and a helper that records ledger rows through
the drain's own service (billing.rollups.insert_records), rows and rollup together."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from billing.models import UsageRecord
from billing.rollups import insert_records
from quotas import keys
from quotas.keys import tenant_tag


def _ms(moment: datetime) -> str:
    return str(int(moment.timestamp() * 1000))


def settled(rid: str, ended: datetime, *, project: int | None, key: int | None,
            model: str = "gpt-4o", inp: int = 100, out: int = 50, money: int = 1234,
            held: int = 1000, cached: int = 0, outcome: str = "complete") -> dict[str, str]:
    meta = {"p": project, "k": key, "m": model, "served": model, "ep": "chat/completions"}
    event = {"in": inp, "out": out, "ci": cached, "st": 200, "lat": 10, "outcome": outcome,
             "pk": None, "stream": False, "soft": False}
    return {"request_id": rid, "outcome": "settled", "actual": str(inp + out),
            "meta": json.dumps(meta), "event": json.dumps(event), "ended": _ms(ended),
            "created": _ms(ended), "held": str(held), "money": str(money)}


def unmetered(rid: str, ended: datetime, *, project: int | None, key: int | None,
              inp: int = 70, out: int = 30) -> dict[str, str]:
    fields = settled(rid, ended, project=project, key=key, inp=inp, out=out, held=0)
    fields["outcome"] = "unmetered"
    del fields["money"]
    return fields


def released(rid: str, ended: datetime, *, project: int | None,
             key: int | None) -> dict[str, str]:
    meta = {"p": project, "k": key, "m": "gpt-4o", "served": "gpt-4o", "ep": "chat/completions"}
    return {"request_id": rid, "outcome": "released", "actual": "0", "meta": json.dumps(meta),
            "event": json.dumps({"st": 502, "outcome": "upstream_status"}),
            "ended": _ms(ended), "created": _ms(ended), "held": "1000"}


def swept(rid: str, ended: datetime, *, project: int | None, key: int | None,
          inp: int = 100, out: int = 900, money: int = 5000) -> dict[str, str]:
    meta = {"p": project, "k": key, "m": "gpt-4o", "served": "gpt-4o", "ep": "chat/completions"}
    return {"request_id": rid, "outcome": "swept", "actual": str(inp + out),
            "meta": json.dumps(meta), "event": "", "ended": _ms(ended), "created": _ms(ended),
            "held": "1000", "in": str(inp), "out": str(out), "basis": "forwarded",
            "money": str(money)}


def corrected(rid: str, ended: datetime, *, project: int | None, key: int | None,
              inp: int = 100, out: int = 200, money: int = 2000, swept_tokens: int = 1000,
              swept_money: int = 5000) -> dict[str, str]:
    fields = settled(rid, ended, project=project, key=key, inp=inp, out=out, money=money)
    fields.update(outcome="corrected", swept=str(swept_tokens), swept_money=str(swept_money))
    return fields


def push(client: Any, tenant_id: int, events: list[dict[str, str]]) -> None:
    stream = keys.usage_stream_key(tenant_tag(tenant_id))
    for fields in events:
        client.xadd(stream, fields)


def create_usage(**fields: Any) -> UsageRecord:
    """A ledger row written as the drain writes it (billing.rollups.insert_records: the row and
    its rollup sums in one transaction). Tests that put rows in the ledger directly and then read
    reports, the usage API or the dashboard use this instead of UsageRecord.objects.create: those
    readers read the rollup, which only the ledger's writers keep."""
    row = UsageRecord(**fields)
    insert_records([row], returning=True)
    return row
