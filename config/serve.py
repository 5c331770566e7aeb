"""Serve Tollgate in the foreground: the gateway under uvicorn (several worker processes), a
Celery worker per queue (config/celery.py), a Celery beat (celery-redbeat: every host may run
one, a lock in Redis makes one active; `--no-beat` leaves it out) and, for a first local run,
the mock upstream the gateway forwards to. Ctrl-C stops them all.

    python -m config.serve [--port 8000] [--workers 2] [--mock-port 8099 | --no-mock]
                           [--no-celery | --no-beat]

`make up` runs this after starting the embedded services, migrating and creating the demo data.
It refuses to start on a quota Redis that may evict or lose counters (quotas/durability.py).

Request metrics: the gateway workers and the Celery processes share one prometheus_client
multiprocess directory (PROMETHEUS_MULTIPROC_DIR: the variable's value if set, else
`<data dir>/prometheus`), emptied here at start, so /metrics, served by any worker, adds up
every process's figures (gateway/metrics.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from config.embedded import data_dir

ROOT = Path(__file__).resolve().parent.parent


def _wait_for(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with status {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not come up at {url}")


def _refuse_unsafe_quota_store() -> None:
    """Stop before starting anything when the quota Redis may evict or lose counters
    (quotas/durability.py); each gateway worker and the Celery worker would refuse it too, one
    by one and less visibly."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from redis.exceptions import RedisError

    from quotas.client import make_redis
    from quotas.durability import check

    client = make_redis()
    try:
        problems = check(client)
    except (RedisError, OSError) as exc:  # ResponseError is handled inside the check
        print(f"warning: cannot read the quota Redis's configuration ({exc}); the gateway's "
              "/readyz keeps checking it", file=sys.stderr, flush=True)
        return
    finally:
        client.close()
    if problems:
        raise SystemExit("Tollgate refuses to start on this quota Redis:\n"
                         + "\n".join(f"  {p}" for p in problems))


def metrics_dir() -> Path:
    """The multiprocess directory of this run, emptied: files of a previous run's processes
    would add their counts to this one's (and a dead process's counters must stay only while
    the run that made them lasts)."""
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or data_dir() / "prometheus")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return path


def worker_command(queue: str) -> list[str]:
    """A Celery worker for one queue (config/celery.py WORKER_QUEUES): one process, but two for
    webhook deliveries, where a receiver may take a whole deadline."""
    from config.celery import WEBHOOK_QUEUE  # imported late: it loads the settings

    return [sys.executable, "-m", "celery", "-A", "config", "worker", "--queues", queue,
            "--hostname", f"{queue}@%h", "--concurrency", "2" if queue == WEBHOOK_QUEUE else "1",
            "--loglevel", "WARNING"]


def beat_command() -> list[str]:
    """The beat (celery-redbeat, config/beat.py): every host may run one, the lock in Redis
    makes one of them active."""
    return [sys.executable, "-m", "celery", "-A", "config", "beat", "--loglevel", "WARNING"]


def celery_commands(*, beat: bool = True) -> list[list[str]]:
    """A worker per queue, so a slow job (a report, a tarpitting webhook receiver) never takes
    the slot of the ledger drain or the sweep, and, unless `beat` is off, a beat."""
    from config.celery import WORKER_QUEUES

    commands = [worker_command(queue) for queue in WORKER_QUEUES]
    return commands + [beat_command()] if beat else commands


def gateway_command(host: str, port: int, workers: int) -> list[str]:
    """The gateway under uvicorn, as production runs it (README, "Many gateway hosts")."""
    from django.conf import settings

    return [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", host,
            "--port", str(port), "--workers", str(workers), "--loop", "uvloop",
            "--http", "httptools", "--no-access-log",
            # Tollgate applies TOLLGATE_TRUSTED_PROXIES itself (gateway/client_address.py);
            # uvicorn's own X-Forwarded-For rule (it trusts loopback) would be a second one.
            "--no-proxy-headers",
            # Told to stop, a worker lets its calls in flight finish for this long.
            "--timeout-graceful-shutdown", str(settings.GATEWAY_SHUTDOWN_DRAIN_SECONDS)]


def gateway_stop_seconds() -> int:
    """How long a stopping gateway may take: its calls' drain, then their detached ends (each
    bounded by GATEWAY_SHUTDOWN_DRAIN_SECONDS), and some for the flushes."""
    from django.conf import settings

    return 2 * settings.GATEWAY_SHUTDOWN_DRAIN_SECONDS + 15


def _interrupt(signum: int, frame: object) -> None:
    """`kill` (SIGTERM) must stop the children too, not orphan them: the Ctrl-C cleanup."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=int(os.environ.get("GATEWAY_WORKERS", "2")))
    parser.add_argument("--mock-port", type=int, default=8099)
    parser.add_argument("--no-mock", action="store_true", help="do not start the mock upstream")
    parser.add_argument("--no-celery", action="store_true",
                        help="do not start the Celery workers (and beat)")
    parser.add_argument("--no-beat", action="store_true",
                        help="start the Celery workers without a beat (another host runs one)")
    args = parser.parse_args(argv)
    _refuse_unsafe_quota_store()

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir())}
    children: list[subprocess.Popen[bytes]] = []
    gateway: subprocess.Popen[bytes] | None = None
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not args.no_mock:
            mock = subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port",
                                     str(args.mock_port)], cwd=ROOT, env=env)
            children.append(mock)
            _wait_for(f"http://127.0.0.1:{args.mock_port}/v1/models", mock, "the mock upstream")
        if not args.no_celery:
            for command in celery_commands(beat=not args.no_beat):
                children.append(subprocess.Popen(command, cwd=ROOT, env=env))
        gateway = subprocess.Popen(gateway_command(args.host, args.port, args.workers),
                                   cwd=ROOT, env=env)
        children.append(gateway)
        _wait_for(f"http://{args.host}:{args.port}/healthz", gateway, "the gateway")
        print(f"Tollgate is up: http://{args.host}:{args.port}/v1 (admin: /admin/). Ctrl-C stops.",
              flush=True)
        gateway.wait()
        return gateway.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        for child in reversed(children):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
        for child in children:
            try:
                # The gateway finishes its calls in flight first (gateway/shutdown.py).
                child.wait(timeout=gateway_stop_seconds() if child is gateway else 15)
            except subprocess.TimeoutExpired:
                child.kill()


if __name__ == "__main__":
    sys.exit(main())
