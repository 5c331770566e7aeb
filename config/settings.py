"""Tollgate settings: everything comes from the environment and a malformed value stops startup.

With `DATABASE_URL` and `REDIS_URL` unset, Tollgate uses the embedded services that
`python -m config.embedded start` (run by `make up` and by the test fixtures) brings up under
`TOLLGATE_DATA_DIR`: a Redis server and a PostgreSQL server from pip-installed packages.
"""
from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import environ
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

from config.embedded import embedded_database_url, embedded_redis_url, local_secret
from config.telemetry import exporters as _trace_exporters
from gateway.client_address import parse_networks as _parse_networks

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()


def _positive_int(name: str, default: int) -> int:
    value = env.int(name, default=default)
    if value <= 0:
        raise ImproperlyConfigured(f"{name} must be a positive integer, got {value}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(name: str, default: bool) -> bool:
    # django-environ reads any unknown word as False; a typo must not silently turn a switch off.
    raw = env.str(name, default=str(default)).strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {raw!r}")


DEBUG = _bool("DEBUG", default=False)
# No default on purpose: a production host that forgot to say so must not come up with the
# development defaults (generated secrets, plain-http cookies, testserver in ALLOWED_HOSTS).
# `make up`, the tests and the benchmarks set it themselves.
TOLLGATE_ENV = env.str("TOLLGATE_ENV", default="")
if TOLLGATE_ENV not in {"development", "test", "production"}:
    raise ImproperlyConfigured(
        "TOLLGATE_ENV must be set to development, test or production, got "
        f"{TOLLGATE_ENV or 'nothing'!r}"
    )
if TOLLGATE_ENV == "production" and DEBUG:
    raise ImproperlyConfigured("DEBUG must be off in production: it shows settings and "
                               "tracebacks to anyone who triggers an error")
DATA_DIR = Path(env.str("TOLLGATE_DATA_DIR", default=str(BASE_DIR / ".data"))).resolve()


def _secret(name: str) -> str:
    """A secret from the environment; outside production a generated one kept under DATA_DIR."""
    value = env.str(name, default="")
    if value:
        return value
    if TOLLGATE_ENV == "production":
        raise ImproperlyConfigured(f"{name} must be set in production")
    return local_secret(DATA_DIR, name)


SECRET_KEY = _secret("SECRET_KEY")
# The pepper for API key digests is deliberately not SECRET_KEY: rotating the session secret
# must not invalidate every API key, and leaking one must not leak the other.
TOLLGATE_KEY_PEPPER = _secret("TOLLGATE_KEY_PEPPER")
# Fernet keys for provider and webhook secrets at rest, comma-separated: the first encrypts, all
# decrypt (add a new key in front to rotate, run `manage.py reencrypt_secrets`, then drop the
# old key). Outside production an empty value derives a key from SECRET_KEY (gateway/crypto.py);
# production must set it.
TOLLGATE_ENCRYPTION_KEYS = env.list("TOLLGATE_ENCRYPTION_KEYS", default=[])
if TOLLGATE_ENV == "production" and not TOLLGATE_ENCRYPTION_KEYS:
    raise ImproperlyConfigured("TOLLGATE_ENCRYPTION_KEYS must be set in production")

_DEVELOPMENT_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS",
                         default=[] if TOLLGATE_ENV == "production" else _DEVELOPMENT_HOSTS)
if TOLLGATE_ENV == "production":
    # Invitation links are built from the Host header: production names its hosts.
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured("ALLOWED_HOSTS must be set in production")
    if {"testserver", "*"} & set(ALLOWED_HOSTS):
        raise ImproperlyConfigured("ALLOWED_HOSTS must not contain 'testserver' or '*' in "
                                   "production")

INSTALLED_APPS = [
    "config.admin_apps.TollgateAdminConfig",  # django.contrib.admin, login throttled
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "tenants",
    "quotas",
    "gateway",
    "billing",
    # The interfaces over those apps: the tenant-admin console (config/console/, an app for its
    # template tags and static files). The management API (config/api/) needs no app entry.
    "config.console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The top-level `templates` package, found through the import system (an installed copy
        # has no checkout around it).
        "DIRS": [Path(str(resources.files("templates")))],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=embedded_database_url(DATA_DIR)),
}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL (postgres://...)")
DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=60))
# PgBouncer in transaction mode (DATABASE_URL names PgBouncer): a server connection is ours only
# for one transaction, so nothing may outlive one on the server. Two Django features would:
# server-side cursors (QuerySet.iterator() declares a cursor WITH HOLD in autocommit and fetches
# it in later transactions; Django's docs, "Transaction pooling and server-side cursors", ask for
# DISABLE_SERVER_SIDE_CURSORS) and psycopg 3's prepared statements (prepared on the connection
# after prepare_threshold runs). Django 5.2 already passes prepare_threshold=None unless OPTIONS
# set it (django/db/backends/postgresql/base.py) and binds parameters client-side unless
# OPTIONS server_side_binding is true; this pins the first and refuses a DATABASE_URL asking for
# prepared statements, which would fail at random under transaction pooling.
DATABASE_PGBOUNCER = _bool("DATABASE_PGBOUNCER", default=False)
if DATABASE_PGBOUNCER:
    _db_options = DATABASES["default"].setdefault("OPTIONS", {})
    if _db_options.get("prepare_threshold") not in (None, "", "None", "none"):
        raise ImproperlyConfigured(
            "DATABASE_PGBOUNCER is set: DATABASE_URL must not set prepare_threshold (PgBouncer in "
            "transaction mode cannot keep a prepared statement across transactions)")
    _db_options["prepare_threshold"] = None
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True

REDIS_URL = env.str("REDIS_URL", default=embedded_redis_url(DATA_DIR))
if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    # The scheme only: the rest of the URL may hold a password.
    raise ImproperlyConfigured("REDIS_URL must be redis://, rediss:// or unix://, got "
                               f"{urlsplit(REDIS_URL).scheme or 'no scheme'}:")
# A Redis Cluster is addressed by any one node's URL; every tenant's keys share one hash tag.
REDIS_CLUSTER = _bool("REDIS_CLUSTER", default=False)
REDIS_SOCKET_TIMEOUT = env.float("REDIS_SOCKET_TIMEOUT", default=2.0)
# Connections per process (per node on a cluster); callers beyond it wait for a free one.
REDIS_MAX_CONNECTIONS = _positive_int("REDIS_MAX_CONNECTIONS", 64)
if REDIS_SOCKET_TIMEOUT <= 0:
    raise ImproperlyConfigured(f"REDIS_SOCKET_TIMEOUT must be > 0 seconds, got {REDIS_SOCKET_TIMEOUT}")



def _redis_db(url: str) -> int:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "db" in query:
        return int(query["db"])
    path = parts.path.strip("/") if parts.scheme != "unix" else ""
    return int(path) if path else 0


def _with_redis_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"]
    if parts.scheme == "unix":  # the path is the socket's (urlunsplit would drop the "//")
        return f"unix://{parts.path}?{urlencode([*query, ('db', str(db))])}"
    return urlunsplit(parts._replace(path=f"/{db}", query=urlencode(query)))


