"""A tenant's usage from the ledger, grouped for the console and the management API.

Days are the tenant's local days, in the time zone of its days now (quotas.cycles.time_zone_of);
"this month" figures are of its current cycle window (a calendar month, a day on the free plan, a
month from its billing day...), as its quota counters count them. The ledger is a few seconds
behind the Redis counters (it is drained every 5 s); live "remaining" figures come from the quota
counters instead (quotas/status.py).

The figures are sums of the ledger's daily rollup (billing.UsageRollup, billing/rollups.py) for
the local days it holds whole, and of raw ledger rows only for the rest (a window cut mid-day at
a change of cycle, days before the tenant's days moved to their current zone): a read costs a
row per (day, project, key, model...) group, not a row per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Any, Literal
from zoneinfo import ZoneInfo

from django.db.models import Q, QuerySet

from billing.models import UsageRecord
from billing.rollups import UTC_ZONE, sums, whole_days
from gateway.usage import TOKEN_CLASSES
from quotas.cycles import current_windows, time_zone_of
from tenants.models import ApiKey, Project, Tenant

GroupBy = Literal["day", "project", "key", "model"]
GROUPINGS: dict[str, tuple[str, ...]] = {
    "day": ("day",),
    "project": ("project__public_id", "project__slug"),
    "key": ("api_key__public_id", "api_key__name"),
    "model": ("served_model",),
}


def day_start(day: date, zone: tzinfo = UTC) -> datetime:
    """The instant the local day starts (a day over a daylight-saving change is 23 or 25 h)."""
    return datetime.combine(day, time.min, tzinfo=zone)


def tenant_zone(tenant: Tenant) -> ZoneInfo:
    """The zone of the tenant's days now (quotas.cycles)."""
    return ZoneInfo(time_zone_of(tenant))


def records(tenant: Tenant, start: date, end: date, *, project: str | None = None,
            key: str | None = None, zone: tzinfo | None = None) -> QuerySet[UsageRecord]:
    """The tenant's ledger rows that ended on days start..end (inclusive, the tenant's local
    days: `zone`, default its time zone), optionally of one project or API key (public ids;
    looked up through the tenant, so another tenant's id simply matches nothing)."""
    zone = zone or tenant_zone(tenant)
    return _between(tenant, day_start(start, zone), day_start(end + timedelta(days=1), zone),
                    project=project, key=key)


def _between(tenant: Tenant, start: datetime, end: datetime, *, project: str | None = None,
             key: str | None = None) -> QuerySet[UsageRecord]:
    rows = UsageRecord.objects.filter(tenant=tenant, ended_at__gte=start, ended_at__lt=end)
    if project is not None:
        rows = rows.filter(project__public_id=project)
    if key is not None:
        rows = rows.filter(api_key__public_id=key)
    return rows


def _filters(tenant: Tenant, project: str | None = None, key: str | None = None) -> Q:
    """Rows of the tenant (both models), of one project or API key by public id (looked up
    through the tenant, so another tenant's id simply matches nothing)."""
    found = Q(tenant=tenant)
    if project is not None:
        found &= Q(project__public_id=project)
    if key is not None:
        found &= Q(api_key__public_id=key)
    return found


def _zone_name(zone: tzinfo | None) -> str:
    return getattr(zone, "key", None) or UTC_ZONE


def usage_totals(
    tenant: Tenant, start: date, end: date, group_by: tuple[str, ...] = ("day",), *,
    project: str | None = None, key: str | None = None,
) -> list[dict[str, Any]]:
    """Requests, input / output / total tokens, the token classes (cached input, cache writes,
    reasoning: parts of the input and output totals) and cost per group, for days start..end.

    group_by names from GROUPINGS, combined (("day", "model") is a row per day and model);
    project / key (public ids) narrow the rows to one project or API key.
    """
    zone = tenant_zone(tenant)
    return _totals(tenant, day_start(start, zone), day_start(end + timedelta(days=1), zone),
                   group_by, zone, _filters(tenant, project, key))


def window_totals(tenant: Tenant, start: datetime, end: datetime,
                  group_by: tuple[str, ...] = ("project",)) -> list[dict[str, Any]]:
    """usage_totals over the calls that ended in [start, end) (a cycle window)."""
    return _totals(tenant, start, end, group_by, start.tzinfo or UTC, _filters(tenant))


def _totals(tenant: Tenant, start: datetime, end: datetime, group_by: tuple[str, ...],
            zone: tzinfo, filters: Q) -> list[dict[str, Any]]:
    unknown = [name for name in group_by if name not in GROUPINGS]
    if unknown:
        raise ValueError(f"Unknown grouping {unknown[0]!r}; known: {', '.join(GROUPINGS)}")
    fields = [field for name in group_by for field in GROUPINGS[name]]
    plan = whole_days(tenant, _zone_name(zone), start, end)
    out = []
    for row in sums(plan, fields or ["tenant"], filters):
        item: dict[str, Any] = {}
        if "day" in fields:
            item["day"] = row["day"].isoformat()
        if "project__public_id" in fields:
            item["project"] = row["project__public_id"]
            item["project_slug"] = row["project__slug"]
        if "api_key__public_id" in fields:
            item["key"] = row["api_key__public_id"]
            item["key_name"] = row["api_key__name"]
        if "served_model" in fields:
            item["model"] = row["served_model"]
        item.update(
            requests=row["requests"],
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            total_tokens=row["input_tokens"] + row["output_tokens"],
            **{name: row[name] for name in TOKEN_CLASSES},
            cost_micros=row["cost_micros"],
        )
        out.append(item)
    return out


def total_tokens(tenant: Tenant, start: datetime, end: datetime) -> int:
    """Input + output tokens of the tenant's calls that ended in [start, end)."""
    return sum(row["total_tokens"]
               for row in _totals(tenant, start, end, (), start.tzinfo or UTC,
                                  _filters(tenant)))


def usage_today_and_month(
    tenant: Tenant, by: str, *, only: Sequence[Project | ApiKey] | None = None
) -> dict[str, dict[str, int]]:
    """Tokens per project or key public id (`by` = "project" / "key") today and in the current
    cycle window ("month": the tenant's cycle, quotas.cycles), in the tenant's windows on the
    Redis clock, from the usage ledger: {"prj_...": {"today": n, "month": n}}. Ids without usage
    are absent. The ledger trails the live counters by a few seconds. `only`: just these
    projects or keys (a listing's page: a tenant with thousands of keys must not have every
    key's totals summed to show fifty)."""
    day, cycle = current_windows(tenant)
    out: dict[str, dict[str, int]] = {}
    column = "project_id" if by == "project" else "api_key_id"
    for window, span in (("today", day), ("month", cycle)):
        found = _filters(tenant)
        if only is not None:
            found &= Q(**{f"{column}__in": [row.pk for row in only]})
        for row in _totals(tenant, span.start, span.end, (by,), span.start.tzinfo or UTC,
                           found):
            ref = row.get(by)
            if ref:
                out.setdefault(ref, {"today": 0, "month": 0})[window] = row["total_tokens"]
    return out
