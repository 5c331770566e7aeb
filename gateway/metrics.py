"""Every request metric of Tollgate, in one place: names, help, labels and buckets, on
prometheus_client (billing/metrics.py adds the families read from PostgreSQL and Redis at scrape
time, and serves them all on /metrics).

Families (see the README's table for what each label holds):

    tollgate_requests_total{endpoint,status,refusal,model}      /v1 calls by how they ended
    tollgate_request_duration_seconds{endpoint,stream}          the whole call
    tollgate_upstream_ttfb_seconds{endpoint}                    request handed to the transport
                                                                -> the upstream's headers
    tollgate_gateway_overhead_seconds{endpoint}                 the gateway's own time (below)
    tollgate_tokens_total{model,class}                          tokens settled, by class
    tollgate_cost_microdollars_total{model}                     their cost (the settle's figure)
    tollgate_holds_total{event}                                 opened / settled / released /
                                                                swept / late_end
    tollgate_gateway_over_hold_calls_total                      settles above their hold
    tollgate_gateway_over_hold_tokens_total                     tokens above those holds
    tollgate_upstream_errors_total{provider_key,kind}           upstream failures
    tollgate_provider_cooldowns_total{provider_key}             cool-downs started
    tollgate_redis_duration_seconds{operation}                  reserve / settle / release RTT
    tollgate_tenant_requests_total{tenant,endpoint,status}      only for TOLLGATE_METRICS_TENANTS
    tollgate_tenant_tokens_total{tenant,class}                  likewise

The metered endpoints are in every family; the unmetered /v1 calls (the models, moderations,
token counts, stored objects, any other /v1 path: gateway/observe.py count_other) only in the
requests and their duration, with model "".

Every label is bounded: endpoints, statuses and refusal reasons are the gateway's own; `model`
is a catalog model (an alias counts as its model) or "other", whatever name a client sends;
`provider_key` is a provider key's public id (operators make them); `tenant` only for the
tenants listed in TOLLGATE_METRICS_TENANTS.

The gateway's overhead: the whole call (from the router taking the request to the last byte
sent) minus the time reading the request body, minus every wait on an upstream (each attempt's
transport call until its headers or its failure, reading a non-streamed answer, each wait for
the next chunk of a stream), minus the time waiting in a queue (the queue policy's, or for a
provider key's capacity) of a call that was admitted. What is left is the gateway's own work:
auth, parsing, counting tokens, the quota round trips, building and sending the answer. Calls
refused after waiting in the queue (queue_timeout) are left out of it: their time is the
plan's queue timeout. A call can end for its client in the middle of such a wait (the client
leaves while the upstream thinks or the call queues, a stream is cut at its deadline while the
next chunk is awaited); the wait then counts up to that instant, though it goes on after (a
detached call still gets its answer to settle): the figure stays the gateway's own time.

Processes: with PROMETHEUS_MULTIPROC_DIR set (config/serve.py sets it for the gateway workers and
the Celery processes), every process writes its figures to its own files there and /metrics
merges them (prometheus_client's multiprocess mode); unset, one process keeps them in memory
(tests through Django's client, a single worker).

Cost on the hot path: a write of prometheus_client's multiprocess values takes a lock, a getpid
and an mmap write (about 2.5 us on the 2-core bench machine, a histogram's twice that), and a
call makes about fifteen of them. So each process tallies its figures in plain dicts (`add`,
`observe`: a dict update) and writes them to the library's values every
TOLLGATE_METRICS_FLUSH_SECONDS while there are any (a timer on the event loop; at once where no
loop runs, e.g. the Celery sweep), on a scrape and at exit: one write per labelled child (per
bucket) per interval, whatever the request rate. A scrape therefore shows a call at most that
long after it ended. A uvicorn worker never runs its exit hooks (it dies of the SIGTERM it
re-raises after a graceful shutdown): gateway/asgi.py GatewayRouter writes the tally at the
worker's lifespan shutdown instead. A process killed outright (SIGKILL, the OOM killer) loses
what it tallied since its last write: at most one interval.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import prometheus_client
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from gateway.usage import Usage

# Counters have no `_created` samples: in multiprocess mode they do not exist anyway, and
# in-process they would double the page for nothing a dashboard uses.
prometheus_client.disable_created_metrics()

MULTIPROCESS_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
if MULTIPROCESS_DIR is not None and not os.path.isdir(MULTIPROCESS_DIR):
    # prometheus_client would fail on the first metric write, far from the cause.
    raise RuntimeError(f"PROMETHEUS_MULTIPROC_DIR={MULTIPROCESS_DIR!r} is not a directory; "
                       "create it (empty) before starting the processes that share it")

# The in-process registry (PROMETHEUS_MULTIPROC_DIR unset). In multiprocess mode the scrape
# reads the files instead (MultiProcessCollector), never this registry.
REGISTRY = CollectorRegistry(auto_describe=True)

OTHER_MODEL = "other"  # a model name the catalog does not know
NO_MODEL = ""  # the call was refused before its body was read

# Seconds. The whole call spans refusals of a millisecond to streams of minutes.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
# Fine around the product's targets (added p50 <= 0.5 ms, p99 <= 2 ms at one client).
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
                    0.025, 0.05, 0.1, 0.25, 1.0)
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 1.0)

REQUESTS = Counter(
    "tollgate_requests_total",
    "Calls of the metered /v1 endpoints by endpoint, HTTP status sent (499: the client left "
    "before the end of the answer; 504: a stream cut at the call's deadline), refusal reason "
    "(empty unless refused) and model (a catalog model, 'other', or empty when refused before "
    "the body was read).",
    ["endpoint", "status", "refusal", "model"], registry=REGISTRY)
REQUEST_SECONDS = Histogram(
    "tollgate_request_duration_seconds",
    "Whole call: from the gateway taking the request to the last byte of the answer sent "
    "(streams included), or to the client leaving.",
    ["endpoint", "stream"], buckets=DURATION_BUCKETS, registry=REGISTRY)
UPSTREAM_TTFB_SECONDS = Histogram(
    "tollgate_upstream_ttfb_seconds",
    "Time to first byte upstream: the request handed to the transport until the upstream's "
    "response headers, per attempt that got them.",
    ["endpoint"], buckets=TTFB_BUCKETS, registry=REGISTRY)
OVERHEAD_SECONDS = Histogram(
    "tollgate_gateway_overhead_seconds",
    "The gateway's own time in a call: the whole call minus reading the request body, every "
    "wait on an upstream and an admitted call's queue wait.",
    ["endpoint"], buckets=OVERHEAD_BUCKETS, registry=REGISTRY)
TOKENS = Counter(
    "tollgate_tokens_total",
    "Tokens of settled calls by class, each token in one class: input (plain), cached_input "
    "(prompt-cache reads), cache_write, output (plain), reasoning. Their sum is what quota "
    "counts.",
    ["model", "class"], registry=REGISTRY)
COST = Counter(
    "tollgate_cost_microdollars_total",
    "Cost of settled calls in micro-dollars, at the price resolved at admission (the figure "
    "the settle charges).",
    ["model"], registry=REGISTRY)
HOLDS = Counter(
    "tollgate_holds_total",
    "Quota holds: opened (admitted with a hold), settled and released by the gateway, swept "
    "by the sweep task, late_end (the gateway's settle or release found the hold already "
    "ended, e.g. swept: a correction).",
    ["event"], registry=REGISTRY)
OVER_HOLD_CALLS = Counter(
    "tollgate_gateway_over_hold_calls_total",
    "Settles whose usage exceeded the hold (counted by the gateway at settle; "
    "tollgate_over_hold_requests_total is the ledger's).", registry=REGISTRY)
OVER_HOLD_TOKENS = Counter(
    "tollgate_gateway_over_hold_tokens_total",
    "Tokens above the hold, summed over those settles.", registry=REGISTRY)
UPSTREAM_ERRORS = Counter(
    "tollgate_upstream_errors_total",
    "Upstream failures by provider key (public id) and kind: connect, timeout, transport "
    "(other HTTP errors), broken (mid-answer), 429, auth (401/403), 4xx, 5xx.",
    ["provider_key", "kind"], registry=REGISTRY)
COOLDOWNS = Counter(
    "tollgate_provider_cooldowns_total",
    "Cool-downs a gateway worker started for a provider key (its upstream answered 429, or "
    "refused the key).",
    ["provider_key"], registry=REGISTRY)
REDIS_SECONDS = Histogram(
    "tollgate_redis_duration_seconds",
    "Round trip of the quota engine's calls from the gateway, by operation (successful calls).",
    ["operation"], buckets=REDIS_BUCKETS, registry=REGISTRY)

TOKEN_CLASSES = ("input", "cached_input", "cache_write", "output", "reasoning")


# -- the tally: figures waiting to be written to prometheus_client's values ----------------


class HistogramChild:
    """A histogram's labelled child with its bucket bounds and the library's values, so a tally
    of observations is written as one increment per bucket (prometheus_client has no bulk
    observe: `_sum` and `_buckets` are its own, checked by tests/gateway/test_metrics.py)."""

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, family: Histogram, labels: Sequence[str], bounds: Sequence[float]) -> None:
        child = family.labels(*labels)
        self.bounds = tuple(bounds)
        self.sum = child._sum
        self.buckets = tuple(child._buckets)  # one per bound, then +Inf
        if len(self.buckets) != len(self.bounds) + 1:
            raise RuntimeError("prometheus_client's Histogram layout changed")


class Tally:
    """This process's figures since the last write to prometheus_client's values.

    Recorded on one thread: the event loop's (the gateway's code records nothing from its
    database or estimation threads), or a process's only thread where no loop runs (Celery),
    so `add` and `observe` take no lock. Written by the loop's timer, at exit (or a worker's
    lifespan shutdown), and by a scrape: a scrape on another thread (Django runs /metrics on
    one) asks the loop to write rather than swap the dicts under a recorder's feet, so it sees
    this process's last figures after the next turn of the loop, like other processes' after
    their timer."""

    __slots__ = ("armed", "counts", "histograms", "home", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # two writes never interleave (the timer's, exit's)
        self.counts: dict[Any, float] = {}  # counter child -> amount
        self.histograms: dict[HistogramChild, list[float]] = {}  # -> [sum, n per bucket...]
        self.armed = False  # a timer will write
        self.home: asyncio.AbstractEventLoop | None = None  # the loop recording, if any

    def add(self, child: Any, amount: float = 1.0) -> None:
        counts = self.counts
        counts[child] = counts.get(child, 0.0) + amount
        if not self.armed:
            self._arm()

    def observe(self, child: HistogramChild, seconds: float) -> None:
        tally = self.histograms.get(child)
        if tally is None:
            tally = self.histograms[child] = [0.0] * (len(child.buckets) + 1)
        tally[0] += seconds
        tally[bisect_left(child.bounds, seconds) + 1] += 1
        if not self.armed:
            self._arm()

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.write()  # no event loop here (Celery, a command): write at once
            return
        self.armed = True
        self.home = loop
        loop.call_later(settings.TOLLGATE_METRICS_FLUSH_SECONDS, self._due)

    def _due(self) -> None:
        self.armed = False
        self.write()

    def flush(self) -> None:
        """Write the tally now: here when called on the recording loop or with no loop running
        (a test's loop that ended, a process without one), else on that loop, soon."""
        home = self.home
        if home is not None and home.is_running():
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if here is not home:
                home.call_soon_threadsafe(self.write)
                return
        if home is None or home.is_closed():
            self.armed = False  # its timer will never fire: the next record arms another
        self.write()

    def write(self) -> None:
        """Write what was tallied to prometheus_client's values (its files in multiprocess
        mode). Only where recording cannot run meanwhile: see flush."""
        with self.lock:
            counts, self.counts = self.counts, {}
            histograms, self.histograms = self.histograms, {}
            # Snapshots (list): a recorder on another thread still holding the old dict (only
            # where several threads record with no loop, e.g. threaded WSGI) must not break this.
            for child, amount in list(counts.items()):
                child.inc(amount)
            for hist, tally in list(histograms.items()):
                hist.sum.inc(tally[0])
                for value, n in zip(hist.buckets, tally[1:], strict=True):
                    if n:
                        value.inc(n)


    def on_recording_thread(self, record: Any, *args: Any) -> None:
        """Call `record(*args)` where recording is safe: on the recording loop when it runs
        and this is another thread (Django closes a response on a thread of its own), else
        here."""
        home = self.home
        if home is not None and home.is_running():
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if here is not home:
                home.call_soon_threadsafe(record, *args)
                return
        record(*args)


_tally = Tally()
on_recording_thread = _tally.on_recording_thread
add = _tally.add
observe = _tally.observe
flush = _tally.flush
atexit.register(_tally.write)


# -- labelled children, made once -----------------------------------------------------------


_requests: dict[tuple[str, int, str, str], Any] = {}
_durations: dict[tuple[str, bool], HistogramChild] = {}
_ttfbs: dict[str, HistogramChild] = {}
_overheads: dict[str, HistogramChild] = {}
_tokens: dict[str, tuple[Any, ...]] = {}
_costs: dict[str, Any] = {}
_upstream_errors: dict[tuple[str, str], Any] = {}
_cooldowns: dict[str, Any] = {}


def request_child(endpoint: str, status: int, refusal: str, model: str) -> Any:
    key = (endpoint, status, refusal, model)
    child = _requests.get(key)
    if child is None:
        child = _requests[key] = REQUESTS.labels(endpoint, str(status), refusal, model)
    return child


def duration_child(endpoint: str, stream: bool) -> HistogramChild:
    key = (endpoint, stream)
    child = _durations.get(key)
    if child is None:
        child = _durations[key] = HistogramChild(
            REQUEST_SECONDS, (endpoint, "true" if stream else "false"), DURATION_BUCKETS)
    return child


def ttfb_child(endpoint: str) -> HistogramChild:
    child = _ttfbs.get(endpoint)
    if child is None:
        child = _ttfbs[endpoint] = HistogramChild(UPSTREAM_TTFB_SECONDS, (endpoint,),
                                                  TTFB_BUCKETS)
    return child


def overhead_child(endpoint: str) -> HistogramChild:
    child = _overheads.get(endpoint)
    if child is None:
        child = _overheads[endpoint] = HistogramChild(OVERHEAD_SECONDS, (endpoint,),
                                                      OVERHEAD_BUCKETS)
    return child


HOLD_OPENED = HOLDS.labels("opened")
HOLD_SETTLED = HOLDS.labels("settled")
HOLD_RELEASED = HOLDS.labels("released")
HOLD_SWEPT = HOLDS.labels("swept")
HOLD_LATE_END = HOLDS.labels("late_end")
REDIS_RESERVE = HistogramChild(REDIS_SECONDS, ("reserve",), REDIS_BUCKETS)
REDIS_SETTLE = HistogramChild(REDIS_SECONDS, ("settle",), REDIS_BUCKETS)
REDIS_RELEASE = HistogramChild(REDIS_SECONDS, ("release",), REDIS_BUCKETS)


def token_classes(usage: Usage) -> tuple[int, int, int, int, int]:
    """The usage split into TOKEN_CLASSES, each token in exactly one."""
    return (usage.plain_input_tokens, usage.cached_input_tokens, usage.cache_write_tokens,
            usage.plain_output_tokens, usage.reasoning_tokens)


def count_usage(model: str, usage: Usage, cost_micros: int, tenant: str | None) -> None:
    """A settled call's tokens (by class) and cost, under its model's label (and its tenant's,
    when opted in)."""
    children = _tokens.get(model)
    if children is None:
        children = _tokens[model] = tuple(TOKENS.labels(model, c) for c in TOKEN_CLASSES)
        _costs[model] = COST.labels(model)
    split = token_classes(usage)
    for i, n in enumerate(split):
        if n:
            add(children[i], n)
    if cost_micros:
        add(_costs[model], cost_micros)
    if tenant is not None:
        tenant_children = _tenant_token_children(tenant)
        for i, n in enumerate(split):
            if n:
                add(tenant_children[i], n)


def count_hold_end(ending: str, outcome: str, used: int, held: int) -> None:
    """The gateway's `ending` ("settled": a settle charging `used` tokens, or "released") came
    back with `outcome`: the hold ended so, or had ended already (a correction after the sweep,
    which counted it as swept). A settle above its hold is counted as over-hold usage, only
    when it ended a live hold: lua/settle.lua answers `held` 0 for a settle that found the hold
    already settled (a retry whose first attempt applied but lost its reply) and for one whose
    record Redis lost (the orphan path): neither knows the hold, so neither is over it."""
    if outcome != ending:
        add(HOLD_LATE_END)
    elif ending == "settled":
        add(HOLD_SETTLED)
        if used > held > 0:
            add(OVER_HOLD_CALLS)
            add(OVER_HOLD_TOKENS, used - held)
    else:
        add(HOLD_RELEASED)


def count_swept(holds: int) -> None:
    """Holds the sweep task ended (quotas/tasks.py reports them here: see gateway/apps.py)."""
    if holds:
        add(HOLD_SWEPT, holds)


def upstream_error(provider_key: str, kind: str) -> None:
    key = (provider_key, kind)
    child = _upstream_errors.get(key)
    if child is None:
        child = _upstream_errors[key] = UPSTREAM_ERRORS.labels(provider_key, kind)
    add(child)


def status_kind(status: int) -> str:
    """An upstream's error status as the `kind` label."""
    if status == 429:
        return "429"
    if status in (401, 403):
        return "auth"
    return "5xx" if status >= 500 else "4xx"


def cooldown(provider_key: str) -> None:
    child = _cooldowns.get(provider_key)
    if child is None:
        child = _cooldowns[provider_key] = COOLDOWNS.labels(provider_key)
    add(child)


def model_label(catalog: Any, name: str) -> str:
    """The `model` label of a model name: the catalog's model (an alias or dated snapshot
    counts as the model it names), else "other": a client may send any name, and each would
    be a series of its own."""
    if catalog is None:
        return OTHER_MODEL
    if name in catalog.models:
        return name
    canonical = catalog.canonical(name)
    return canonical if canonical in catalog.models else OTHER_MODEL


# -- tenant labels, opt-in (TOLLGATE_METRICS_TENANTS) ---------------------------------------


class _TenantFamilies:
    """Made on first use, so that with no tenant opted in the families do not exist at all."""

    requests: Counter | None = None
    tokens: Counter | None = None


_tenant_families = _TenantFamilies()
_tenant_requests: dict[tuple[str, str, int], Any] = {}
_tenant_tokens: dict[str, tuple[Any, ...]] = {}


class _Listed:
    """TOLLGATE_METRICS_TENANTS as a lookup, read once (each read of Django's settings object
    costs more than the lookup), again when a test changes the setting."""

    labels: dict[str, str] | None = None

    @classmethod
    def get(cls) -> dict[str, str]:
        if cls.labels is None:
            cls.labels = {entry: entry for entry in settings.TOLLGATE_METRICS_TENANTS}
        return cls.labels


@receiver(setting_changed)
def _reread_listed(setting: str, **kwargs: Any) -> None:
    if setting == "TOLLGATE_METRICS_TENANTS":
        _Listed.labels = None


def tenant_label(public_id: str, slug: str) -> str | None:
    """The `tenant` label of a tenant listed in TOLLGATE_METRICS_TENANTS (by public id or slug:
    the entry as the operator wrote it), else None: no tenant-labelled figure for it."""
    listed = _Listed.get()
    if not listed:
        return None
    return listed.get(public_id) or listed.get(slug)


def _tenant_family(name: str) -> Counter:
    if name == "requests":
        if _tenant_families.requests is None:
            _tenant_families.requests = Counter(
                "tollgate_tenant_requests_total",
                "Calls of the tenants listed in TOLLGATE_METRICS_TENANTS, by endpoint and HTTP "
                "status.", ["tenant", "endpoint", "status"], registry=REGISTRY)
        return _tenant_families.requests
    if _tenant_families.tokens is None:
        _tenant_families.tokens = Counter(
            "tollgate_tenant_tokens_total",
            "Tokens of settled calls of the tenants listed in TOLLGATE_METRICS_TENANTS, by "
            "class (as tollgate_tokens_total).", ["tenant", "class"], registry=REGISTRY)
    return _tenant_families.tokens


def tenant_request_child(tenant: str, endpoint: str, status: int) -> Any:
    key = (tenant, endpoint, status)
    child = _tenant_requests.get(key)
    if child is None:
        child = _tenant_requests[key] = _tenant_family("requests").labels(tenant, endpoint,
                                                                          str(status))
    return child


def _tenant_token_children(tenant: str) -> tuple[Any, ...]:
    children = _tenant_tokens.get(tenant)
    if children is None:
        family = _tenant_family("tokens")
        children = _tenant_tokens[tenant] = tuple(family.labels(tenant, c)
                                                  for c in TOKEN_CLASSES)
    return children


# -- the scrape -----------------------------------------------------------------------------


class RequestMetrics:
    """A collector of the request metrics for /metrics: every process's (the multiprocess
    directory's files), else this process's registry. Writes this process's tally first."""

    def collect(self) -> Iterator[Metric]:
        flush()
        if MULTIPROCESS_DIR is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            yield from MultiProcessCollector(None, MULTIPROCESS_DIR).collect()
        else:
            yield from REGISTRY.collect()


def families() -> Iterable[Metric]:
    return RequestMetrics().collect()