def _redis_place(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    server = parts.path if parts.scheme == "unix" else (parts.hostname or "", parts.port or 6379)
    return str(server), _redis_db(url)


# The Django cache (console login throttle, one-use forms) never shares the quota counters' Redis
# database: a cache flush (FLUSHDB) or a cache-driven eviction must not touch a quota counter.
# Default: the quota server's other database (1, or 0 when REDIS_URL uses 1); a separate server
# (where an evicting maxmemory-policy is fine) is better still. A cluster has only database 0.
if REDIS_CLUSTER:
    CACHE_REDIS_URL = env.str("CACHE_REDIS_URL", default="")
    if not CACHE_REDIS_URL:
        raise ImproperlyConfigured(
            "REDIS_CLUSTER is set: set CACHE_REDIS_URL to a standalone Redis for the Django cache")
else:
    CACHE_REDIS_URL = env.str(
        "CACHE_REDIS_URL", default=_with_redis_db(REDIS_URL, 1 if _redis_db(REDIS_URL) == 0 else 0))
if not CACHE_REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(
        "CACHE_REDIS_URL must be redis://, rediss:// or unix://, got "
        f"{urlsplit(CACHE_REDIS_URL).scheme or 'no scheme'}:")
if not REDIS_CLUSTER and _redis_place(CACHE_REDIS_URL) == _redis_place(REDIS_URL):
    raise ImproperlyConfigured(
        "CACHE_REDIS_URL must name another Redis database or server than REDIS_URL: a cache "
        "flush would delete the quota counters")
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": CACHE_REDIS_URL,
        "KEY_PREFIX": "tg:cache",
        "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
    }
}

# The quota engine (quotas/). Durations in seconds.
QUOTA_STALE_HOLD_SECONDS = _positive_int("QUOTA_STALE_HOLD_SECONDS", 600)
QUOTA_COUNTER_GRACE_SECONDS = _positive_int("QUOTA_COUNTER_GRACE_SECONDS", 2 * 86400)
QUOTA_TOMBSTONE_SECONDS = _positive_int("QUOTA_TOMBSTONE_SECONDS", 3600)
QUOTA_SWEEP_BATCH = _positive_int("QUOTA_SWEEP_BATCH", 200)
# Usage events are appended to a per-tenant stream at settle and never trimmed there: only the
# ledger drain deletes them, after committing them (a PostgreSQL outage of any length loses no
# row; the backlog is a metric and an alert instead of a cap).
# A swept hold's tombstone must outlive every settle that may still arrive for it (they stop at
# the stale threshold), so that late settle corrects the sweep instead of finding nothing.
if QUOTA_TOMBSTONE_SECONDS <= QUOTA_STALE_HOLD_SECONDS:
    raise ImproperlyConfigured(
        "QUOTA_TOMBSTONE_SECONDS must exceed QUOTA_STALE_HOLD_SECONDS: a settle arriving after "
        "the sweep must still find the swept hold to correct it")
# Redis that forgets (quotas/durability.py, billing/rebuild.py). The quota Redis must run with
# maxmemory-policy noeviction, always; and with persistence (AOF or RDB save points) when this
# is on. /readyz, the gateway workers, the Celery worker and config.serve refuse it otherwise.
QUOTA_REDIS_REQUIRE_PERSISTENCE = _bool("QUOTA_REDIS_REQUIRE_PERSISTENCE",
                                        default=TOLLGATE_ENV == "production")
# What rebuilds a tenant's current-window counters from the ledger when its epoch marker is gone
# (a dotted path: the gateway cannot import billing, which imports the gateway).
QUOTA_REBUILDER = env.str("QUOTA_REBUILDER", default="billing.rebuild.rebuild_tenant")
# One worker rebuilds a tenant at a time (a Redis lock); a worker that died mid-way frees it
# after this long.
QUOTA_REBUILD_LOCK_SECONDS = _positive_int("QUOTA_REBUILD_LOCK_SECONDS", 60)
# A call that finds another process rebuilding its tenant's counters waits this long for it (a
# new tenant's rebuild takes milliseconds), then answers 503 quota_store_rebuilding.
QUOTA_REBUILD_WAIT_SECONDS = env.float("QUOTA_REBUILD_WAIT_SECONDS", default=2.0)
if QUOTA_REBUILD_WAIT_SECONDS < 0:
    raise ImproperlyConfigured("QUOTA_REBUILD_WAIT_SECONDS must be >= 0 seconds")

# The /v1 gateway (gateway/). Durations in seconds.
GATEWAY_UPSTREAM_CONNECT_TIMEOUT = env.float("GATEWAY_UPSTREAM_CONNECT_TIMEOUT", default=5.0)
# Longest wait for the first byte (and between bytes) of an upstream answer.
GATEWAY_UPSTREAM_READ_TIMEOUT = env.float("GATEWAY_UPSTREAM_READ_TIMEOUT", default=120.0)
# One deadline for the whole call, from the reserve to the end of the answer: waiting for an
# upstream connection, connecting, the first byte and the whole stream. A call still running then
# is ended (504 before the answer; a stream is cut and charged what it produced).
# GATEWAY_UPSTREAM_TOTAL_TIMEOUT is its former name (it bounded the stream only) and still works
# when the new name is not set. Checked below against QUOTA_STALE_HOLD_SECONDS.
if "GATEWAY_CALL_DEADLINE_SECONDS" in env and "GATEWAY_UPSTREAM_TOTAL_TIMEOUT" in env:
    raise ImproperlyConfigured(
        "Set GATEWAY_CALL_DEADLINE_SECONDS only: GATEWAY_UPSTREAM_TOTAL_TIMEOUT is its former name")
GATEWAY_CALL_DEADLINE_SECONDS = env.float(
    "GATEWAY_CALL_DEADLINE_SECONDS",
    default=env.float("GATEWAY_UPSTREAM_TOTAL_TIMEOUT", default=240.0))
# A call in flight longer than this tells its hold how far it got (forwarded; for a stream, the
# output tokens delivered so far), then again every interval while a stream delivers more, so a
# sweep after a crash charges what is known. Shorter calls write nothing extra.
GATEWAY_CHECKPOINT_SECONDS = env.float("GATEWAY_CHECKPOINT_SECONDS", default=1.0)
# Upstream connections per worker; a call beyond it waits (up to the read timeout) for one.
GATEWAY_UPSTREAM_MAX_CONNECTIONS = _positive_int("GATEWAY_UPSTREAM_MAX_CONNECTIONS", 256)
# The upstream HTTP client (gateway/upstream_http.py make_transport): "native", the gateway's
# own HTTP/1.1 keep-alive transport, the least CPU per call (docs/benchmarks.md, transports);
# "aiohttp", httpx-aiohttp's transport on aiohttp's client; "httpx", httpx's own (httpcore).
GATEWAY_UPSTREAM_TRANSPORT = env.str("GATEWAY_UPSTREAM_TRANSPORT", default="native")
if GATEWAY_UPSTREAM_TRANSPORT not in {"native", "aiohttp", "httpx"}:
    raise ImproperlyConfigured("GATEWAY_UPSTREAM_TRANSPORT must be native, aiohttp or httpx, got "
                               f"{GATEWAY_UPSTREAM_TRANSPORT!r}")
# aiohttp's reader raises a hang-up before handing over the events read with it, so a stream
# cut by its upstream is charged less than the upstream produced (the xfails of
# tests/gateway/test_upstream_http.py): fine to measure, never to bill with.
if GATEWAY_UPSTREAM_TRANSPORT == "aiohttp" and TOLLGATE_ENV == "production":
    raise ImproperlyConfigured(
        "GATEWAY_UPSTREAM_TRANSPORT=aiohttp is for benchmarks only: a stream its upstream cuts "
        "loses the events that came with the hang-up, so the tenant would be under-charged; use "
        "native (the default) or httpx in production")
