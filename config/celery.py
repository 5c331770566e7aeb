"""The Celery app and its beat schedule (in code, so every deployment runs the same jobs).

    celery -A config worker --beat -l info        # one process: worker and scheduler (make up)
    celery -A config worker -l info               # production: workers ...
    celery -A config beat -l info                 # ... and exactly one scheduler

Every task is idempotent and safe when two workers run it at once (see each task).

A worker refuses to start on a quota Redis that may evict or lose counters (quotas/durability.py):
its sweeps and ledger drain would work on counters that can vanish.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

log = logging.getLogger(__name__)

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["quotas", "billing"])
# The rebuild of lost quota counters lives with the ledger it reads (billing/rebuild.py).
app.autodiscover_tasks(["billing"], related_name="rebuild")


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
