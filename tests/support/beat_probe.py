"""Test-only Celery tasks, imported by the workers and beats of tests/billing/test_celery_hosts.py
through TOLLGATE_CELERY_INCLUDE (never by a deployment).

`record_run` is the job of the test's beat schedule (TOLLGATE_BEAT_SCHEDULE_OVERRIDE): each run
appends to the Redis list `beat-probe:<job>` when the beat sent it and which beat process did
(stamped on the message by the beat itself, below), and which worker ran it. `hold` keeps a
worker busy for a while; `mark` records that it ran. All write only `beat-probe:*` keys of the
test's private Redis (REDIS_URL).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import shared_task
from celery.signals import before_task_publish
from django.conf import settings

RECORD_TASK = "tests.support.beat_probe.record_run"
SENT_AT = "beat_probe_sent_at"
SENT_BY = "beat_probe_sent_by"


def runs_key(job: str) -> str:
    return f"beat-probe:{job}"


def events_key() -> str:
    return "beat-probe:events"


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


@before_task_publish.connect
def stamp_sender(sender: str | None = None, headers: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
    """In the process that publishes (the beat): when, and by which process (host:pid, as the
    beat's lock names it: config/beat.py)."""
    if sender == RECORD_TASK and headers is not None:
        headers[SENT_AT] = time.time()
        headers[SENT_BY] = f"{socket.gethostname()}:{os.getpid()}"


@shared_task(bind=True, name=RECORD_TASK)
def record_run(self: Any, job: str) -> None:
    run = {"sent_at": getattr(self.request, SENT_AT, None),
           "sent_by": getattr(self.request, SENT_BY, None),
           "worker": self.request.hostname, "ran_at": time.time()}
    client = _client()
    try:
        client.rpush(runs_key(job), json.dumps(run))
    finally:
        client.close()


@shared_task(name="tests.support.beat_probe.hold")
def hold(label: str, seconds: float) -> None:
    client = _client()
    try:
        client.rpush(events_key(), f"{label}:start")
        time.sleep(seconds)
        client.rpush(events_key(), f"{label}:end")
    finally:
        client.close()


@shared_task(name="tests.support.beat_probe.mark")
def mark(label: str) -> None:
    client = _client()
    try:
        client.rpush(events_key(), f"{label}:done")
    finally:
        client.close()