# After a client leaves mid-stream, keep reading the upstream this long for its usage event.
GATEWAY_STREAM_DRAIN_SECONDS = env.float("GATEWAY_STREAM_DRAIN_SECONDS", default=10.0)
GATEWAY_MAX_BODY_BYTES = _positive_int("GATEWAY_MAX_BODY_BYTES", 8 * 1024 * 1024)
# Every other path (admin, console, management API): a larger body is refused (413) before it
# is read or spooled (gateway/asgi.py).
REQUEST_MAX_BODY_BYTES = _positive_int("REQUEST_MAX_BODY_BYTES", 1024 * 1024)
# Every request body, on every path, must have arrived this long after its headers, else 408
# and the connection is closed (a client trickling its body holds nothing for longer).
REQUEST_BODY_TIMEOUT_SECONDS = env.float("REQUEST_BODY_TIMEOUT_SECONDS", default=30.0)
# JSON bodies nested deeper than this (arrays and objects) are a 400, on /v1 and the API.
JSON_MAX_DEPTH = _positive_int("JSON_MAX_DEPTH", 64)
# /v1 bodies of at least this many bytes are parsed and token-counted on a thread
# (GATEWAY_ESTIMATE_THREADS per worker), so the worker's event loop keeps serving other calls;
# smaller ones inline, where a thread hand-off would cost more than it saves (docs/benchmarks.md).
GATEWAY_ESTIMATE_THREAD_BYTES = _positive_int("GATEWAY_ESTIMATE_THREAD_BYTES", 32 * 1024)
GATEWAY_ESTIMATE_THREADS = _positive_int("GATEWAY_ESTIMATE_THREADS", 2)
# Cached API keys are re-read at least this often even without an invalidation message: the
# bound on a revocation whose writer could not reach Redis at all (README, Security).
GATEWAY_AUTH_CACHE_SECONDS = env.float("GATEWAY_AUTH_CACHE_SECONDS", default=60.0)
# Keys kept per worker (least recently used evicted first).
GATEWAY_AUTH_CACHE_MAX_KEYS = _positive_int("GATEWAY_AUTH_CACHE_MAX_KEYS", 100_000)
# Unknown or unusable keys are remembered this long (their own bounded store: never evicts keys).
GATEWAY_AUTH_NEGATIVE_TTL_SECONDS = env.float("GATEWAY_AUTH_NEGATIVE_TTL_SECONDS", default=5.0)
GATEWAY_AUTH_NEGATIVE_MAX_KEYS = _positive_int("GATEWAY_AUTH_NEGATIVE_MAX_KEYS", 50_000)
# Database lookups of keys not cached, per client address per worker: a token bucket.
GATEWAY_AUTH_LOOKUPS_PER_SECOND = env.float("GATEWAY_AUTH_LOOKUPS_PER_SECOND", default=5.0)
GATEWAY_AUTH_LOOKUP_BURST = _positive_int("GATEWAY_AUTH_LOOKUP_BURST", 20)
# Client addresses whose bucket each worker tracks (least recently seen forgotten first).
GATEWAY_AUTH_LOOKUP_MAX_CLIENTS = _positive_int("GATEWAY_AUTH_LOOKUP_MAX_CLIENTS", 10_000)
# How often each worker reads the auth cache's version from Redis (a lost invalidation message
# empties the cache within two such checks).
GATEWAY_AUTH_VERSION_CHECK_SECONDS = env.float("GATEWAY_AUTH_VERSION_CHECK_SECONDS", default=1.0)
# Reverse proxies whose X-Forwarded-For is believed (CIDRs, comma-separated; default none).
try:
    TRUSTED_PROXIES = _parse_networks(env.list("TOLLGATE_TRUSTED_PROXIES", default=[]))
except ValueError as _error:
    raise ImproperlyConfigured(f"TOLLGATE_TRUSTED_PROXIES: {_error}") from None
GATEWAY_LAST_USED_FLUSH_SECONDS = env.float("GATEWAY_LAST_USED_FLUSH_SECONDS", default=5.0)
# A gateway worker told to stop (SIGTERM: a rolling deploy) stops accepting and lets its calls in
# flight finish for up to this long (uvicorn's --timeout-graceful-shutdown, whole seconds, which
# config/serve.py passes), then waits as long again for their detached ends and flushes its
# buffered writes (gateway/shutdown.py). A call still running then is cut and charged what it
# produced.
GATEWAY_SHUTDOWN_DRAIN_SECONDS = _positive_int("GATEWAY_SHUTDOWN_DRAIN_SECONDS", 60)
# Redis unreachable: refuse with 503 (default, fail closed), or forward unmetered (fail open:
# every such call is logged at ERROR and marked X-Tollgate-Unmetered).
GATEWAY_FAIL_OPEN = _bool("GATEWAY_FAIL_OPEN", default=False)
# After each write whose answer may come back fast (a quota script call, an upstream request),
# a worker's event loop polls instead of sleeping for this many microseconds
# (quotas/loop_spin.py): a halted CPU wakes slowly on a VM. 0 turns it off; at most 10,000
# (10 ms), past which it would be a busy loop.
GATEWAY_IDLE_SPIN_US = env.int("GATEWAY_IDLE_SPIN_US", default=200)
if not 0 <= GATEWAY_IDLE_SPIN_US <= 10_000:
    raise ImproperlyConfigured(
        f"GATEWAY_IDLE_SPIN_US must be between 0 and 10000, got {GATEWAY_IDLE_SPIN_US}")
# Threads (hence database connections) per gateway worker for cache misses and reloads.
GATEWAY_DB_THREADS = _positive_int("GATEWAY_DB_THREADS", 2)
# A gateway worker freezes its startup heap out of the cyclic GC and collects the young
# generation after this many allocations (Python's default is 700); 0 leaves the GC as is.
GATEWAY_GC_GEN0_THRESHOLD = env.int("GATEWAY_GC_GEN0_THRESHOLD", default=20_000)
# The waiting queue of the queue over-quota policy (quotas/waiting.py, lua/reserve.lua): at most
# TOLLGATE_QUEUE_MAX_WAITERS callers of one tenant wait at once (the next gets 429 queue_full);
# the head of a queue (and each process's front waiter of it) calls reserve again every
# TOLLGATE_QUEUE_HEAD_RETRY_MS besides the wakes; a head that has not come back within
# TOLLGATE_QUEUE_HEAD_LEASE_MS is taken for dead (its process was killed) and dropped.
TOLLGATE_QUEUE_MAX_WAITERS = _positive_int("TOLLGATE_QUEUE_MAX_WAITERS", 100)
# How long the gateway remembers a stored Responses API response (its provider key and context
# size, for the holds of calls continuing it and for retrieving it): OpenAI keeps stored
# responses 30 days. A reference older than this is one the gateway has not seen.
TOLLGATE_RESPONSES_TTL_SECONDS = _positive_int("TOLLGATE_RESPONSES_TTL_SECONDS", 30 * 86400)
TOLLGATE_QUEUE_HEAD_RETRY_MS = _positive_int("TOLLGATE_QUEUE_HEAD_RETRY_MS", 1000)
TOLLGATE_QUEUE_HEAD_LEASE_MS = _positive_int("TOLLGATE_QUEUE_HEAD_LEASE_MS", 3000)
if TOLLGATE_QUEUE_HEAD_LEASE_MS < 2 * TOLLGATE_QUEUE_HEAD_RETRY_MS:
    raise ImproperlyConfigured(
        "TOLLGATE_QUEUE_HEAD_LEASE_MS must be at least twice TOLLGATE_QUEUE_HEAD_RETRY_MS (a live "
        f"head must not be taken for dead), got {TOLLGATE_QUEUE_HEAD_LEASE_MS} and "
        f"{TOLLGATE_QUEUE_HEAD_RETRY_MS}")
