"""The Celery app, its queues and its beat schedule (in code: every deployment runs the same
jobs).

    celery -A config worker -Q ledger -l info     # a worker per queue (QUEUES below) ...
    celery -A config beat -l info                 # ... and a beat on every host, or on one

(`make up`, config/serve.py, runs a worker per queue and a beat.) A web process that queues tasks
(the console's and the API's webhook views) imports this module, so it publishes with this app's
broker and routes.

Every task is idempotent and safe when two workers run it at once (see each task).

Queues: each job has a queue of its own kind (TASK_ROUTES), so a slow one never starves the
others: the ledger drain never waits behind the daily reconciliation, the sweep never behind a
tarpitting webhook receiver. A worker started without `-Q` consumes every queue (all are declared
in task_queues); `make up` and production run one worker per queue.

The beat is celery-redbeat's scheduler (config/beat.py): its schedule state and a lock live in
Redis (REDBEAT_REDIS_URL, by default the broker's), so a beat runs on every host and only the
lock's holder sends jobs; when it dies, another takes the lock once it expires
(TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS) and runs what fell due once.

Time limits: every task has a soft limit (SoftTimeLimitExceeded is raised inside it) and a hard
one (the worker process running it is killed and replaced): TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS
and TOLLGATE_TASK_TIME_LIMIT_SECONDS, with overrides below for the jobs that legitimately take
longer or must be shorter. Every task is idempotent, so one cut short runs again on schedule.

A worker refuses to start on a quota Redis that may evict or lose counters (quotas/durability.py):
its sweeps and ledger drain would work on counters that can vanish.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.schedules import crontab, maybe_schedule
from celery.schedules import schedule as celery_schedule
from celery.signals import (
    setup_logging,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from quotas.keys import beat_key_prefix

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

log = logging.getLogger(__name__)

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["quotas", "billing"])
# The rebuild of lost quota counters lives with the ledger it reads (billing/rebuild.py).
app.autodiscover_tasks(["billing"], related_name="rebuild")

# The queues. The default keeps Celery's name, so messages queued before the split still run.
DEFAULT_QUEUE = "celery"       # alerts, forecasts, health checks, the ledger backlog check
LEDGER_QUEUE = "ledger"        # the ledger drain (every few seconds; its delay is the ledger's)
SWEEP_QUEUE = "sweep"          # the quota store's upkeep: stale holds, lost counters' rebuild
WEBHOOK_QUEUE = "webhooks"     # deliveries (a receiver may take its whole deadline) and retries
REPORTS_QUEUE = "reports"      # the long ones: the daily reconciliation, partitions, retention
WORKER_QUEUES = (DEFAULT_QUEUE, LEDGER_QUEUE, SWEEP_QUEUE, WEBHOOK_QUEUE, REPORTS_QUEUE)

# Task name (or glob pattern) -> queue; a task not named here runs on DEFAULT_QUEUE. The backlog
# check is not on the ledger queue on purpose: it alerts when the drain is stuck or no ledger
# worker runs, which it could not do waiting behind that drain.
TASK_ROUTES: dict[str, str] = {
    "billing.tasks.drain_usage": LEDGER_QUEUE,
    "quotas.tasks.sweep_stale_holds": SWEEP_QUEUE,
    # Rebuilding a tenant's lost counters is the quota store's upkeep too; it must not wait
    # behind a report (its tenants' calls wait for it).
    "billing.rebuild.rebuild_lost_tenants": SWEEP_QUEUE,
    "billing.tasks.deliver_webhook": WEBHOOK_QUEUE,
    "billing.tasks.retry_due_webhooks": WEBHOOK_QUEUE,
    "billing.tasks.reconcile_daily": REPORTS_QUEUE,
    # The ledger's partition upkeep and retention (their tasks, whatever their module's name).
    "billing.*partition*": REPORTS_QUEUE,
    "billing.*retention*": REPORTS_QUEUE,
}

# Seconds beyond a webhook attempt's total deadline for the task's own database work.
_WEBHOOK_TASK_MARGIN_S = 20


def time_limits() -> dict[str, dict[str, float]]:
    """The tasks whose limits differ from the default: (soft, hard) by task name."""
    webhook_soft = settings.TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS + _WEBHOOK_TASK_MARGIN_S
    reconcile_soft = float(settings.TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS)
    retention_soft = float(settings.TOLLGATE_RETENTION_TIME_LIMIT_SECONDS)
    return {
        # One attempt is bounded by its total deadline: the task needs little more.
        "billing.tasks.deliver_webhook": {"soft_time_limit": webhook_soft,
                                          "time_limit": webhook_soft + 10},
        # Pages through the upstream's usage API for every provider key.
        "billing.tasks.reconcile_daily": {"soft_time_limit": reconcile_soft,
                                          "time_limit": reconcile_soft + 60},
        # Exports a month to CSV before dropping it (billing/retention.py): hours at scale.
        "billing.tasks.ledger_retention": {"soft_time_limit": retention_soft,
                                           "time_limit": retention_soft + 60},
    }


# A crontab entry's period, for its expiry (every crontab job here runs once a day).
_CRONTAB_PERIOD_S = 86_400.0


def with_expiry(schedule: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The beat's entries, each message expiring (Celery's `expires`: a worker discards it unrun)
    once it is a period old, and never sooner than TOLLGATE_BEAT_EXPIRY_MIN_SECONDS. So a queue
    whose workers were down for an hour does not run the 720 drains and 60 sweeps it missed
    back to back when they return: the messages still fresh do the work (every job is
    idempotent and catches up by itself). The floor is there because a worker judges expiry by
    its own clock against the beat's: it tolerates that much skew between hosts. An entry that
    sets its own `expires` keeps it."""
    floor = float(settings.TOLLGATE_BEAT_EXPIRY_MIN_SECONDS)
    out: dict[str, dict[str, Any]] = {}
    for name, entry in schedule.items():
        # Seconds, a timedelta or a schedule object, as Celery reads the entry.
        every = maybe_schedule(entry["schedule"])
        if isinstance(every, crontab):
            period = _CRONTAB_PERIOD_S
        elif isinstance(every, celery_schedule):
            period = every.run_every.total_seconds()
        else:
            raise ImproperlyConfigured(f"beat entry {name!r}: no period known for "
                                       f"{type(every).__name__}")
        options = {"expires": max(period, floor), **entry.get("options", {})}
        out[name] = {**entry, "options": options}
    return out


