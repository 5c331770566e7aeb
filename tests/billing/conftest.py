"""Shared by the billing tests that need a real Celery worker with beat."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.gateway.conftest import ROOT


@contextlib.contextmanager
def celery_worker_process(tmp_path: Path, env: dict[str, str]) -> Iterator[Path]:
    """A `celery worker --beat` over the test session's services; yields its log file. The beat
    is RedBeat's (config/beat.py), its lock in the session's Redis: a short lock timeout, so a
    worker of an earlier test killed without releasing it delays this one's beat by 5 s only."""
    env = {"TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS": "5", **env}
    log = tmp_path / "celery.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--beat", "--concurrency", "2",
         "--loglevel", "INFO", "--schedule", str(tmp_path / "beat-schedule")],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