# Circuit breakers on upstream provider keys (gateway/circuit.py): a key's breaker (connect
# errors, resets, timeouts) or a (key, model) breaker (5xx answers) opens when, within a window of
# TOLLGATE_BREAKER_WINDOW_SECONDS, at least _MIN_CALLS calls saw at least _ERROR_PERCENT % errors;
# the key is then skipped for _COOLDOWN_SECONDS, after which _PROBES probe calls must succeed to
# close it (one failure re-opens it). Successes reach Redis in batches every _FLUSH_SECONDS per
# worker (one script call per key and model; a failure carries its worker's unflushed ones): a
# shorter interval makes the error rate fresher and costs more round trips.
TOLLGATE_BREAKER_WINDOW_SECONDS = env.float("TOLLGATE_BREAKER_WINDOW_SECONDS", default=30.0)
TOLLGATE_BREAKER_MIN_CALLS = _positive_int("TOLLGATE_BREAKER_MIN_CALLS", 10)
TOLLGATE_BREAKER_ERROR_PERCENT = _positive_int("TOLLGATE_BREAKER_ERROR_PERCENT", 50)
if TOLLGATE_BREAKER_ERROR_PERCENT > 100:
    raise ImproperlyConfigured(
        f"TOLLGATE_BREAKER_ERROR_PERCENT must be 1-100, got {TOLLGATE_BREAKER_ERROR_PERCENT}")
TOLLGATE_BREAKER_COOLDOWN_SECONDS = env.float("TOLLGATE_BREAKER_COOLDOWN_SECONDS", default=30.0)
TOLLGATE_BREAKER_PROBES = _positive_int("TOLLGATE_BREAKER_PROBES", 3)
TOLLGATE_BREAKER_FLUSH_SECONDS = env.float("TOLLGATE_BREAKER_FLUSH_SECONDS", default=5.0)
for _name in ("TOLLGATE_BREAKER_WINDOW_SECONDS", "TOLLGATE_BREAKER_COOLDOWN_SECONDS",
              "TOLLGATE_BREAKER_FLUSH_SECONDS"):
    # Whole milliseconds in Redis: below 1 ms a window or cool-down would be 0.
    if not 0.001 <= globals()[_name] <= 86_400:
        raise ImproperlyConfigured(f"{_name} must be between 0.001 and 86400 seconds, got "
                                   f"{globals()[_name]:g}")
for _name in ("GATEWAY_UPSTREAM_CONNECT_TIMEOUT", "GATEWAY_UPSTREAM_READ_TIMEOUT",
              "GATEWAY_CALL_DEADLINE_SECONDS", "GATEWAY_CHECKPOINT_SECONDS",
              "GATEWAY_STREAM_DRAIN_SECONDS", "GATEWAY_AUTH_CACHE_SECONDS",
              "GATEWAY_AUTH_NEGATIVE_TTL_SECONDS", "GATEWAY_AUTH_LOOKUPS_PER_SECOND",
              "GATEWAY_AUTH_VERSION_CHECK_SECONDS",
              "GATEWAY_LAST_USED_FLUSH_SECONDS", "REQUEST_BODY_TIMEOUT_SECONDS"):
    if globals()[_name] <= 0:
        raise ImproperlyConfigured(f"{_name} must be > 0 seconds")
# The rule: a hold must end (deadline, then the drain of a stream whose client left, then one
# settle attempt: a Redis pool wait and the call, each up to REDIS_SOCKET_TIMEOUT) within half the
# stale threshold. The sweep never takes a live call's hold, and a settle that Redis did not
# answer has the other half to land before the sweep; its retries go on after that (a settle after
# the sweep corrects it) until the hold's tombstone could be gone (QUOTA_TOMBSTONE_SECONDS).
GATEWAY_HOLD_END_SECONDS = (GATEWAY_CALL_DEADLINE_SECONDS + GATEWAY_STREAM_DRAIN_SECONDS
                            + 2 * REDIS_SOCKET_TIMEOUT)
if GATEWAY_HOLD_END_SECONDS > QUOTA_STALE_HOLD_SECONDS / 2:
    raise ImproperlyConfigured(
        f"GATEWAY_CALL_DEADLINE_SECONDS ({GATEWAY_CALL_DEADLINE_SECONDS:g}) + "
        f"GATEWAY_STREAM_DRAIN_SECONDS ({GATEWAY_STREAM_DRAIN_SECONDS:g}) + 2 x "
        f"REDIS_SOCKET_TIMEOUT ({REDIS_SOCKET_TIMEOUT:g}) = {GATEWAY_HOLD_END_SECONDS:g} s must be "
        f"at most half of QUOTA_STALE_HOLD_SECONDS ({QUOTA_STALE_HOLD_SECONDS} s): the sweep would "
        "otherwise take holds of calls still running or still settling")
# Django's own limit on the bodies its views read (admin, console, management API; also under
# WSGI). Under ASGI the router refuses larger ones before Django sees them; /v1 reads its body
# itself, up to GATEWAY_MAX_BODY_BYTES (gateway/views.py).
DATA_UPLOAD_MAX_MEMORY_SIZE = REQUEST_MAX_BODY_BYTES

# Celery (config/celery.py). The broker: by default the quota Redis server (a standalone one:
# Celery cannot use a Redis Cluster as its broker, so a cluster deployment sets
# CELERY_BROKER_URL to another). A broker that survives a server's loss: Redis with Sentinel
# (`sentinel://host:26379;sentinel://host2:26379` and TOLLGATE_BROKER_SENTINEL_MASTER, the
# monitored master's name) or RabbitMQ (`amqp://`).
def _celery_url(redis_url: str) -> str:
    if redis_url.startswith("unix://"):
        # kombu names a socket's database "virtual_host"; the embedded server uses db 0.
        return "redis+socket://" + redis_url[len("unix://"):].partition("?")[0]
    return redis_url


_BROKER_SCHEMES = ("redis://", "rediss://", "redis+socket://", "sentinel://", "amqp://", "amqps://",
                   "pyamqp://", "memory://")
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="" if REDIS_CLUSTER else _celery_url(REDIS_URL))
if not CELERY_BROKER_URL:
    raise ImproperlyConfigured("REDIS_CLUSTER is set: set CELERY_BROKER_URL to a standalone Redis "
                               "(or Redis with Sentinel, sentinel://, or RabbitMQ, amqp://)")
if not CELERY_BROKER_URL.startswith(_BROKER_SCHEMES):
    raise ImproperlyConfigured(
        "CELERY_BROKER_URL must be redis://, rediss://, redis+socket://, sentinel:// or amqp://, "
        f"got {urlsplit(CELERY_BROKER_URL).scheme or 'no scheme'}:")
