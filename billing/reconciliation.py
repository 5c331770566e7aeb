"""Reconciliation: the ledger against the upstream's bill, per provider key, model and UTC day.

Our side is the sum of UsageRecord rows by (provider key, served model, UTC day of ended_at)
over the period; only settled and partial rows count (released and swept ones carry no tokens),
and rows whose provider key is gone (NULL) cannot be attributed and are left out. Their side is
a bill (billing/bills.py). A bill names keys by the upstream's key id; `UpstreamKeyAlias` maps
those ids to provider keys:

* mock upstream and CSV sources (`derives_key_ids`): the alias of every provider key in scope is
  computed on each run as gateway.mock_upstream.api_key_id(secret) and stored (`derived`);
* OpenAI: the usage API reports OpenAI's own key ids; an operator enters them in the admin
  (billing > upstream key aliases). A key without an alias shows as "missing on their side".

Models are compared under their catalog name: a dated snapshot that the client called or the bill
names ("gpt-4o-2024-08-06") counts as its model when a ModelAlias maps it ("gpt-4o"), so a
snapshot billed under one name and recorded under the other still matches.

Each compared (provider key, model, day) becomes a ReconciliationRow with ours, theirs,
`difference` = their tokens - our tokens (input + output) and `difference_rate` =
|difference| / max(ours, theirs) (0 when both are 0). A row is flagged when the rate is strictly
greater than the tolerance (default 0.05), or when one side has tokens the other lacks. Models
missing from the gateway's ModelSpec catalog are marked "unknown model" in the note (flagged only
through the rules above). Costs are stored for reading, not compared: OpenAI's usage API gives
none, and our prices may differ from the provider's.

Token classes (cached input, cache writes, reasoning: parts of the input and output totals,
gateway/usage.py) are compared too, each class the bill reports (billing/bills.py: a class it
does not report is empty on the row and not compared): a class whose rate |theirs - ours| /
max(ours, theirs) exceeds the tolerance flags the row like a token mismatch, and the note names
it. `theirs_priced_micros` is the bill's usage at our prices (Price.cost_of of each line's usage
by class, at the price of the start of its UTC day, a model without a price of its own at the
default prices of the provider keys of the line's key's kind; a line of an upstream key that is
none of ours, whose kind is unknown, only at the model's own price; empty when a line has no
price), to read against `ours_cost_micros` when the bill gives no cost of its own.

A swept row (a hold the sweep charged after its worker died, not corrected by a late settle) has
its estimate's totals but no class split: the call's real classes never reached the gateway. Its
totals count, its (zero) classes do not, and a group with such rows skips the class comparison,
with the note SWEPT_CLASSES: a class mismatch there would be the sweep's, not the provider's.

Runs are never overwritten: re-running the same period, source and provider key stores a new run
and points the previous current run at it (`superseded_by`), so the admin shows the history and
the current result is the run with no successor. A run whose bill could not be read is stored
with status "failed" and the error. Drift and failures are logged at ERROR and mailed to
settings.ADMINS (mail_admins).

The daily job (billing.tasks.reconcile_daily -> reconcile_configured) takes a Redis lock per day
(SET NX PX) so two workers never reconcile the same day at the same time.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.mail import mail_admins
from django.db import IntegrityError, transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing.bills import BillError, BillLine, BillSource, MockBill, OpenAIUsageAPI
from billing.models import ReconciliationRow, ReconciliationRun, UpstreamKeyAlias, UsageRecord
from gateway.crypto import SecretDecryptionError, decrypt_secret
from gateway.mock_upstream import api_key_id
from gateway.models import ModelSpec, ProviderKey
from gateway.prices import PriceBook, load_aliases
from quotas.keys import reconcile_lock_key
from tenants.services.audit import record_audit_event

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = Decimal("0.05")
RATE_PLACES = Decimal("0.000001")
# Every row of a call that reached the upstream with a provider key known: fail-open (unmetered)
# calls are on the bill too, and so are swept calls that had reached it (basis forwarded or
# streaming) whose checkpoint named their provider key (lua/progress.lua); a hold swept before
# any checkpoint has none and cannot be attributed.
COUNTED = (Q(status__in=(UsageRecord.Status.SETTLED, UsageRecord.Status.PARTIAL,
                         UsageRecord.Status.UNMETERED))
           | Q(status=UsageRecord.Status.SWEPT,
               sweep_basis__in=(UsageRecord.SweepBasis.FORWARDED,
                                UsageRecord.SweepBasis.STREAMING)))
MISSING_THEIRS = "missing on their side"
MISSING_OURS = "missing on ours"
UNKNOWN_MODEL = "unknown model"
UNKNOWN_KEY = "unknown upstream key"
NO_ALIAS = "no upstream key alias (add one in the admin)"
SWEPT_CLASSES = "token classes not compared: swept rows carry no class split"
ALERT_ROWS = 20

DayOrRange = date | tuple[date, date]


class DayLocked(Exception):
    """Another worker is reconciling this day."""

    def __init__(self, day: date) -> None:
        super().__init__(f"another reconciliation of {day.isoformat()} is running")
        self.day = day


# ---------------------------------------------------------------------------------------------
# Upstream key ids
# ---------------------------------------------------------------------------------------------


def derived_upstream_key_id(provider_key: ProviderKey) -> str:
    """How the mock upstream names this key on its bill: api_key_id(secret)."""
    return api_key_id(decrypt_secret(provider_key.secret_encrypted))


def _derive_alias(provider_key: ProviderKey) -> UpstreamKeyAlias | None:
    try:
        upstream_id = derived_upstream_key_id(provider_key)
    except SecretDecryptionError:
        log.error("reconciliation: the secret of provider key %s cannot be decrypted; no "
                  "upstream key id derived", provider_key.public_id)
        return None
    alias = UpstreamKeyAlias.objects.filter(upstream_key_id=upstream_id).first()
    if alias is None:
        try:
            with transaction.atomic():
                alias = UpstreamKeyAlias.objects.create(
                    provider_key=provider_key, upstream_key_id=upstream_id, derived=True)
        except IntegrityError:  # made by a concurrent run
            alias = UpstreamKeyAlias.objects.filter(upstream_key_id=upstream_id).first()
    if alias is not None and alias.provider_key_id != provider_key.pk:
        log.warning("reconciliation: provider keys %s and %s share one upstream key id (%s): the "
                    "bill cannot tell them apart; it is counted for the first",
                    alias.provider_key_id, provider_key.pk, upstream_id)
        return None
    return alias


def upstream_key_id_for(provider_key: ProviderKey, *, derive: bool = True) -> str | None:
    """The id the upstream's bill uses for this provider key: its alias (the newest, if it has
    several), else, with `derive`, the mock's naming api_key_id(secret), stored as an alias.
    None when there is no alias and none may be derived (an OpenAI key before an operator has
    entered its id) or the secret cannot be decrypted."""
    if derive:
        alias = _derive_alias(provider_key)
        if alias is not None:
            return alias.upstream_key_id
    alias = UpstreamKeyAlias.objects.filter(provider_key=provider_key).order_by("-created_at",
                                                                                 "-pk").first()
    return alias.upstream_key_id if alias else None


def _alias_map(derive: bool, keys: Sequence[ProviderKey]) -> dict[str, int]:
    """upstream key id -> provider key id, for every stored alias (deriving those of `keys`)."""
    if derive:
        for provider_key in keys:
            _derive_alias(provider_key)
    return dict(UpstreamKeyAlias.objects.values_list("upstream_key_id", "provider_key_id"))


# ---------------------------------------------------------------------------------------------
# Both sides
# ---------------------------------------------------------------------------------------------


# The token classes compared: the ledger's (and BillLine's) field, the row's suffix, the note's
# name.
CLASSES = (("cached_input_tokens", "cached_input", "cached input"),
           ("cache_write_tokens", "cache_write", "cache write"),
           ("reasoning_tokens", "reasoning", "reasoning"))


@dataclass
class _Side:
    requests: int = 0
    input: int = 0
    output: int = 0
    cost: int | None = None
    upstream_ids: set[str] = field(default_factory=set)
    # Per class (CLASSES' first names): the tokens, and which classes the side reports at all
    # (the ledger always does; a bill only those it has).
    classes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        (name for name, _, _ in CLASSES), 0))
    reported: set[str] = field(default_factory=set)
    # Theirs: the bill's usage at our prices; None once a line had no price.
    priced: int | None = 0
    # Ours: swept rows not corrected since (their classes are unknown, not 0).
    swept: int = 0

    @property
    def tokens(self) -> int:
        return self.input + self.output

    def add(self, requests: int, input_tokens: int, output_tokens: int,
            cost: int | None, classes: dict[str, int | None] | None = None) -> None:
        self.requests += requests
        self.input += input_tokens
        self.output += output_tokens
        if cost is not None:
            self.cost = (self.cost or 0) + cost
        for name, value in (classes or {}).items():
            if value is not None:
                self.classes[name] += value
                self.reported.add(name)

    def reports(self, name: str) -> int | None:
        return self.classes[name] if name in self.reported else None


# (provider key id or None, upstream key id when the key is none of ours, model, day)
_Group = tuple[int | None, str, str, date]


def _moment(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def _period(day_or_range: DayOrRange) -> tuple[date, date]:
    if isinstance(day_or_range, tuple):
        start, end = day_or_range
    else:
        start, end = day_or_range, day_or_range + timedelta(days=1)
    if isinstance(start, datetime) or isinstance(end, datetime):
        raise TypeError("reconcile takes dates (UTC days), not datetimes")
    if end <= start:
        raise ValueError(f"empty period: [{start}, {end})")
    return start, end


def _ours(start: date, end: date, provider_key: ProviderKey | None,
          models: dict[str, str]) -> dict[_Group, _Side]:
    records = UsageRecord.objects.filter(
        COUNTED, ended_at__gte=_moment(start), ended_at__lt=_moment(end),
        provider_key__isnull=False)
    if provider_key is not None:
        records = records.filter(provider_key=provider_key)
    swept = Q(status=UsageRecord.Status.SWEPT, corrected_at__isnull=True)
    sums = (records.annotate(day=TruncDate("ended_at", tzinfo=UTC))
            .values("provider_key_id", "served_model", "day")
            .annotate(requests=Count("id"), input=Sum("input_tokens"),
                      output=Sum("output_tokens"), cost=Sum("cost_micros"),
                      swept=Count("id", filter=swept),
                      **{name: Sum(name, filter=~swept) for name, _, _ in CLASSES})
            .order_by())
    sides: dict[_Group, _Side] = defaultdict(_Side)
    for row in sums:
        model = models.get(row["served_model"], row["served_model"])
        group = (row["provider_key_id"], "", model, row["day"])
        side = sides[group]
        side.add(row["requests"], row["input"] or 0, row["output"] or 0, row["cost"] or 0,
                 {name: row[name] or 0 for name, _, _ in CLASSES})
        side.swept += row["swept"]
    return sides


def _theirs(lines: Sequence[BillLine], aliases: dict[str, int],
            provider_key: ProviderKey | None, models: dict[str, str],
            prices: PriceBook) -> dict[_Group, _Side]:
    # A model without a price of its own is priced by the default prices of the keys of the
    # kind of the key that served it (gateway/prices.py), as the gateway priced the call.
    kinds = dict(ProviderKey.objects.values_list("pk", "kind"))
    sides: dict[_Group, _Side] = defaultdict(_Side)
    for line in lines:
        key_id = aliases.get(line.upstream_key_id)
        if provider_key is not None and key_id != provider_key.pk:
            continue  # another key's usage (a source may return the whole organization)
        group = (key_id, "" if key_id else line.upstream_key_id,
                 models.get(line.model, line.model), line.day)
        side = sides[group]
        side.add(line.requests, line.input_tokens, line.output_tokens, line.cost_micros,
                 {name: getattr(line, name) for name, _, _ in CLASSES})
        side.upstream_ids.add(line.upstream_key_id)
        kind = kinds.get(key_id) if key_id is not None else None
        price = (prices.price(line.model, _moment(line.day), kind) if kind is not None
                 else prices.own_price(line.model, _moment(line.day)))
        if price is None or side.priced is None:
            side.priced = None
        else:
            side.priced += price.cost_of(line.usage())
    return sides


def difference_rate(ours: int, theirs: int) -> Decimal:
    """|theirs - ours| / max(ours, theirs), exact; 0 when both are 0."""
    larger = max(ours, theirs)
    return Decimal(abs(theirs - ours)) / Decimal(larger) if larger else Decimal(0)


# ---------------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------------


def reconcile(day_or_range: DayOrRange, source: BillSource, *,
              tolerance: Decimal | str | None = DEFAULT_TOLERANCE,
              provider_key: ProviderKey | None = None) -> ReconciliationRun:
    """Compare the ledger with `source`'s bill over one UTC day or a [start, end) range of days,
    for one provider key or (None) for all of them; store and return the run with its rows.

    The run's status is "drift" if any row is flagged, "failed" (error stored, no rows) if the
    bill could not be read, else "ok". Drift and failure alert the operators."""
    start, end = _period(day_or_range)
    tolerance = DEFAULT_TOLERANCE if tolerance is None else Decimal(str(tolerance))
    if not tolerance.is_finite() or not 0 <= tolerance <= 1:
        raise ValueError(f"the tolerance must be a number in [0, 1], got {tolerance}")
    tolerance = tolerance.quantize(RATE_PLACES, rounding=ROUND_HALF_UP)  # as stored
    started_at = timezone.now()
    run = ReconciliationRun(period_start=start, period_end=end, source=source.kind,
                            source_detail=source.describe()[:500], provider_key=provider_key,
                            started_at=started_at, tolerance=tolerance)
    keys = [provider_key] if provider_key is not None else list(ProviderKey.objects.all())
    aliases = _alias_map(source.derives_key_ids, keys)
    wanted: Collection[str] | None = None
    if provider_key is not None:
        wanted = {uid for uid, pk in aliases.items() if pk == provider_key.pk}
    rows: list[ReconciliationRow] = []
    try:
        # An empty `wanted` (a key with no alias) asks for nothing: sources return no lines.
        lines = source.fetch(start, end, api_key_ids=wanted)
    except Exception as exc:  # noqa: BLE001 - any adapter failure is a failed run, stored
        log.exception("reconciliation of %s..%s from %s failed", start, end, source.describe())
        run.status = ReconciliationRun.Status.FAILED
        run.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BillError) else str(exc)
    else:
        models = load_aliases()  # dated snapshot -> catalog model, on both sides
        rows = _compare(run, _ours(start, end, provider_key, models),
                        _theirs(lines, aliases, provider_key, models, PriceBook.load()), aliases,
                        tolerance)
        run.status = (ReconciliationRun.Status.DRIFT if any(row.flagged for row in rows)
                      else ReconciliationRun.Status.OK)
        _total(run, rows)
    run.finished_at = timezone.now()
    with transaction.atomic():
        run.save()
        for row in rows:
            row.run = run
        ReconciliationRow.objects.bulk_create(rows)
        (ReconciliationRun.objects
         .filter(period_start=start, period_end=end, source=run.source,
                 provider_key=provider_key, superseded_by__isnull=True)
         .exclude(pk=run.pk).update(superseded_by=run))
    if run.status != ReconciliationRun.Status.OK:
        alert(run, [row for row in rows if row.flagged])
    return run


def _compare(run: ReconciliationRun, ours: dict[_Group, _Side], theirs: dict[_Group, _Side],
             aliases: dict[str, int], tolerance: Decimal) -> list[ReconciliationRow]:
    known_models = set(ModelSpec.objects.values_list("name", flat=True))
    key_ids = {group[0] for group in (*ours, *theirs) if group[0] is not None}
    keys = ProviderKey.objects.in_bulk(key_ids)
    names_by_key: dict[int, list[str]] = defaultdict(list)
    for upstream_id, pk in sorted(aliases.items()):
        names_by_key[pk].append(upstream_id)
    rows: list[ReconciliationRow] = []
    for group in sorted(set(ours) | set(theirs),
                        key=lambda g: (g[3], g[0] or 0, g[1], g[2])):
        key_id, upstream_id, model, day = group
        mine, bill = ours.get(group, _Side()), theirs.get(group, _Side())
        if mine.tokens == 0 and bill.tokens == 0 and not bill.cost:
            continue  # nothing used on either side (e.g. requests cut before any token)
        notes: list[str] = []
        rate = difference_rate(mine.tokens, bill.tokens)
        flagged = rate > tolerance
        if mine.tokens == 0 and (bill.tokens or bill.cost):
            flagged = True
            notes.append(MISSING_OURS)
            if key_id is None:
                notes.append(UNKNOWN_KEY)
        elif bill.tokens == 0:
            flagged = True
            notes.append(MISSING_THEIRS)
            if key_id is not None and not names_by_key.get(key_id):
                notes.append(NO_ALIAS)
        elif mine.swept and bill.reported:
            # A swept row's split is unknown, not 0: comparing would flag the sweep's estimate,
            # not a wrong split by the provider.
            notes.append(SWEPT_CLASSES)
        elif mismatched := _class_mismatches(mine, bill, tolerance):
            # Totals that agree can still hide a wrong split: a cached token billed as a plain
            # one (or reasoning as plain output) costs a different price.
            flagged = True
            notes.extend(mismatched)
        if model not in known_models:
            notes.append(UNKNOWN_MODEL)
        provider_key = keys.get(key_id) if key_id is not None else None
        names = sorted(bill.upstream_ids) or (names_by_key.get(key_id, []) if key_id else [])
        rows.append(ReconciliationRow(
            provider_key=provider_key, api_key_id=",".join(names or [upstream_id])[:500],
            model=model, day=day, tenant_id=provider_key.tenant_id if provider_key else None,
            ours_requests=mine.requests, ours_input=mine.input, ours_output=mine.output,
            ours_cost_micros=mine.cost or 0,
            theirs_requests=bill.requests, theirs_input=bill.input, theirs_output=bill.output,
            theirs_cost_micros=bill.cost,
            **{f"ours_{suffix}": mine.classes[name] for name, suffix, _ in CLASSES},
            **{f"theirs_{suffix}": bill.reports(name) for name, suffix, _ in CLASSES},
            theirs_priced_micros=bill.priced if bill.requests or bill.tokens else None,
            difference=bill.tokens - mine.tokens,
            difference_rate=rate.quantize(RATE_PLACES, rounding=ROUND_HALF_UP),
            flagged=flagged, note="; ".join(notes)[:300]))
    return rows


def _class_mismatches(ours: _Side, theirs: _Side, tolerance: Decimal) -> list[str]:
    """A note for each class the bill reports that differs from ours beyond the tolerance."""
    notes = []
    for name, _, label in CLASSES:
        reported = theirs.reports(name)
        if reported is None:
            continue
        mine = ours.classes[name]
        if difference_rate(mine, reported) > tolerance:
            notes.append(f"{label} differs: ours {mine}, theirs {reported}")
    return notes


def _total(run: ReconciliationRun, rows: Sequence[ReconciliationRow]) -> None:
    run.rows_count = len(rows)
    run.flagged_count = sum(row.flagged for row in rows)
    run.ours_input_tokens = sum(row.ours_input for row in rows)
    run.ours_output_tokens = sum(row.ours_output for row in rows)
    run.ours_cost_micros = sum(row.ours_cost_micros for row in rows)
    run.theirs_input_tokens = sum(row.theirs_input for row in rows)
    run.theirs_output_tokens = sum(row.theirs_output for row in rows)
    costs = [row.theirs_cost_micros for row in rows if row.theirs_cost_micros is not None]
    run.theirs_cost_micros = sum(costs) if costs else None
    run.max_difference_rate = max((row.difference_rate for row in rows), default=Decimal(0))


def alert(run: ReconciliationRun, flagged: Sequence[ReconciliationRow]) -> None:
    """Tell the operators about a drifting or failed run: an ERROR log line and mail_admins."""
    period = (run.period_start.isoformat() if run.day
              else f"{run.period_start.isoformat()}..{run.period_end.isoformat()} (exclusive)")
    scope = run.provider_key.public_id if run.provider_key else "every provider key"
    if run.status == ReconciliationRun.Status.FAILED:
        subject = f"Reconciliation failed: {period}, {scope}"
        body = f"Run {run.public_id} ({run.source}, {run.source_detail}) failed:\n{run.error}\n"
    else:
        subject = f"Reconciliation drift: {len(flagged)} row(s) flagged, {period}, {scope}"
        lines = [f"Run {run.public_id} ({run.source}, {run.source_detail}), tolerance "
                 f"{run.tolerance}: {len(flagged)} of {run.rows_count} rows flagged.", ""]
        for row in flagged[:ALERT_ROWS]:
            key = row.provider_key.public_id if row.provider_key else f"upstream {row.api_key_id}"
            lines.append(f"{row.day} {key} {row.model}: ours {row.ours_input}+{row.ours_output}, "
                         f"theirs {row.theirs_input}+{row.theirs_output}, difference "
                         f"{row.difference:+d} ({row.difference_rate:.2%}) {row.note}".rstrip())
        if len(flagged) > ALERT_ROWS:
            lines.append(f"... and {len(flagged) - ALERT_ROWS} more (see the admin).")
        body = "\n".join(lines) + "\n"
    log.error("%s (run %s)", subject, run.public_id)
    try:
        mail_admins(subject, body)
    except Exception:  # noqa: BLE001 - a mail failure must not lose the stored run
        log.exception("could not mail the reconciliation alert of run %s", run.public_id)


# ---------------------------------------------------------------------------------------------
# The configured daily job
# ---------------------------------------------------------------------------------------------


_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextmanager
def day_lock(day: date, *, client: Any = None, ttl_seconds: float | None = None) -> Iterator[None]:
    """Hold the Redis lock of `day` (SET NX PX) or raise DayLocked. The lock expires after
    TOLLGATE_RECONCILE_LOCK_SECONDS in case the holder dies; it is released only by its owner."""
    if client is None:
        from quotas.runtime import get_engine

        client = get_engine().client
    if ttl_seconds is None:
        ttl_seconds = float(getattr(settings, "TOLLGATE_RECONCILE_LOCK_SECONDS", 3600))
    token = uuid.uuid4().hex
    key = reconcile_lock_key(day)
    if not client.set(key, token, nx=True, px=max(1, int(ttl_seconds * 1000))):
        raise DayLocked(day)
    try:
        yield
    finally:
        client.eval(_RELEASE, 1, key, token)


class _Unavailable:
    """A bill that cannot be fetched (configuration error): the run is stored as failed."""

    derives_key_ids = False

    def __init__(self, kind: str, detail: str, error: str) -> None:
        self.kind, self._detail, self._error = kind, detail, error

    def describe(self) -> str:
        return self._detail

    def fetch(self, start: date, end: date, *,
              api_key_ids: Collection[str] | None = None) -> list[BillLine]:
        raise BillError(self._error)


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


def configured_sources(kind: str) -> list[tuple[ProviderKey, BillSource]]:
    """(provider key, its bill) for every enabled provider key the source `kind` covers.

    "mock": every enabled key, billed by the mock upstream at the key's own base URL.
    "openai": enabled keys whose base URL host is that of TOLLGATE_OPENAI_USAGE_BASE_URL
    (api.openai.com), billed by the organization usage API with the admin key read from the
    environment variable named by TOLLGATE_OPENAI_ADMIN_KEY_ENV.
    """
    keys = list(ProviderKey.objects.filter(enabled=True).order_by("id"))
    if kind == "mock":
        return [(key, MockBill(key.base_url)) for key in keys]
    if kind == "openai":
        base_url = getattr(settings, "TOLLGATE_OPENAI_USAGE_BASE_URL", "https://api.openai.com/v1")
        env_name = getattr(settings, "TOLLGATE_OPENAI_ADMIN_KEY_ENV", "OPENAI_ADMIN_KEY")
        admin_key = os.environ.get(env_name, "").strip()
        source: BillSource = (
            OpenAIUsageAPI(base_url, admin_key) if admin_key else
            _Unavailable(ReconciliationRun.Source.OPENAI_API, base_url,
                         f"no OpenAI admin key: the environment variable {env_name} is not set"))
        return [(key, source) for key in keys if _host(key.base_url) == _host(base_url)]
    raise ValueError(f"unknown reconciliation source {kind!r} (expected mock or openai)")


def configured_tolerance() -> Decimal:
    return Decimal(str(getattr(settings, "TOLLGATE_RECONCILE_TOLERANCE", DEFAULT_TOLERANCE)))


def reconcile_configured(day: date, kind: str, *, tolerance: Decimal | str | None = None,
                         provider_key: ProviderKey | None = None,
                         client: Any = None) -> list[ReconciliationRun]:
    """Reconcile one UTC day for every provider key the source covers (or only `provider_key`),
    under the day's lock (raises DayLocked if another worker holds it)."""
    if tolerance is None:
        tolerance = configured_tolerance()
    with day_lock(day, client=client):
        return [reconcile(day, source, tolerance=tolerance, provider_key=key)
                for key, source in configured_sources(kind)
                if provider_key is None or key.pk == provider_key.pk]