app.conf.update(
    task_default_queue=DEFAULT_QUEUE,
    task_queues=tuple(Queue(name, routing_key=name) for name in WORKER_QUEUES),
    task_routes={name: {"queue": queue} for name, queue in TASK_ROUTES.items()},
    include=list(settings.TOLLGATE_CELERY_INCLUDE),
    beat_scheduler="config.beat:TollgateBeatScheduler",
    # RedBeat's settings by their own names: it does not see Django's CELERY_ namespace.
    redbeat_key_prefix=beat_key_prefix(),
    redbeat_redis_url=settings.REDBEAT_REDIS_URL,
    redbeat_redis_options=settings.REDBEAT_REDIS_OPTIONS,
    redbeat_lock_timeout=settings.TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS,
    beat_schedule=with_expiry(settings.TOLLGATE_BEAT_SCHEDULE_OVERRIDE
                              or settings.CELERY_BEAT_SCHEDULE),
    task_soft_time_limit=float(settings.TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS),
    task_time_limit=float(settings.TOLLGATE_TASK_TIME_LIMIT_SECONDS),
    task_annotations=time_limits(),
)


@worker_init.connect
def refuse_unsafe_quota_store(**kwargs: Any) -> None:
    """Stop the worker before it consumes anything when the quota Redis is unsafe. SystemExit,
    not an exception: Celery logs and ignores exceptions raised by signal handlers."""
    import django

    django.setup()
    from redis.exceptions import RedisError

    from quotas.client import make_redis
    from quotas.durability import check

    client = make_redis()
    try:
        problems = check(client)
    except (RedisError, OSError) as exc:  # ResponseError is handled inside the check
        # Unreachable is not unsafe: the tasks retry on their schedule and fail closed.
        log.warning("cannot read the quota Redis's configuration at start-up: %s", exc)
        return
    finally:
        client.close()
    if problems:
        for problem in problems:
            log.critical("refusing the quota store: %s", problem)
        raise SystemExit("Tollgate's Celery worker refuses its quota Redis:\n"
                         + "\n".join(f"  {p}" for p in problems))


@setup_logging.connect
def use_tollgate_logging(loglevel: int | str | None = None, logfile: str | None = None,
                         **kwargs: Any) -> None:
    """Workers and beat log through settings.LOGGING (TOLLGATE_LOG_FORMAT, as the gateway does)
    instead of Celery's own format: a receiver of this signal replaces Celery's set-up. `-l`
    still sets the level and `--logfile` where the lines go."""
    import logging.config

    logging.config.dictConfig(settings.LOGGING)
    root = logging.getLogger()
    if loglevel:
        root.setLevel(loglevel)
    if logfile:
        for handler in list(root.handlers):
            to_file = logging.FileHandler(logfile)
            to_file.setFormatter(handler.formatter)
            root.removeHandler(handler)
            root.addHandler(to_file)


@worker_process_init.connect
def start_tracing(**kwargs: Any) -> None:
    """Each pool process traces on its own (config/telemetry.py: off unless OTEL_* asks), after
    the fork: an exporter thread does not survive one."""
    from config import telemetry

    telemetry.setup(service_name="tollgate-worker")


@worker_process_shutdown.connect
def flush_spans(**kwargs: Any) -> None:
    """A pool process ends without running exit hooks: flush its spans here."""
    from config import telemetry

    telemetry.shutdown()