TOLLGATE_BROKER_SENTINEL_MASTER = env.str("TOLLGATE_BROKER_SENTINEL_MASTER", default="")
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith("sentinel://"):
    if not TOLLGATE_BROKER_SENTINEL_MASTER:
        raise ImproperlyConfigured("CELERY_BROKER_URL is sentinel://: set "
                                   "TOLLGATE_BROKER_SENTINEL_MASTER to the monitored master's name")
    CELERY_BROKER_TRANSPORT_OPTIONS["master_name"] = TOLLGATE_BROKER_SENTINEL_MASTER
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a task killed mid-way runs again (they are all idempotent)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = False
# Extra task modules every worker and beat imports (comma-separated dotted names): a site's own
# tasks, or a test's (tests/support/beat_probe.py).
TOLLGATE_CELERY_INCLUDE = tuple(env.list("TOLLGATE_CELERY_INCLUDE", default=[]))
for _module in TOLLGATE_CELERY_INCLUDE:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", _module):
        raise ImproperlyConfigured(f"TOLLGATE_CELERY_INCLUDE: {_module!r} is not a module name")

# The beat (celery-redbeat, config/beat.py): every host may run one; a lock in Redis makes one
# active, and its schedule state (each job's last run) lives there too, so a beat taking over
# neither repeats nor forgets a job. The lock expires TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS after
# the active beat's last tick; the others try to take it every fifth of that (the beat's longest
# sleep, CELERY_BEAT_MAX_LOOP_INTERVAL, also bounds the active's ticks, so it renews in time).
# Whole seconds: RedBeat renews the lock for int(timeout).
TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS = _positive_int("TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS", 30)
if TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS > 3600:
    raise ImproperlyConfigured("TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS must be <= 3600, got "
                               f"{TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS}")
CELERY_BEAT_MAX_LOOP_INTERVAL = TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS / 5
# A periodic job's message that waited this long in its queue, or a period if longer, is
# discarded unrun by the worker (config/celery.py with_expiry): a queue whose workers were down
# does not replay every missed period. Workers judge it by their own clock: keep it well above
# the clock skew between hosts.
TOLLGATE_BEAT_EXPIRY_MIN_SECONDS = _positive_int("TOLLGATE_BEAT_EXPIRY_MIN_SECONDS", 300)


def _redbeat_redis(broker_url: str) -> tuple[str, dict[str, object]]:
    """RedBeat's Redis (URL, client options) by default: the broker's, when it is Redis."""
    if broker_url.startswith("redis+socket://"):
        return "unix://" + broker_url[len("redis+socket://"):].partition("?")[0] + "?db=0", {}
    if broker_url.startswith(("redis://", "rediss://")):
        return broker_url, {}
    if broker_url.startswith("sentinel://"):
        # kombu's list of sentinels, `sentinel://[:password@]host:port[/db];sentinel://...`,
        # in RedBeat's form: a redis-sentinel:// URL and the sentinels among its options.
        parts = [urlsplit(part) for part in broker_url.split(";") if part]
        first = parts[0]
        options: dict[str, object] = {
            "sentinels": [(part.hostname, part.port or 26379) for part in parts],
            "service_name": TOLLGATE_BROKER_SENTINEL_MASTER,
            "db": int(first.path.strip("/") or 0)}
        if first.password:
            options["password"] = first.password
        return "redis-sentinel://", options
    return "", {}


_redbeat_default_url, _redbeat_options = _redbeat_redis(CELERY_BROKER_URL)
REDBEAT_REDIS_URL = env.str("REDBEAT_REDIS_URL", default="")
if REDBEAT_REDIS_URL:
    if not REDBEAT_REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
        raise ImproperlyConfigured(
            "REDBEAT_REDIS_URL must be redis://, rediss:// or unix:// (a standalone Redis; for "
            "Sentinel, use a sentinel:// broker: the beat follows it), got "
            f"{urlsplit(REDBEAT_REDIS_URL).scheme or 'no scheme'}:")
    _redbeat_options = {}
elif _redbeat_default_url:
    REDBEAT_REDIS_URL = _redbeat_default_url
else:
    raise ImproperlyConfigured("CELERY_BROKER_URL is not Redis: set REDBEAT_REDIS_URL to a "
                               "standalone Redis for the beat's lock and schedule")
# RedBeat's client options (config/celery.py passes them on). A beat that loses Redis retries
# for a lock timeout, then exits (its supervisor restarts it, as a standby if another took over).
REDBEAT_REDIS_OPTIONS = {**_redbeat_options, "retry_period": TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS,
                         "socket_timeout": REDIS_SOCKET_TIMEOUT}
TOLLGATE_SWEEP_INTERVAL_SECONDS = env.float("TOLLGATE_SWEEP_INTERVAL_SECONDS", default=60.0)
TOLLGATE_DRAIN_INTERVAL_SECONDS = env.float("TOLLGATE_DRAIN_INTERVAL_SECONDS", default=5.0)
for _name in ("TOLLGATE_SWEEP_INTERVAL_SECONDS", "TOLLGATE_DRAIN_INTERVAL_SECONDS"):
    if globals()[_name] <= 0:
        raise ImproperlyConfigured(f"{_name} must be > 0 seconds")
CELERY_BEAT_SCHEDULE = {
    "sweep-stale-holds": {"task": "quotas.tasks.sweep_stale_holds",
                          "schedule": TOLLGATE_SWEEP_INTERVAL_SECONDS},
    "drain-usage-ledger": {"task": "billing.tasks.drain_usage",
                           "schedule": TOLLGATE_DRAIN_INTERVAL_SECONDS},
    "check-quota-thresholds": {"task": "billing.tasks.check_quota_thresholds", "schedule": 60.0},
    "retry-due-webhooks": {"task": "billing.tasks.retry_due_webhooks", "schedule": 60.0},
    "check-pending-health": {"task": "billing.tasks.check_pending_health", "schedule": 300.0},
    # Tenants whose epoch marker is missing (Redis lost data) get their counters rebuilt from
    # the ledger before their next call has to wait for it.
    "rebuild-lost-quotas": {"task": "billing.rebuild.rebuild_lost_tenants",
                            "schedule": TOLLGATE_SWEEP_INTERVAL_SECONDS},
}

# Webhooks (billing/webhooks.py). Private, loopback and link-local targets are refused (server-side
# request forgery) unless this is on; the tests and a local `make up` may turn it on.
TOLLGATE_WEBHOOK_ALLOW_PRIVATE = _bool("TOLLGATE_WEBHOOK_ALLOW_PRIVATE", default=False)
TOLLGATE_WEBHOOK_TIMEOUT_SECONDS = env.float("TOLLGATE_WEBHOOK_TIMEOUT_SECONDS", default=5.0)
TOLLGATE_WEBHOOK_MAX_ATTEMPTS = _positive_int("TOLLGATE_WEBHOOK_MAX_ATTEMPTS", 6)
# Test events and redeliveries one tenant may have pending at once (each attempt may take a
# whole total deadline on the shared `webhooks` queue); beyond it the API answers 429.
TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX = _positive_int("TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX", 5)
TOLLGATE_WEBHOOK_BACKOFF_SECONDS = tuple(
    int(v) for v in env.list("TOLLGATE_WEBHOOK_BACKOFF_SECONDS", default=["10", "30", "120", "600", "3600"]))
