"""A tenant's usage from the ledger, grouped for the console and the management API.

The ledger is a few seconds behind the Redis counters (it is drained every 5 s); live
"remaining" figures come from the quota counters instead (quotas/status.py).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Literal

from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing.models import UsageRecord
from gateway.usage import TOKEN_CLASSES
from tenants.models import Tenant

GroupBy = Literal["day", "project", "key", "model"]
GROUPINGS: dict[str, tuple[str, ...]] = {
    "day": ("day",),
    "project": ("project__public_id", "project__slug"),
    "key": ("api_key__public_id", "api_key__name"),
    "model": ("served_model",),
}
# The token classes, each part of a total (of input_tokens: cached and cache-write input; of
# output_tokens: reasoning), as the ledger keeps them (gateway/usage.py).
_SUMS = {
    "requests": Count("id"),
    "input_tokens": Sum("input_tokens"),
    "output_tokens": Sum("output_tokens"),
    **{name: Sum(name) for name in TOKEN_CLASSES},
    "cost_micros": Sum("cost_micros"),
}


def day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


def records(tenant: Tenant, start: date, end: date, *, project: str | None = None,
            key: str | None = None) -> QuerySet[UsageRecord]:
    """The tenant's ledger rows that ended on days start..end (inclusive, UTC), optionally of one
    project or API key (public ids; looked up through the tenant, so another tenant's id simply
    matches nothing)."""
    rows = UsageRecord.objects.filter(
        tenant=tenant, ended_at__gte=day_start(start), ended_at__lt=day_start(end + timedelta(days=1))
    )
    if project is not None:
        rows = rows.filter(project__public_id=project)
    if key is not None:
        rows = rows.filter(api_key__public_id=key)
    return rows


def usage_totals(
    tenant: Tenant, start: date, end: date, group_by: tuple[str, ...] = ("day",), *,
    project: str | None = None, key: str | None = None,
) -> list[dict[str, Any]]:
    """Requests, input / output / total tokens, the token classes (cached input, cache writes,
    reasoning: parts of the input and output totals) and cost per group, for days start..end.

    group_by names from GROUPINGS, combined (("day", "model") is a row per day and model);
    project / key (public ids) narrow the rows to one project or API key.
    """
    unknown = [name for name in group_by if name not in GROUPINGS]
    if unknown:
        raise ValueError(f"Unknown grouping {unknown[0]!r}; known: {', '.join(GROUPINGS)}")
    fields = [field for name in group_by for field in GROUPINGS[name]]
    rows = (
        records(tenant, start, end, project=project, key=key)
        .annotate(day=TruncDate("ended_at", tzinfo=UTC))
        .values(*fields)
        .annotate(**_SUMS)
        .order_by(*fields)
    )
    out = []
    for row in rows:
        item: dict[str, Any] = {}
        if "day" in row:
            item["day"] = row["day"].isoformat()
        if "project__public_id" in row:
            item["project"] = row["project__public_id"]
            item["project_slug"] = row["project__slug"]
        if "api_key__public_id" in row:
            item["key"] = row["api_key__public_id"]
            item["key_name"] = row["api_key__name"]
        if "served_model" in row:
            item["model"] = row["served_model"]
        item.update(
            requests=row["requests"],
            input_tokens=row["input_tokens"] or 0,
            output_tokens=row["output_tokens"] or 0,
            total_tokens=(row["input_tokens"] or 0) + (row["output_tokens"] or 0),
            **{name: row[name] or 0 for name in TOKEN_CLASSES},
            cost_micros=row["cost_micros"] or 0,
        )
        out.append(item)
    return out


def total_tokens(tenant: Tenant, start: date, end: date) -> int:
    """Input + output tokens of the tenant over days start..end."""
    sums = records(tenant, start, end).aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"))
    return (sums["i"] or 0) + (sums["o"] or 0)


def usage_today_and_month(tenant: Tenant, by: str) -> dict[str, dict[str, int]]:
    """Tokens per project or key public id (`by` = "project" / "key") today and this month
    (UTC), from the usage ledger: {"prj_...": {"today": n, "month": n}}. Ids without usage are
    absent. The ledger trails the live counters by a few seconds."""
    today = timezone.now().date()
    out: dict[str, dict[str, int]] = {}
    for window, start in (("today", today), ("month", today.replace(day=1))):
        for row in usage_totals(tenant, start, today, (by,)):
            ref = row.get(by)
            if ref:
                out.setdefault(ref, {"today": 0, "month": 0})[window] = row["total_tokens"]
    return out
