"""Usage forecasts: where each limited scope's window will end, from its recent burn rate.

The model (pure functions below; `scope_forecasts` is the thin reader that feeds them):

    forecast at window end = used so far + what the rest of the window will add

"Used so far" is the scope's live counter (used + held by calls in flight), as the gauges show it.
What the rest adds is estimated one of two ways, and the Forecast says which, with its inputs:

- **trailing_rate** (always available): the scope's tokens of the last
  TOLLGATE_FORECAST_TRAILING_HOURS hours (default 3) from the usage ledger, per hour, times the
  hours left in the window. A straight line.
- **daily_shape** (when the scope has TOLLGATE_FORECAST_SHAPE_MIN_DAYS days of history, default
  7, within the last TOLLGATE_FORECAST_HISTORY_DAYS days, default 28): usage is not flat over a
  day (office hours, nightly batches), so the hours left are weighted by their usual share of a
  day. The usual day is the scope's history: its tokens per day on average, and the share of
  them that each hour of the day (in the tenant's time zone) usually carries. Today is compared
  with that usual day over the hours compared (today so far; at least the trailing hours for a
  day window, at least the last 24 hours for a cycle window, whose forecast scales days): if
  those hours usually carry 2,000 tokens and carried 3,000, today runs at 1.5 times the usual,
  and the rest of the window is forecast at 1.5 times its usual tokens. When the hours compared
  usually carry almost nothing (under 1 % of a usual day), the ratio would be noise and the
  trailing rate is used instead.

The forecast also says when the limit (the counter's limit plus any recharged credit) would be
reached at that pace, if before the window ends, and its percentage of the limit.

Windows come only from quotas.cycles.calendar_for(tenant) (the tenant's day and cycle); history
is read per UTC hour from the ledger's hourly table (billing.UsageHourly, kept by the drain in
the transaction of its rows: the same sums as the raw rows', read as a row per scope and hour
rather than a row per request; an hour's tokens counted as spread evenly over it), and an hour
of the day is the local hour of the middle of that UTC hour.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo

from django.conf import settings as django_settings
from django.core.cache import cache
from django.db.models import Q, Sum

from billing.models import UsageHourly
from quotas.cycles import calendar_for
from quotas.keys import tenant_tag
from quotas.limits import KEY, PROJECT, TENANT, Counter, standing_counters
from quotas.runtime import get_engine
from quotas.windows import Calendar, Window, WindowKind
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits

log = logging.getLogger(__name__)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
TRAILING_RATE = "trailing_rate"
DAILY_SHAPE = "daily_shape"
# Below this share of a usual day, the hours compared say nothing about today's pace.
MIN_COMPARED_SHARE = 0.01
# The longest projection drawn: points enough for a smooth curve over a 31-day cycle.
_MAX_PATH_POINTS = 200


@dataclass(frozen=True)
class ForecastSettings:
    trailing_hours: int = 3
    history_days: int = 28
    shape_min_days: int = 7

    def __post_init__(self) -> None:
        if self.trailing_hours < 1 or self.history_days < 1 or self.shape_min_days < 1:
            raise ValueError("forecast hours and days must be at least 1")
        if self.shape_min_days > self.history_days:
            raise ValueError("TOLLGATE_FORECAST_SHAPE_MIN_DAYS must not exceed "
                             "TOLLGATE_FORECAST_HISTORY_DAYS")

    @classmethod
    def from_django(cls) -> ForecastSettings:
        return cls(trailing_hours=django_settings.TOLLGATE_FORECAST_TRAILING_HOURS,
                   history_days=django_settings.TOLLGATE_FORECAST_HISTORY_DAYS,
                   shape_min_days=django_settings.TOLLGATE_FORECAST_SHAPE_MIN_DAYS)


# -- history: tokens per UTC hour ---------------------------------------------------------------


def hour_floor(ms: int) -> int:
    return ms - ms % HOUR_MS


def _slices(start_ms: int, end_ms: int) -> Iterator[tuple[int, int, int]]:
    """(UTC hour start, slice start, slice end) covering [start_ms, end_ms) hour by hour."""
    moment = start_ms
    while moment < end_ms:
        bucket = hour_floor(moment)
        after = min(bucket + HOUR_MS, end_ms)
        yield bucket, moment, after
        moment = after


@dataclass(frozen=True)
class History:
    """A scope's tokens per UTC hour (hour start in ms -> tokens) from `since_ms` (an hour
    start) up to `until_ms` (now). The hour containing `until_ms` holds what it has had so far,
    so it is spread over [its start, until_ms)."""

    hours: Mapping[int, int]
    since_ms: int
    until_ms: int

    @property
    def first_ms(self) -> int | None:
        """The first hour with usage, None without any."""
        used = [hour for hour, tokens in self.hours.items() if tokens > 0]
        return min(used) if used else None

    def tokens(self, start_ms: int, end_ms: int) -> float:
        """Tokens in [start_ms, end_ms), a partly covered hour counted pro rata."""
        total = 0.0
        for bucket, begin, end in _slices(max(start_ms, self.since_ms),
                                          min(end_ms, self.until_ms)):
            tokens = self.hours.get(bucket, 0)
            if tokens:
                span = min(bucket + HOUR_MS, self.until_ms) - bucket
                total += tokens * (end - begin) / span
        return total


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


@lru_cache(maxsize=65_536)
def local_hour(bucket_ms: int, zone: str) -> int:
    """The hour of the day (0-23, local) of the middle of a UTC hour."""
    return datetime.fromtimestamp((bucket_ms + HOUR_MS // 2) / 1000, _zone(zone)).hour


@dataclass(frozen=True)
class DayShape:
    """The scope's usual day: tokens per day on average over `days` days, and each local hour's
    share of them (24 shares summing to 1)."""

    usual_day: float
    shares: tuple[float, ...]
    days: int
    zone: str

    def expected(self, start_ms: int, end_ms: int) -> float:
        """The tokens a usual day puts in [start_ms, end_ms)."""
        total = 0.0
        for bucket, begin, end in _slices(start_ms, end_ms):
            total += self.shares[local_hour(bucket, self.zone)] * (end - begin) / HOUR_MS
        return self.usual_day * total


def day_shape(history: History, today: Window, zone: str, settings: ForecastSettings,
              ) -> DayShape | None:
    """The usual day from the history before `today` (the tenant's day window): None when the
    scope's first usage in the history is fewer than `shape_min_days` local days before today."""
    first = history.first_ms
    if first is None or first >= today.start_ms:
        return None
    tz = _zone(zone)
    today_date = datetime.fromtimestamp(today.start_ms / 1000, tz).date()
    first_date = datetime.fromtimestamp(first / 1000, tz).date()
    days = min((today_date - first_date).days, settings.history_days)
    if days < settings.shape_min_days:
        return None
    per_hour = [0.0] * 24
    for bucket, tokens in history.hours.items():
        if bucket < today.start_ms and bucket >= first:
            per_hour[local_hour(bucket, zone)] += tokens
    total = sum(per_hour)
    if total <= 0:
        return None
    return DayShape(total / days, tuple(h / total for h in per_hour), days, zone)


# -- the forecast -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forecast:
    """Where a window will end at the current pace, and how that was worked out."""

    window: Window
    now_ms: int
    used: int
    pending: int
    limit: int
    credit: int
    tokens: int  # forecast used + held at the window's end
    reach_ms: int | None  # when the limit would be reached (now if it already is); None: never
    method: str  # TRAILING_RATE or DAILY_SHAPE
    inputs: dict[str, Any] = field(default_factory=dict)
    # The projection from now to the window's end: (instant ms, cumulative tokens) points.
    path: tuple[tuple[int, int], ...] = ()
    zone: str = "UTC"  # the tenant's time zone, to show instants in

    @property
    def so_far(self) -> int:
        return self.used + self.pending

    @property
    def capacity(self) -> int:
        return self.limit + self.credit

    @property
    def percent(self) -> float:
        """The forecast as a percentage of the limit (plus credit), one decimal."""
        if self.capacity <= 0:
            return 100.0
        return round(100.0 * self.tokens / self.capacity, 1)

    def local(self, ms: int, fmt: str = "%b %d, %H:%M %Z") -> str:
        """An instant in the tenant's time zone, for people."""
        return datetime.fromtimestamp(ms / 1000, _zone(self.zone)).strftime(fmt)

    def summary(self) -> str:
        """Tokens and percent at the window's end, and when the limit would be reached."""
        text = (f"Forecast {self.tokens:,} tokens ({self.percent:g}% of the limit) by "
                f"{self.local(self.window.end_ms)}")
        if self.reach_ms is not None and self.reach_ms <= self.now_ms:
            return f"{text}; the limit is reached."
        if self.reach_ms is not None:
            return f"{text}; the limit would be reached around {self.local(self.reach_ms)}."
        return f"{text}."

    def explanation(self) -> str:
        """The method and its figures in one sentence (console, email)."""
        hours = self.inputs.get("remaining_hours", 0)
        if self.method == DAILY_SHAPE:
            return (f"Usual day ({self.inputs['history_days']} days of history): "
                    f"{self.inputs['usual_day_tokens']:,} tokens; the hours compared carried "
                    f"{self.inputs['compared_tokens']:,} tokens against a usual "
                    f"{self.inputs['usual_compared_tokens']:,} (x{self.inputs['ratio']}), so the "
                    f"{hours:g} hours left are forecast at x{self.inputs['ratio']} their usual "
                    f"{self.inputs['usual_remaining_tokens']:,} tokens.")
        return (f"{self.inputs['trailing_tokens']:,} tokens in the last "
                f"{self.inputs['trailing_hours']} hours = {self.inputs['rate_per_hour']:,} "
                f"tokens per hour, for the {hours:g} hours left.")

    def as_dict(self) -> dict[str, Any]:
        """The forecast as the API and the quota.forecast webhook carry it."""
        return {
            "window": self.window.id,
            "window_start": iso(self.window.start_ms),
            "window_end": iso(self.window.end_ms),
            "used": self.used,
            "pending": self.pending,
            "limit": self.limit,
            "credit": self.credit,
            "forecast": self.tokens,
            "percent": self.percent,
            "would_reach_limit_at": None if self.reach_ms is None else iso(self.reach_ms),
            "method": self.method,
            "inputs": dict(self.inputs),
        }


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _round(value: float) -> int:
    return int(value + 0.5) if value >= 0 else -int(-value + 0.5)


def _thin(points: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    if len(points) <= _MAX_PATH_POINTS:
        return tuple(points)
    step = (len(points) - 1) / (_MAX_PATH_POINTS - 1)
    return tuple(points[round(i * step)] for i in range(_MAX_PATH_POINTS))


def forecast(*, window: Window, today: Window, now_ms: int, used: int, pending: int, limit: int,
             credit: int, history: History, zone: str, settings: ForecastSettings) -> Forecast:
    """The forecast of one counter in `window` (the tenant's day or cycle window containing
    `now_ms`; `today` is its day window, both from quotas.cycles.calendar_for). `zone` is the
    tenant's time zone (hours of the day). Pure: every figure comes in as an argument."""
    so_far = used + pending
    capacity = limit + credit
    end = max(window.end_ms, now_ms)
    remaining_hours = round((end - now_ms) / HOUR_MS, 2)
    shape = day_shape(history, today, zone, settings)
    reason = "" if shape is not None else (
        f"fewer than {settings.shape_min_days} days of history")
    if shape is not None:
        # A cycle forecast scales days of usual usage by the ratio: it rests on a whole day's
        # comparison at least, a day forecast on the trailing hours at least.
        span = DAY_MS if window.end_ms - window.start_ms > DAY_MS else \
            settings.trailing_hours * HOUR_MS
        compared_from = min(today.start_ms, now_ms - span)
        actual = history.tokens(compared_from, now_ms)
        usual = shape.expected(compared_from, now_ms)
        if usual >= MIN_COMPARED_SHARE * shape.usual_day:
            ratio = actual / usual
            return _shaped(window, now_ms, used, pending, limit, credit, so_far, capacity, end,
                           shape, ratio, {
                               "history_days": shape.days,
                               "usual_day_tokens": _round(shape.usual_day),
                               "compared_from": iso(compared_from),
                               "compared_tokens": _round(actual),
                               "usual_compared_tokens": _round(usual),
                               "ratio": round(ratio, 3),
                               "usual_remaining_tokens": _round(shape.expected(now_ms, end)),
                               "remaining_hours": remaining_hours,
                           })
        reason = "the hours compared usually carry almost no usage"
    trailing = history.tokens(now_ms - settings.trailing_hours * HOUR_MS, now_ms)
    rate = trailing / settings.trailing_hours  # per hour
    total = so_far + rate * (end - now_ms) / HOUR_MS
    if so_far >= capacity:
        reach: int | None = now_ms
    elif rate > 0:
        at = now_ms + (capacity - so_far) / rate * HOUR_MS
        reach = math.ceil(at) if at < end else None
    else:
        reach = None
    return Forecast(window, now_ms, used, pending, limit, credit, _round(total), reach,
                    TRAILING_RATE, {
                        "trailing_hours": settings.trailing_hours,
                        "trailing_tokens": _round(trailing),
                        "rate_per_hour": _round(rate),
                        "remaining_hours": remaining_hours,
                        "why": reason,
                    }, ((now_ms, so_far), (end, _round(total))), zone)


def _shaped(window: Window, now_ms: int, used: int, pending: int, limit: int, credit: int,
            so_far: int, capacity: int, end: int, shape: DayShape, ratio: float,
            inputs: dict[str, Any]) -> Forecast:
    """Walk the rest of the window hour by hour at `ratio` times the usual day."""
    cumulative = float(so_far)
    reach: int | None = now_ms if so_far >= capacity else None
    points = [(now_ms, so_far)]
    for bucket, begin, after in _slices(now_ms, end):
        added = ratio * shape.expected(begin, after)
        if reach is None and added > 0 and cumulative + added >= capacity:
            reach = begin + int((capacity - cumulative) / added * (after - begin))
        cumulative += added
        if after == bucket + HOUR_MS or after == end:
            points.append((after, _round(cumulative)))
    return Forecast(window, now_ms, used, pending, limit, credit, _round(cumulative), reach,
                    DAILY_SHAPE, inputs, _thin(points), shape.zone)


# -- the reader: counters from Redis, history from the ledger -----------------------------------


@dataclass(frozen=True)
class ScopeForecast:
    """One limited counter's forecast, named as the dashboards name it."""

    kind: str  # tenant / project / key
    ref: str  # public id
    label: str  # what a person reads (tenant name, project slug, key name)
    scope: str  # the counter's scope in Redis (tenant, project:<pk>, key:<pk>)
    window_kind: WindowKind  # DAY or MONTH (the tenant's cycle)
    forecast: Forecast
    history: History

    @property
    def who(self) -> str:
        """The payload's scope, as threshold alerts name it: tenant, project:<slug>, key:<name>."""
        return "tenant" if self.kind == TENANT else f"{self.kind}:{self.label}"

    def as_dict(self) -> dict[str, Any]:
        return {"scope": self.who, "scope_kind": self.kind, "scope_id": self.ref,
                "window_kind": "day" if self.window_kind is WindowKind.DAY else "cycle",
                **self.forecast.as_dict()}


# The past days' hourly history changes only by late ledger corrections: kept this long in the
# shared cache, so the beat and the dashboards read a scope's 28 days at most once an hour.
_HISTORY_CACHE_S = 3600


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


# UsageHourly columns a scope's history is summed by (the tenant's: no column, every row).
_COLUMN = {PROJECT: "project_id", KEY: "api_key_id"}


def _ledger_hours(tenant: Tenant, kinds: Collection[str], start_ms: int, end_ms: int,
                  ) -> dict[tuple[str, int | None], dict[int, int]]:
    """Tokens per UTC hour of the hours starting in [start_ms, end_ms) (`start_ms` an hour
    start; the hour containing `end_ms` holds what was drained of it so far) of the tenant and,
    for `kinds` (project, key), of each of its projects or keys, in ONE grouped query of the
    hourly table: {(kind, pk): {hour ms: tokens}}, the tenant's under (TENANT, None) as the sum
    of every row. A query per scope was an N+1 on the dashboard and GET /quota (one per limited
    project and key); summing the raw rows of the hours was 85 ms of the dashboard's 100 at 20
    million ledger rows (docs/benchmarks.md). A project or key deleted since keeps its id here
    (its raw rows' is NULL): it is no scope forecast, and the tenant's sum counts its rows
    either way."""
    columns = [_COLUMN[kind] for kind in (PROJECT, KEY) if kind in kinds]
    rows = (UsageHourly.objects
            .filter(tenant=tenant, hour__gte=_moment(start_ms), hour__lt=_moment(end_ms))
            .values("hour", *columns).annotate(sum_tokens=Sum("tokens")).order_by())
    out: dict[tuple[str, int | None], dict[int, int]] = {}
    for row in rows:
        tokens = int(row["sum_tokens"] or 0)
        if not tokens:
            continue
        hour = int(row["hour"].timestamp() * 1000)
        for kind in (TENANT, *(k for k in (PROJECT, KEY) if k in kinds)):
            pk = None if kind == TENANT else row[_COLUMN[kind]]
            if kind != TENANT and pk is None:
                continue
            hours = out.setdefault((kind, pk), {})
            hours[hour] = hours.get(hour, 0) + tokens
    return out


def _scope_pk(counter: Counter, projects: Mapping[str, Project],
              api_keys: Mapping[str, ApiKey]) -> tuple[str, int | None]:
    """The (kind, pk) a counter's history is grouped under in _ledger_hours."""
    if counter.kind == PROJECT:
        return PROJECT, projects[counter.ref].pk
    if counter.kind == KEY:
        return KEY, api_keys[counter.ref].pk
    return TENANT, None


def load_histories(tenant: Tenant, counters: Sequence[Counter], projects: Mapping[str, Project],
                   api_keys: Mapping[str, ApiKey], today: Window, now_ms: int,
                   settings: ForecastSettings) -> dict[str, History]:
    """Per counter scope: its tokens per UTC hour from `history_days` before today up to now.

    The past days come from the shared cache (one entry per scope, computed at most once an
    hour), today's hours live. One query of the ledger's hourly table per tenant whatever the
    number of scopes: today
    only when every scope's past is cached, or since the history's start, split at today, when
    one is not (then the missing scopes are cached). No counter: no query."""
    if not counters:
        return {}
    cut = hour_floor(today.start_ms)
    since = hour_floor(cut - settings.history_days * DAY_MS)
    scopes = {c.scope: _scope_pk(c, projects, api_keys) for c in counters}
    keys = {scope: f"forecast-history:{tenant.pk}:{scope}:{since}:{cut}" for scope in scopes}
    past: dict[str, dict[int, int]] = {}
    try:
        cached = cache.get_many(list(keys.values()))
        past = {scope: cached[key] for scope, key in keys.items() if key in cached}
    except Exception:  # noqa: BLE001 - the cache is an optimisation: read the ledger instead
        log.warning("forecast history cache unreadable", exc_info=True)
    missing = [scope for scope in scopes if scope not in past]
    kinds = {kind for kind, _ in scopes.values()}
    ledger = _ledger_hours(tenant, kinds, since if missing else cut, now_ms + 1)
    if missing:
        for scope in missing:
            hours = ledger.get(scopes[scope], {})
            past[scope] = {hour: tokens for hour, tokens in hours.items() if hour < cut}
        try:
            cache.set_many({keys[scope]: past[scope] for scope in missing}, _HISTORY_CACHE_S)
        except Exception:  # noqa: BLE001 - as above
            log.warning("forecast history cache unwritable", exc_info=True)
    out = {}
    for scope, group in scopes.items():
        recent = {hour: tokens for hour, tokens in ledger.get(group, {}).items() if hour >= cut}
        out[scope] = History({**past[scope], **recent}, since, now_ms)
    return out


def _limited(tenant: Tenant, kinds: Collection[str]) -> tuple[list[Project], list[ApiKey]]:
    """The tenant's projects and live keys with a day or month limit of their own (of `kinds`
    only: no query for a kind not asked for)."""
    own = Q(tokens_per_day__isnull=False) | Q(tokens_per_month__isnull=False)
    projects = list(Project.objects.filter(own, tenant=tenant)) if PROJECT in kinds else []
    api_keys = (list(ApiKey.objects.filter(own, project__tenant=tenant, revoked_at__isnull=True))
                if KEY in kinds else [])
    return projects, api_keys


def forecast_counters(tenant: Tenant, projects: Sequence[Project],
                      api_keys: Sequence[ApiKey]) -> list[Counter]:
    """The counters forecasts are made for: the limited tenant day and cycle counters, and the
    limited day and month counters of these projects and keys, as
    quotas.limits.standing_counters defines them (not the models' daily limits)."""
    counters = standing_counters(tenant, effective_limits(tenant), projects, api_keys)
    return [c for c in counters if c.kind in (TENANT, PROJECT, KEY) and c.limit > 0
            and c.window in (WindowKind.DAY, WindowKind.MONTH)]


ALL_KINDS: tuple[str, ...] = (TENANT, PROJECT, KEY)


def scope_forecasts(tenant: Tenant, *, engine: Any = None, active_only: bool = False,
                    settings: ForecastSettings | None = None,
                    calendar: Calendar | None = None,
                    kinds: Collection[str] = ALL_KINDS,
                    exclude: Callable[[set[str]], Collection[tuple[str, str]]] | None = None,
                    keys: Collection[ApiKey] | None = None,
                    ) -> list[ScopeForecast]:
    """The forecasts of the tenant's limited counters in their current windows (the tenant's
    calendar, quotas.cycles.calendar_for). Used so far: the live counters, read in one round
    trip; history: one ledger query for all of them (load_histories).

    `kinds`: only these scopes (the dashboard draws the tenant's and the projects', not the
    keys'). `active_only`: skip counters that do not exist in their window yet (nothing reserved
    in it: an idle scope; the beat job's way of not reading the ledger for idle tenants).
    `exclude(window ids)`: the (scope, window id) pairs to leave out before their history is
    read, asked once with the current windows' ids, and only when a counter is left (the beat:
    the scopes already warned in these windows). No counter left: no ledger read at all.
    `keys`: of the keys, only these (the page of keys a listing shows) rather than every
    limited key of the tenant. Raises quotas.engine.QuotaStoreUnavailable when Redis is down."""
    settings = settings or ForecastSettings.from_django()
    engine = engine or get_engine()
    projects, api_keys = _limited(tenant, kinds if keys is None else
                                  [kind for kind in kinds if kind != KEY])
    if keys is not None and KEY in kinds:
        api_keys = [k for k in keys if k.revoked_at is None
                    and (k.tokens_per_day is not None or k.tokens_per_month is not None)]
    counters = [c for c in forecast_counters(tenant, projects, api_keys) if c.kind in kinds]
    if not counters:
        return []
    calendar = calendar or calendar_for(tenant)
    snaps = engine.counters(tenant_tag(tenant.pk), [(c.scope, c.window) for c in counters],
                            schedule=calendar.schedule)
    now_ms = engine.clock.now_ms()
    today = calendar.window(WindowKind.DAY, now_ms)
    zone = calendar.schedule.cycle_at(now_ms)[0].zone
    chosen = [(counter, snap, calendar.window(counter.window, now_ms))
              for counter, snap in zip(counters, snaps, strict=True)
              if not (active_only and snap.limit is None)]
    if exclude is not None and chosen:
        left_out = set(exclude({window.id for _, _, window in chosen}))
        chosen = [(counter, snap, window) for counter, snap, window in chosen
                  if (counter.scope, window.id) not in left_out]
    histories = load_histories(tenant, [counter for counter, _, _ in chosen],
                               {p.public_id: p for p in projects},
                               {k.public_id: k for k in api_keys}, today, now_ms, settings)
    out = []
    for counter, snap, window in chosen:
        history = histories[counter.scope]
        result = forecast(window=window, today=today, now_ms=now_ms, used=snap.used,
                          pending=snap.pending, limit=counter.limit, credit=snap.credit,
                          history=history, zone=zone, settings=settings)
        out.append(ScopeForecast(counter.kind, counter.ref, counter.label, counter.scope,
                                 counter.window, result, history))
    return out