if TOLLGATE_WEBHOOK_TIMEOUT_SECONDS <= 0 or not TOLLGATE_WEBHOOK_BACKOFF_SECONDS or min(
        TOLLGATE_WEBHOOK_BACKOFF_SECONDS) <= 0:
    raise ImproperlyConfigured("webhook timeout and backoff steps must be > 0 seconds")
# The wall-clock limit of one whole delivery attempt (DNS, connect, TLS, send, every read): the
# per-operation timeout above alone lets a receiver that trickles its answer hold a worker for
# ever. At most 60 s: a claimed attempt is reserved for 120 s (billing/webhooks.py).
TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS = env.float("TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS",
                                                   default=10.0)
if not 0 < TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS <= 60:
    raise ImproperlyConfigured("TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS must be > 0 and <= 60, got "
                               f"{TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS:g}")
# Every Celery task's soft and hard time limit (config/celery.py; a soft limit raises inside the
# task, a hard one kills its worker process). Webhook deliveries get their total deadline plus a
# margin, the daily reconciliation TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS, the retention
# TOLLGATE_RETENTION_TIME_LIMIT_SECONDS.
TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS = _positive_int("TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS", 240)
TOLLGATE_TASK_TIME_LIMIT_SECONDS = _positive_int("TOLLGATE_TASK_TIME_LIMIT_SECONDS", 300)
TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS = _positive_int("TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS", 1800)
# The daily ledger retention (billing.tasks.ledger_retention) may export a whole month to CSV
# before dropping it (TOLLGATE_LEDGER_EXPORT_DIR): at hundreds of millions of rows that is hours,
# which the default limit would cut every day, and the month would never be retired.
TOLLGATE_RETENTION_TIME_LIMIT_SECONDS = _positive_int("TOLLGATE_RETENTION_TIME_LIMIT_SECONDS",
                                                      6 * 3600)
if TOLLGATE_TASK_TIME_LIMIT_SECONDS <= TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS:
    raise ImproperlyConfigured("TOLLGATE_TASK_TIME_LIMIT_SECONDS must be above "
                               "TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS (the hard limit comes last)")
# Pending-holds health: alert operators when pending stays above this share of a tenant's daily
# limit for this long (a leak sign).
TOLLGATE_PENDING_ALERT_SECONDS = _positive_int("TOLLGATE_PENDING_ALERT_SECONDS", 600)
TOLLGATE_PENDING_ALERT_PERCENT = _positive_int("TOLLGATE_PENDING_ALERT_PERCENT", 20)
# Ledger backlog: alert operators once per episode when the oldest usage event still waiting for
# the drain is older than this (PostgreSQL down, or no worker draining); checked every minute.
TOLLGATE_LEDGER_BACKLOG_ALERT_SECONDS = _positive_int("TOLLGATE_LEDGER_BACKLOG_ALERT_SECONDS", 300)
CELERY_BEAT_SCHEDULE["check-ledger-backlog"] = {
    "task": "billing.tasks.check_ledger_backlog", "schedule": 60.0}
# The ledger's monthly partitions (billing/partitions.py): the beat makes this month's and the
# next two (and moves rows the default partition caught into their month's) once a day.
CELERY_BEAT_SCHEDULE["ensure-ledger-partitions"] = {
    "task": "billing.tasks.ensure_ledger_partitions", "schedule": 86400.0}
# Retention of the raw ledger (billing/retention.py): keep this many whole months before the
# current one; older month partitions are dropped once their UTC rollups match their raw rows
# (and they were exported). 0 (the default): keep everything, the daily task does nothing.
TOLLGATE_LEDGER_RETENTION_MONTHS = env.int("TOLLGATE_LEDGER_RETENTION_MONTHS", default=0)
if TOLLGATE_LEDGER_RETENTION_MONTHS < 0:
    raise ImproperlyConfigured("TOLLGATE_LEDGER_RETENTION_MONTHS must be 0 (keep everything) or "
                               f"a number of months, got {TOLLGATE_LEDGER_RETENTION_MONTHS}")
# Where the retention task writes a month's CSV (ledger-YYYY-MM.csv) before dropping it; empty:
# it drops only months already exported by `manage.py ledger_export` (and refuses the others).
TOLLGATE_LEDGER_EXPORT_DIR = env.str("TOLLGATE_LEDGER_EXPORT_DIR", default="")
if TOLLGATE_LEDGER_EXPORT_DIR and not Path(TOLLGATE_LEDGER_EXPORT_DIR).is_absolute():
    raise ImproperlyConfigured("TOLLGATE_LEDGER_EXPORT_DIR must be an absolute path, got "
                               f"{TOLLGATE_LEDGER_EXPORT_DIR!r}")
CELERY_BEAT_SCHEDULE["ledger-retention"] = {
    "task": "billing.tasks.ledger_retention", "schedule": 86400.0}
# Usage forecasts (billing/forecast.py): the burn rate is the ledger's last
# TOLLGATE_FORECAST_TRAILING_HOURS hours; with TOLLGATE_FORECAST_SHAPE_MIN_DAYS days of history
# (within the last TOLLGATE_FORECAST_HISTORY_DAYS) the rest of the window follows the usual day's
# shape. The beat checks every tenant's forecasts against its forecast_threshold_percent this
# often (billing.tasks.check_quota_forecasts: quota.forecast webhook and email, once per window).
TOLLGATE_FORECAST_TRAILING_HOURS = _positive_int("TOLLGATE_FORECAST_TRAILING_HOURS", 3)
TOLLGATE_FORECAST_HISTORY_DAYS = _positive_int("TOLLGATE_FORECAST_HISTORY_DAYS", 28)
TOLLGATE_FORECAST_SHAPE_MIN_DAYS = _positive_int("TOLLGATE_FORECAST_SHAPE_MIN_DAYS", 7)
if TOLLGATE_FORECAST_SHAPE_MIN_DAYS > TOLLGATE_FORECAST_HISTORY_DAYS:
    raise ImproperlyConfigured("TOLLGATE_FORECAST_SHAPE_MIN_DAYS must not exceed "
                               "TOLLGATE_FORECAST_HISTORY_DAYS")
TOLLGATE_FORECAST_INTERVAL_SECONDS = env.float("TOLLGATE_FORECAST_INTERVAL_SECONDS", default=300.0)
if TOLLGATE_FORECAST_INTERVAL_SECONDS <= 0:
    raise ImproperlyConfigured("TOLLGATE_FORECAST_INTERVAL_SECONDS must be > 0")
CELERY_BEAT_SCHEDULE["check-quota-forecasts"] = {
    "task": "billing.tasks.check_quota_forecasts", "schedule": TOLLGATE_FORECAST_INTERVAL_SECONDS}
# The index of active tenants (quotas/active.py): the drain, the sweep and the alert and health
# detectors visit only the tenants in it, so their work follows activity, not the number of
# tenants. TOLLGATE_ACTIVE_SHARDS sorted sets (each its own hash tag: no single hot key on a
# cluster); a gateway worker flushes the tenants it served every GATEWAY_ACTIVE_FLUSH_SECONDS,
# and writes a tenant's mark before its first reserve in half the retention (so a worker killed
# before its flush leaves no hold the index does not know); a tenant leaves once it has no open
# hold and no undrained event and was last marked more than TOLLGATE_ACTIVE_RETENTION_SECONDS ago
# (above the stale-hold threshold and a detector's period, so each detector sees it after its
# last call); every job also walks every tenant once per TOLLGATE_ACTIVE_FULL_WALK_SECONDS, the
# bound on a tenant the index missed (holds written without the engine), and at once when it
# finds the index lost.
TOLLGATE_ACTIVE_SHARDS = _positive_int("TOLLGATE_ACTIVE_SHARDS", 16)
if TOLLGATE_ACTIVE_SHARDS > 1024:
    raise ImproperlyConfigured(f"TOLLGATE_ACTIVE_SHARDS must be 1-1024, got {TOLLGATE_ACTIVE_SHARDS}")
