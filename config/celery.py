"""The Celery app and its beat schedule (in code, so every deployment runs the same jobs).

    celery -A config worker --beat -l info        # one process: worker and scheduler
    celery -A config worker -l info               # production: workers ...
    celery -A config beat -l info                 # ... and exactly one scheduler

(`make up`, config/serve.py, runs one worker with beat for the `celery` queue and one for
`webhooks`.) A web process that queues tasks (the console's and the API's webhook views) imports
this module, so it publishes with this app's broker and routes.

Every task is idempotent and safe when two workers run it at once (see each task).

Queues: webhook deliveries go to their own queue (`webhooks`), everything else to `celery`, so
slow receivers never delay the sweep, the ledger drain or the alerts. A worker started without
`-Q` consumes both (both are declared in task_queues); a deployment may run dedicated workers:

    celery -A config worker -Q celery -l info      # sweep, drain, alerts, reconciliation
    celery -A config worker -Q webhooks -l info    # webhook deliveries

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
from celery.signals import (
    setup_logging,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from django.conf import settings
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

log = logging.getLogger(__name__)

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["quotas", "billing"])
# The rebuild of lost quota counters lives with the ledger it reads (billing/rebuild.py).
app.autodiscover_tasks(["billing"], related_name="rebuild")

DEFAULT_QUEUE = "celery"
WEBHOOK_QUEUE = "webhooks"
WORKER_QUEUES = (DEFAULT_QUEUE, WEBHOOK_QUEUE)

# Seconds beyond a webhook attempt's total deadline for the task's own database work.
_WEBHOOK_TASK_MARGIN_S = 20


def time_limits() -> dict[str, dict[str, float]]:
    """The tasks whose limits differ from the default: (soft, hard) by task name."""
    webhook_soft = settings.TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS + _WEBHOOK_TASK_MARGIN_S
    reconcile_soft = float(settings.TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS)
    return {
        # One attempt is bounded by its total deadline: the task needs little more.
        "billing.tasks.deliver_webhook": {"soft_time_limit": webhook_soft,
                                          "time_limit": webhook_soft + 10},
        # Pages through the upstream's usage API for every provider key.
        "billing.tasks.reconcile_daily": {"soft_time_limit": reconcile_soft,
                                          "time_limit": reconcile_soft + 60},
    }


app.conf.update(
    task_default_queue=DEFAULT_QUEUE,
    task_queues=tuple(Queue(name, routing_key=name) for name in WORKER_QUEUES),
    task_routes={"billing.tasks.deliver_webhook": {"queue": WEBHOOK_QUEUE}},
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