def yesterday_utc() -> date:
    return datetime.now(UTC).date() - timedelta(days=1)


# ---------------------------------------------------------------------------------------------
# What operators edit (Django admin): upstream key aliases, and pruning the run history
# ---------------------------------------------------------------------------------------------


def save_upstream_key_alias(alias: UpstreamKeyAlias, *, actor: str) -> UpstreamKeyAlias:
    """Validate and save an alias an operator entered (an OpenAI key id); audited. The next
    reconciliation run reads it: nothing caches aliases."""
    created = alias.pk is None
    alias.full_clean()
    with transaction.atomic():
        alias.save()
        record_audit_event(
            actor=actor, target=alias.upstream_key_id,
            action="upstream_key_alias.create" if created else "upstream_key_alias.update",
            data={"provider_key": alias.provider_key.public_id},
        )
    return alias


def delete_upstream_key_alias(alias: UpstreamKeyAlias, *, actor: str) -> None:
    with transaction.atomic():
        provider_key = alias.provider_key.public_id
        alias.delete()
        record_audit_event(actor=actor, action="upstream_key_alias.delete",
                           target=alias.upstream_key_id, data={"provider_key": provider_key})


def delete_reconciliation_run(run: ReconciliationRun, *, actor: str) -> None:
    """Prune a run and its rows from the history; audited with what it found."""
    with transaction.atomic():
        public_id = run.public_id
        data = {"period_start": run.period_start.isoformat(), "source": run.source,
                "status": run.status, "flagged_count": run.flagged_count}
        run.delete()
        record_audit_event(actor=actor, action="reconciliation_run.delete", target=public_id,
                           data=data)