_ACTIVE_MIN_RETENTION = QUOTA_STALE_HOLD_SECONDS + max(300, int(TOLLGATE_FORECAST_INTERVAL_SECONDS))
TOLLGATE_ACTIVE_RETENTION_SECONDS = _positive_int("TOLLGATE_ACTIVE_RETENTION_SECONDS",
                                                  _ACTIVE_MIN_RETENTION)
if TOLLGATE_ACTIVE_RETENTION_SECONDS < _ACTIVE_MIN_RETENTION:
    raise ImproperlyConfigured(
        f"TOLLGATE_ACTIVE_RETENTION_SECONDS must be at least QUOTA_STALE_HOLD_SECONDS "
        f"({QUOTA_STALE_HOLD_SECONDS}) + the longest detector period (300 s, or "
        f"TOLLGATE_FORECAST_INTERVAL_SECONDS if longer) = {_ACTIVE_MIN_RETENTION}, got "
        f"{TOLLGATE_ACTIVE_RETENTION_SECONDS}: a detector must see each tenant after its last call")
TOLLGATE_ACTIVE_FULL_WALK_SECONDS = _positive_int("TOLLGATE_ACTIVE_FULL_WALK_SECONDS", 3600)
GATEWAY_ACTIVE_FLUSH_SECONDS = env.float("GATEWAY_ACTIVE_FLUSH_SECONDS", default=1.0)
if not 0 < GATEWAY_ACTIVE_FLUSH_SECONDS <= 60:
    raise ImproperlyConfigured("GATEWAY_ACTIVE_FLUSH_SECONDS must be > 0 and <= 60, got "
                               f"{GATEWAY_ACTIVE_FLUSH_SECONDS:g}")
# Bearer token for GET /metrics (Prometheus); empty: /metrics answers 403.
TOLLGATE_METRICS_TOKEN = env.str("TOLLGATE_METRICS_TOKEN", default="")
# Tenants whose calls and tokens /metrics also counts per tenant (label `tenant`: the entry as
# written), by public id or slug, comma-separated. Opt-in, so the label's cardinality is the
# operator's choice; empty (the default): no tenant-labelled family at all.
_METRICS_TENANTS_MAX = 100


def _metrics_tenants() -> tuple[str, ...]:
    raw = env.str("TOLLGATE_METRICS_TENANTS", default="")
    entries = tuple(part.strip() for part in raw.split(",")) if raw.strip() else ()
    for entry in entries:
        if not re.fullmatch(r"[-a-zA-Z0-9_]{1,63}", entry):
            raise ImproperlyConfigured(
                f"TOLLGATE_METRICS_TENANTS: {entry!r} is not a tenant public id or slug "
                "(comma-separated, letters, digits, - and _)")
    if len(set(entries)) != len(entries):
        raise ImproperlyConfigured("TOLLGATE_METRICS_TENANTS lists a tenant twice")
    if len(entries) > _METRICS_TENANTS_MAX:
        raise ImproperlyConfigured(f"TOLLGATE_METRICS_TENANTS lists {len(entries)} tenants; at "
                                   f"most {_METRICS_TENANTS_MAX} (each is a set of series)")
    return entries


TOLLGATE_METRICS_TENANTS = _metrics_tenants()
# How often a process writes its tallied request metrics where /metrics reads them
# (gateway/metrics.py): a scrape sees other workers' calls at most this late.
TOLLGATE_METRICS_FLUSH_SECONDS = env.float("TOLLGATE_METRICS_FLUSH_SECONDS", default=1.0)
if not 0 < TOLLGATE_METRICS_FLUSH_SECONDS <= 60:
    raise ImproperlyConfigured("TOLLGATE_METRICS_FLUSH_SECONDS must be > 0 and <= 60, got "
                               f"{TOLLGATE_METRICS_FLUSH_SECONDS}")
# Daily reconciliation against the upstream bill: "mock", "openai" or "" (off).
TOLLGATE_RECONCILE_SOURCE = env.str("TOLLGATE_RECONCILE_SOURCE", default="")
if TOLLGATE_RECONCILE_SOURCE not in {"", "mock", "openai"}:
    raise ImproperlyConfigured("TOLLGATE_RECONCILE_SOURCE must be mock, openai or empty")
TOLLGATE_OPENAI_ADMIN_KEY_ENV = env.str("TOLLGATE_OPENAI_ADMIN_KEY_ENV", default="OPENAI_ADMIN_KEY")
TOLLGATE_OPENAI_USAGE_BASE_URL = env.str("TOLLGATE_OPENAI_USAGE_BASE_URL",
                                         default="https://api.openai.com/v1")
TOLLGATE_RECONCILE_TOLERANCE = env.str("TOLLGATE_RECONCILE_TOLERANCE", default="0.05")
TOLLGATE_RECONCILE_HOUR = env.int("TOLLGATE_RECONCILE_HOUR", default=2)  # UTC, for yesterday
if not 0 <= TOLLGATE_RECONCILE_HOUR <= 23:
    raise ImproperlyConfigured("TOLLGATE_RECONCILE_HOUR must be 0..23")
CELERY_BEAT_SCHEDULE["reconcile-daily"] = {
    "task": "billing.tasks.reconcile_daily",
    "schedule": crontab(hour=TOLLGATE_RECONCILE_HOUR, minute=15),
}
# A schedule that replaces CELERY_BEAT_SCHEDULE (config/celery.py applies it), for a test or a
# staging run: JSON {"name": {"task": "dotted.task", "every": seconds, "args": [...]}, ...}.
_BEAT_OVERRIDE_KEYS = {"task", "every", "args"}


def _beat_schedule_override() -> dict[str, dict[str, object]]:
    raw = env.str("TOLLGATE_BEAT_SCHEDULE_OVERRIDE", default="")
    if not raw.strip():
        return {}
    try:
        entries = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"TOLLGATE_BEAT_SCHEDULE_OVERRIDE is not JSON: {exc}") from exc
    if not isinstance(entries, dict) or not entries:
        raise ImproperlyConfigured("TOLLGATE_BEAT_SCHEDULE_OVERRIDE must be a non-empty JSON object")
    schedule: dict[str, dict[str, object]] = {}
    for name, entry in entries.items():
        if (not isinstance(entry, dict) or not {"task", "every"} <= set(entry) <= _BEAT_OVERRIDE_KEYS
                or not isinstance(entry["task"], str)
                or isinstance(entry["every"], bool)
                or not isinstance(entry["every"], int | float) or not entry["every"] > 0
                or not isinstance(entry.get("args", []), list)):
            raise ImproperlyConfigured(
                f"TOLLGATE_BEAT_SCHEDULE_OVERRIDE: {name!r} must be {{\"task\": name, \"every\": "
                "seconds > 0[, \"args\": [...]]}")
        schedule[name] = {"task": entry["task"], "schedule": float(entry["every"]),
                          "args": tuple(entry.get("args", []))}
    return schedule


TOLLGATE_BEAT_SCHEDULE_OVERRIDE = _beat_schedule_override()

