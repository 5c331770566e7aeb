"""The beat's scheduler: celery-redbeat's, whose lock names the beat holding it.

    celery -A config beat -l info        # on every host, or on one (config/celery.py sets it)

RedBeat keeps the schedule (each job's definition and last run) in Redis under
quotas.keys.beat_key_prefix(), and a lock: a beat takes it at start (blocking until it can), renews
it at every tick (CELERY_BEAT_MAX_LOOP_INTERVAL apart at most) and sends jobs only while it holds
it. A beat killed without releasing it (SIGKILL, a lost host) leaves it to expire
TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS after its last renewal; a waiting beat then takes it within
CELERY_BEAT_MAX_LOOP_INTERVAL and sends what fell due in the meantime once (the last run in
Redis says how long ago each job ran). A beat stopped cleanly (SIGTERM, Ctrl-C) releases it.

The lock's value is `<host>:<pid>:<nonce>` instead of RedBeat's bare random token, so an operator
(`GET tg:beat::lock`) and the tests see which beat is active. The nonce keeps it unique, as the
lock's ownership check needs: a restarted process on a reused pid must not pass for its previous
self.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from celery.signals import beat_init
from redbeat import RedBeatScheduler
from redbeat.schedulers import LUA_EXTEND_TO_SCRIPT, acquire_distributed_beat_lock, get_redis


class TollgateBeatScheduler(RedBeatScheduler):
    """RedBeat's scheduler; the lock is taken by acquire_named_lock below."""


def lock_holder_token() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def parse_lock_holder(value: str) -> tuple[str, int]:
    """(host, pid) of the beat holding the lock, from the lock's value."""
    host, pid, _nonce = value.rsplit(":", 2)
    return host, int(pid)


# RedBeat's own receiver takes the lock with a random token; this one replaces it (same lock,
# same renewal script), naming the holder.
beat_init.disconnect(acquire_distributed_beat_lock)


@beat_init.connect
def acquire_named_lock(sender: Any = None, **kwargs: Any) -> None:
    scheduler = sender.scheduler
    if not scheduler.lock_key:
        return
    client = get_redis(scheduler.app)
    lock = client.lock(scheduler.lock_key, timeout=scheduler.lock_timeout,
                       sleep=scheduler.max_interval)
    # RedBeat's renewal sets the expiry to a full timeout (redis-py's would add to what is left).
    lock.lua_extend = client.register_script(LUA_EXTEND_TO_SCRIPT)
    lock.acquire(token=lock_holder_token())
    scheduler.lock = lock