# Operators' alerts (drift, leaks) go to ADMINS by email: "Name <a@b.c>, ..." in TOLLGATE_ADMINS.
ADMINS = [(addr.split("<")[0].strip() or addr, addr.split("<")[-1].rstrip(">").strip())
          for addr in env.list("TOLLGATE_ADMINS", default=[])]
EMAIL_CONFIG = env.email_url("EMAIL_URL", default="consolemail://")
vars().update(EMAIL_CONFIG)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="tollgate@localhost")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
# WhiteNoise serves app static files straight from the apps (no collectstatic step for the quick
# start); production may still run collectstatic for compressed, cache-busted copies.
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every start without it
WHITENOISE_AUTOREFRESH = DEBUG

PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",  # verifies older hashes, then upgrades
]

# The console (config/console/) and the management API (config/api/).
LOGIN_URL = "/console/login/"
LOGIN_REDIRECT_URL = "/console/"
LOGOUT_REDIRECT_URL = "/console/login/"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# Outside production the quick start is plain http on localhost, where Secure cookies would
# never be sent back.
SESSION_COOKIE_SECURE = _bool("SESSION_COOKIE_SECURE", default=TOLLGATE_ENV == "production")
CSRF_COOKIE_SECURE = _bool("CSRF_COOKIE_SECURE", default=TOLLGATE_ENV == "production")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
SECURE_CONTENT_TYPE_NOSNIFF = True


def _proxy_ssl_header() -> tuple[str, str] | None:
    """SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https": behind a TLS-terminating proxy
    that sets this header (and strips it from clients), requests count as https."""
    raw = env.str("SECURE_PROXY_SSL_HEADER", default="").strip()
    if not raw:
        return None
    name, _, value = (part.strip() for part in raw.partition(","))
    if not name.startswith("HTTP_") or not value:
        raise ImproperlyConfigured(
            "SECURE_PROXY_SSL_HEADER must be 'HTTP_<HEADER>,<value>', e.g. "
            f"'HTTP_X_FORWARDED_PROTO,https', got {raw!r}")
    return name, value


SECURE_PROXY_SSL_HEADER = _proxy_ssl_header()
if TOLLGATE_ENV == "production" and SECURE_PROXY_SSL_HEADER and not TRUSTED_PROXIES:
    # Behind a proxy whose address is not trusted, every client has the proxy's address: the
    # per-address limits (login throttles, the gateway's key lookups) would be one shared
    # bucket, and five failed logins by anyone would lock everyone out.
    raise ImproperlyConfigured("SECURE_PROXY_SSL_HEADER says Tollgate is behind a proxy: name "
                               "it in TOLLGATE_TRUSTED_PROXIES (CIDRs) in production")
# HSTS is sent on https responses only (Django's SecurityMiddleware); on by default in production.
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS",
                              default=31_536_000 if TOLLGATE_ENV == "production" else 0)
if SECURE_HSTS_SECONDS < 0:
    raise ImproperlyConfigured(f"SECURE_HSTS_SECONDS must be >= 0, got {SECURE_HSTS_SECONDS}")
SECURE_HSTS_INCLUDE_SUBDOMAINS = _bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = _bool("SECURE_HSTS_PRELOAD", default=False)
SECURE_SSL_REDIRECT = _bool("SECURE_SSL_REDIRECT", default=False)
X_FRAME_OPTIONS = "DENY"
# Failed console logins allowed per username and per client address in the window, then refused
# until the window passes.
LOGIN_FAILURE_LIMIT = _positive_int("LOGIN_FAILURE_LIMIT", 5)
LOGIN_FAILURE_WINDOW_SECONDS = _positive_int("LOGIN_FAILURE_WINDOW_SECONDS", 900)
INVITATION_TTL_SECONDS = _positive_int("INVITATION_TTL_SECONDS", 7 * 86400)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "config.api.token_authentication.ManagementTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # A management token must also have the scope its view declares (config/api/scopes.py).
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "config.api.scopes.TokenScopeRequired",
    ],
    # DRF's JSON parser with a nesting bound (JSON_MAX_DEPTH): a deep body is a 400, not a 500.
    "DEFAULT_PARSER_CLASSES": [
        "config.api.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # limit 1..200, offset bounded; a malformed or out-of-range value is a 400.
    "DEFAULT_PAGINATION_CLASS": "config.api.pagination.BoundedLimitOffsetPagination",
    # The API's default page size (config/api/pagination.py reads it from here).
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tollgate management API",
    "DESCRIPTION": "Tenants, projects, API keys, limits, usage, webhooks, reports and audit "
    "events. Authenticate with a session (the console) or `Authorization: Bearer tgm_...`.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "PREPROCESSING_HOOKS": ["config.api.openapi.management_api_only"],
    # Every operation documents the errors any of them can answer (400/401/403/404/...).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "config.api.openapi.document_common_errors",
    ],
    # The schema and its docs page are for signed-in console users and management tokens only.
    "SERVE_PERMISSIONS": [
        "rest_framework.permissions.IsAuthenticated",
        "config.api.scopes.TokenScopeRequired",
    ],
    "ENUM_NAME_OVERRIDES": {
        "MembershipRoleEnum": "tenants.models.Membership.Role",
        "InvitableRoleEnum": "tenants.membership.INVITABLE_ROLES",
        "ManagementTokenScopeEnum": "tenants.models.ManagementToken.Scope",
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Log lines (config/log_format.py): `plain` for a terminal (the request id in brackets inside a
# request), `json` for a log pipeline (one object per line with the request's public ids).
TOLLGATE_LOG_FORMAT = env.str("TOLLGATE_LOG_FORMAT", default="plain").strip().lower()
if TOLLGATE_LOG_FORMAT not in {"plain", "json"}:
    raise ImproperlyConfigured(
        f"TOLLGATE_LOG_FORMAT must be plain or json, got {TOLLGATE_LOG_FORMAT!r}")
# One line per /v1 request (gateway/access_log.py). On by default with json logs, which a
# pipeline collects; off with plain ones: a line per call costs CPU on every request.
TOLLGATE_ACCESS_LOG = _bool("TOLLGATE_ACCESS_LOG", default=TOLLGATE_LOG_FORMAT == "json")
# The span exporters the OTEL_* variables ask for (config/telemetry.py; () = no tracing). Each
# process sets tracing up itself after its fork; read here too so that a misspelt exporter or an
# unsupported OTLP protocol stops every process at start, Celery's included.
TOLLGATE_TRACE_EXPORTERS = _trace_exporters(env.ENVIRON)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"()": "config.log_format.PlainFormatter"},
                   "json": {"()": "config.log_format.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler",
                             "formatter": TOLLGATE_LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {
        # One line per upstream call is noise at thousands of requests per second.
        "httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"},
        # The access log is switched by TOLLGATE_ACCESS_LOG, not by LOG_LEVEL.
        "tollgate.access": {"level": "INFO"},
        # uvicorn gives its loggers handlers of its own (its format); in a gateway worker, which
        # loads these settings, they write through the console handler above instead. Their
        # level stays uvicorn's --log-level (each named here: dictConfig resets the level of an
        # unnamed child of a logger it configures).
        "uvicorn": {"handlers": [], "propagate": True},
        "uvicorn.error": {"handlers": [], "propagate": True},
        "uvicorn.access": {"handlers": [], "propagate": True},
    },
}
