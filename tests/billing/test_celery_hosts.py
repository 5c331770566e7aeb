"""Celery across hosts: a worker per queue, and one active beat (celery-redbeat) whatever the number
of hosts running one. Real `celery worker` and `celery beat` processes over a private Redis
(tests/private_redis.py: broker, beat lock and schedule state), with a test-only schedule
(TOLLGATE_BEAT_SCHEDULE_OVERRIDE) of tests/support/beat_probe.py's task, which records when and by
which beat each run was sent (TOLLGATE_CELERY_INCLUDE makes workers and beats import it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from config import serve
from config.beat import parse_lock_holder
from config.celery import (
    DEFAULT_QUEUE,
    LEDGER_QUEUE,
    REPORTS_QUEUE,
    SWEEP_QUEUE,
    TASK_ROUTES,
    WEBHOOK_QUEUE,
    WORKER_QUEUES,
    app,
    with_expiry,
)
from quotas.keys import beat_key_prefix
from tests.gateway.conftest import ROOT, gateway_env
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture
from tests.support.beat_probe import RECORD_TASK, events_key, runs_key

PERIODS = {"probe-2s": 2.0, "probe-3s": 3.0}
LOCK_TIMEOUT_S = 5  # the beats' lock; they try to take it every fifth of that
LOCK_KEY = beat_key_prefix() + ":lock"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


@dataclass
class Processes:
    folder: Path
    env: dict[str, str]
    running: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.folder / f"{name}.log").open("wb")
        process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log,
                                   stderr=subprocess.STDOUT)
        self.running.append(process)
        return process

    def stop(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}"
                         for log in sorted(self.folder.glob("*.log")))


@pytest.fixture
def processes(private_redis: PrivateRedis, tmp_path: Path,  # noqa: F811
              django_db_setup: None) -> Iterator[Processes]:
    """Celery processes over the private Redis; the test-only probe tasks and schedule."""
    schedule = {job: {"task": RECORD_TASK, "every": period, "args": [job]}
                for job, period in PERIODS.items()}
    env = gateway_env(REDIS_URL=private_redis.url,
                      TOLLGATE_CELERY_INCLUDE="tests.support.beat_probe",
                      TOLLGATE_BEAT_SCHEDULE_OVERRIDE=json.dumps(schedule),
                      TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS=str(LOCK_TIMEOUT_S))
    for name in ("CACHE_REDIS_URL", "CELERY_BROKER_URL", "REDBEAT_REDIS_URL"):
        env.pop(name, None)  # all derived from the private REDIS_URL
    running = Processes(tmp_path, env)
    try:
        yield running
    finally:
        running.stop()


def runs(client: Any, job: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(runs_key(job), 0, -1)]


def lock_holder(client: Any) -> int | None:
    value = client.get(LOCK_KEY)
    return parse_lock_holder(value)[1] if value else None


@pytest.mark.slow
def test_three_hosts_run_each_job_once_per_period_and_a_standby_beat_takes_over(
        processes: Processes, private_redis: PrivateRedis) -> None:  # noqa: F811
    client = private_redis.client()
    beats = {}
    for host in (1, 2, 3):
        processes.start(f"worker{host}", [sys.executable, "-m", "celery", "-A", "config", "worker",
                                          "--hostname", f"host{host}@%h", "--concurrency", "1",
                                          "--loglevel", "WARNING"])
        beat = processes.start(f"beat{host}", serve.beat_command())
        beats[beat.pid] = beat

    # Several periods under the first active beat.
    wait_for(lambda: len(runs(client, "probe-2s")) >= 4 and len(runs(client, "probe-3s")) >= 3,
             40, "the first periods of both jobs ran\n" + processes.logs())
    first = lock_holder(client)
    assert first in beats, (first, sorted(beats))
    assert all(beat.poll() is None for beat in beats.values())  # the others wait for the lock

    beats[first].send_signal(signal.SIGKILL)  # no clean release: the lock has to expire
    killed_at = time.time()
    beats[first].wait()
    # A standby takes the lock once it expires (it tries every fifth of its timeout).
    second = wait_for(lambda: (holder := lock_holder(client)) not in (None, first) and holder,
                      LOCK_TIMEOUT_S * 3 + 10, "another beat took the lock\n" + processes.logs())
    assert second in beats and beats[second].poll() is None
    print(f"lock taken over {time.time() - killed_at:.1f} s after the active beat's SIGKILL "
          f"(lock timeout {LOCK_TIMEOUT_S} s)")

    def after_takeover(job: str) -> int:
        return sum(run["sent_by"].endswith(f":{second}") for run in runs(client, job))

    wait_for(lambda: after_takeover("probe-2s") >= 4 and after_takeover("probe-3s") >= 3, 40,
             "the new beat's periods ran\n" + processes.logs())
    processes.stop()

    for job, period in PERIODS.items():
        recorded = sorted(runs(client, job), key=lambda run: run["sent_at"])
        senders = [int(run["sent_by"].rsplit(":", 1)[1]) for run in recorded]
        # Every run came from the lock's holder: the first beat until its death, then the next.
        switch = senders.index(second)
        assert senders == [first] * switch + [second] * (len(senders) - switch), (job, senders)
        assert switch >= 3
        # Each run sent once and run once, by one of the hosts' workers.
        assert len({(run["sent_at"], run["sent_by"]) for run in recorded}) == len(recorded)
        assert {run["worker"].split("@")[0] for run in recorded} <= {"host1", "host2", "host3"}
        gaps = [b["sent_at"] - a["sent_at"] for a, b in zip(recorded, recorded[1:], strict=False)]
        print(f"{job}: {len(recorded)} runs, gaps between sends (s): "
              + " ".join(f"{gap:.2f}" for gap in gaps))
        for index, gap in enumerate(gaps):
            # Never twice in a period (the beat reserves the next run a few ms before it sends:
            # 0.25 s of slack). While a beat is active, never a period without a run either.
            assert gap >= period - 0.25, (job, index, gaps)
            if index != switch - 1:
                assert gap < 2 * period, (job, index, gaps)
        # Across the takeover: the periods missed while the lock expired ran once, at the
        # takeover (the last run in Redis said they were due), then the period resumed.
        assert recorded[switch]["sent_at"] > killed_at
        assert gaps[switch] >= period - 0.25, (job, gaps)


@pytest.mark.slow
def test_a_slow_job_on_one_queue_does_not_delay_another_queues(
        processes: Processes, private_redis: PrivateRedis) -> None:  # noqa: F811
    """The workers `make up` starts for two queues (config/serve.py): a long report (4 s) keeps its
    worker busy, a ledger job sent after it runs at once on its own worker."""
    client = private_redis.client()
    for queue in (REPORTS_QUEUE, LEDGER_QUEUE):
        processes.start(queue, serve.worker_command(queue))
    broker = f"redis+socket://{private_redis.folder / 'redis.sock'}"
    with app.connection_for_write(broker) as connection:
        for n in (1, 2):
            app.send_task("tests.support.beat_probe.hold", args=(f"report{n}", 4.0),
                          queue=REPORTS_QUEUE, connection=connection)
        wait_for(lambda: "report1:start" in client.lrange(events_key(), 0, -1), 40,
                 "the first report started\n" + processes.logs())
        app.send_task("tests.support.beat_probe.mark", args=("drain",), queue=LEDGER_QUEUE,
                      connection=connection)
        wait_for(lambda: "drain:done" in client.lrange(events_key(), 0, -1), 30,
                 "the ledger job ran\n" + processes.logs())
    wait_for(lambda: "report1:end" in client.lrange(events_key(), 0, -1), 30, "report1 ended")
    events = client.lrange(events_key(), 0, -1)
    # The ledger job ran while the report held its queue's only worker, and before the report
    # queued behind it started.
    assert events.index("report1:start") < events.index("drain:done") < events.index("report1:end")
    assert "report2:start" not in events[:events.index("drain:done")]


def test_every_production_task_is_routed_to_its_queue() -> None:
    app.loader.import_default_modules()
    route = app.amqp.router.route
    expected = {
        "billing.tasks.drain_usage": LEDGER_QUEUE,
        "quotas.tasks.sweep_stale_holds": SWEEP_QUEUE,
        "billing.rebuild.rebuild_lost_tenants": SWEEP_QUEUE,
        "billing.tasks.deliver_webhook": WEBHOOK_QUEUE,
        "billing.tasks.retry_due_webhooks": WEBHOOK_QUEUE,
        "billing.tasks.reconcile_daily": REPORTS_QUEUE,
        # On the default queue: the backlog check must run when the ledger queue is stuck.
        "billing.tasks.check_ledger_backlog": DEFAULT_QUEUE,
        "billing.tasks.check_quota_thresholds": DEFAULT_QUEUE,
        "billing.tasks.check_quota_forecasts": DEFAULT_QUEUE,
        "billing.tasks.check_pending_health": DEFAULT_QUEUE,
    }
    for name, queue in expected.items():
        assert name in app.tasks, name
        assert route({}, name)["queue"].name == queue, name
    # Tasks added later: partitions and retention are reports, whatever their module.
    for name in ("billing.tasks.ensure_ledger_partitions", "billing.tasks.apply_ledger_retention",
                 "billing.partitions.drop_old_partitions"):
        assert route({}, name)["queue"].name == REPORTS_QUEUE, name
    ours = {n for n in app.tasks if n.startswith(("billing.", "quotas."))}
    for name in ours - set(expected):
        assert route({}, name)["queue"].name in WORKER_QUEUES, name
    # Every route names a declared queue, and every scheduled job is a task some worker runs.
    assert set(TASK_ROUTES.values()) <= set(WORKER_QUEUES) == set(app.amqp.queues)
    for job, entry in settings.CELERY_BEAT_SCHEDULE.items():
        assert entry["task"] in app.tasks, job



def test_every_periodic_message_expires_after_its_period_or_the_floor(settings: Any) -> None:
    """A queue whose workers were down must not replay every missed period when they return
    (an hour of the 5 s drain is 720 messages): each message the beat sends expires a period
    after it was sent, never sooner than TOLLGATE_BEAT_EXPIRY_MIN_SECONDS (workers judge it by
    their own clocks). The options are on the entries the beat is given (RedBeat stores an
    entry's options and Celery's beat passes them to apply_async: not exercised here)."""
    from datetime import timedelta

    from celery.beat import ScheduleEntry
    from celery.schedules import crontab, schedule

    assert app.conf.beat_schedule == with_expiry(settings.CELERY_BEAT_SCHEDULE)
    for job, entry in app.conf.beat_schedule.items():
        every = entry["schedule"]
        period = every if isinstance(every, float) else 86_400.0
        assert entry["options"]["expires"] == max(period, 300.0), job
        assert ScheduleEntry(name=job, app=app, **{k: v for k, v in entry.items()
                                                   if k != "name"}).options["expires"] > 0
    assert app.conf.beat_schedule["drain-usage-ledger"]["options"] == {"expires": 300.0}
    assert app.conf.beat_schedule["reconcile-daily"]["options"] == {"expires": 86_400.0}
    settings.TOLLGATE_BEAT_EXPIRY_MIN_SECONDS = 1
    assert with_expiry({
        "fast": {"task": "t", "schedule": 5.0},
        "every": {"task": "t", "schedule": schedule(run_every=120)},
        "delta": {"task": "t", "schedule": timedelta(minutes=10)},
        "daily": {"task": "t", "schedule": crontab(hour=2, minute=15)},
        "own": {"task": "t", "schedule": 5.0, "options": {"expires": 2, "queue": "q"}},
    }) == {
        "fast": {"task": "t", "schedule": 5.0, "options": {"expires": 5.0}},
        "every": {"task": "t", "schedule": schedule(run_every=120), "options": {"expires": 120.0}},
        "delta": {"task": "t", "schedule": timedelta(minutes=10), "options": {"expires": 600.0}},
        "daily": {"task": "t", "schedule": crontab(hour=2, minute=15),
                  "options": {"expires": 86_400.0}},
        "own": {"task": "t", "schedule": 5.0, "options": {"expires": 2, "queue": "q"}},
    }

def test_config_serve_runs_a_worker_per_queue_and_a_beat_unless_told_not_to() -> None:
    commands = serve.celery_commands()
    workers, beats = commands[:-1], commands[-1:]
    assert [c[c.index("--queues") + 1] for c in workers] == list(WORKER_QUEUES)
    assert all("--beat" not in c for c in commands)  # never embedded: one beat process
    assert [c[c.index("config") + 1] for c in beats] == ["beat"]
    assert serve.celery_commands(beat=False) == workers
    # The production beat is RedBeat's, with the lock naming its holder (config/beat.py).
    assert app.conf.beat_scheduler == "config.beat:TollgateBeatScheduler"
    assert app.conf.redbeat_lock_timeout == settings.TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS
    # The active beat renews its lock at least every fifth of its timeout.
    assert app.conf.beat_max_loop_interval * 5 == settings.TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS
    assert os.path.basename(sys.executable) in {os.path.basename(c[0]) for c in commands}


@dataclass(frozen=True)
class Sentinel:
    master_port: int
    sentinel_port: int
    master_name: str = "tollgate"

    def master(self) -> Any:
        import redis

        return redis.Redis(port=self.master_port, decode_responses=True)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[Sentinel]:
    """A Redis master and one Sentinel monitoring it, on loopback ports of their own."""
    from config.embedded import free_port, redis_server_binary

    found = Sentinel(free_port(), free_port())
    folder = tmp_path / "sentinel"
    folder.mkdir()
    (folder / "sentinel.conf").write_text(
        f"port {found.sentinel_port}\nbind 127.0.0.1\n"
        f"sentinel monitor {found.master_name} 127.0.0.1 {found.master_port} 1\n")
    servers = [
        subprocess.Popen([redis_server_binary(), "--port", str(found.master_port), "--bind",
                          "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]),
        subprocess.Popen([redis_server_binary(), str(folder / "sentinel.conf"), "--sentinel",
                          "--dir", str(folder)])]
    try:
        import redis

        asking = redis.Redis(port=found.sentinel_port, decode_responses=True)
        wait_for(lambda: _master_addr(asking, found.master_name), 20, "the sentinel is up")
        yield found
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


def _master_addr(client: Any, name: str) -> Any:
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", name)
    except RedisConnectionError:  # not listening yet
        return None


@pytest.mark.slow
def test_broker_and_beat_through_redis_sentinel(
        processes: Processes, private_redis: PrivateRedis,  # noqa: F811
        sentinel: Sentinel) -> None:
    """CELERY_BROKER_URL=sentinel://... with TOLLGATE_BROKER_SENTINEL_MASTER: the worker and the
    beat find the master through the Sentinel (kombu's transport, RedBeat's sentinel client);
    the queues, the beat's lock and its schedule are on that master."""
    processes.env.update(CELERY_BROKER_URL=f"sentinel://127.0.0.1:{sentinel.sentinel_port}",
                         TOLLGATE_BROKER_SENTINEL_MASTER=sentinel.master_name)
    processes.start("worker", [sys.executable, "-m", "celery", "-A", "config", "worker",
                               "--concurrency", "1", "--loglevel", "WARNING"])
    beat = processes.start("beat", serve.beat_command())
    client = private_redis.client()  # the quota Redis, where the probe records its runs
    wait_for(lambda: len(runs(client, "probe-2s")) >= 2, 40,
             "the job ran through the sentinel's master\n" + processes.logs())
    master = sentinel.master()
    assert lock_holder(master) == beat.pid
    assert master.exists(beat_key_prefix() + "probe-2s", beat_key_prefix() + ":schedule") == 2
    assert master.exists("_kombu.binding." + DEFAULT_QUEUE)  # kombu's routing table for it
    assert client.get(LOCK_KEY) is None  # nothing of the beat's on the quota Redis


def settings_of(env: dict[str, str], expression: str) -> subprocess.CompletedProcess[str]:
    script = f"import config.settings as s; print({expression})"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("env", "message"), [
    ({"CELERY_BROKER_URL": "kafka://broker:9092"}, "CELERY_BROKER_URL must be"),
    ({"CELERY_BROKER_URL": "sentinel://s1:26379"}, "set TOLLGATE_BROKER_SENTINEL_MASTER"),
    ({"CELERY_BROKER_URL": "amqp://guest@rabbit//"}, "set REDBEAT_REDIS_URL"),
    ({"REDBEAT_REDIS_URL": "redis-sentinel://s1"}, "REDBEAT_REDIS_URL must be"),
    ({"TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS": "0"}, "TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS must be"),
    ({"TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS": "7200"}, "TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS must be"),
    ({"TOLLGATE_CELERY_INCLUDE": "tests/support/beat_probe.py"}, "is not a module name"),
    ({"TOLLGATE_BEAT_SCHEDULE_OVERRIDE": "{not json"}, "is not JSON"),
    ({"TOLLGATE_BEAT_SCHEDULE_OVERRIDE": '{"a": {"task": "x", "every": 0}}'}, "must be {"),
    ({"TOLLGATE_BEAT_SCHEDULE_OVERRIDE": '{"a": {"task": "x", "every": 1, "cron": 2}}'},
     "must be {"),
])
def test_broker_and_beat_settings_fail_loudly(env: dict[str, str], message: str) -> None:
    result = settings_of(env, "s.CELERY_BROKER_URL")
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-800:]


def test_the_beat_follows_the_brokers_redis_or_its_own() -> None:
    expression = "(s.CELERY_BROKER_TRANSPORT_OPTIONS, s.REDBEAT_REDIS_URL, s.REDBEAT_REDIS_OPTIONS)"
    sentinel = settings_of({"CELERY_BROKER_URL": "sentinel://:pw@s1:26379/2;sentinel://s2:26380",
                            "TOLLGATE_BROKER_SENTINEL_MASTER": "tollgate"}, expression)
    assert sentinel.returncode == 0, sentinel.stderr[-800:]
    assert sentinel.stdout.strip() == str((
        {"master_name": "tollgate"}, "redis-sentinel://",
        {"sentinels": [("s1", 26379), ("s2", 26380)], "service_name": "tollgate", "db": 2,
         "password": "pw", "retry_period": 30, "socket_timeout": 2.0}))
    rabbit = settings_of({"CELERY_BROKER_URL": "amqp://guest@rabbit//",
                          "REDBEAT_REDIS_URL": "redis://beat-redis:6379/3"}, expression)
    assert rabbit.returncode == 0, rabbit.stderr[-800:]
    assert rabbit.stdout.strip() == str(
        ({}, "redis://beat-redis:6379/3", {"retry_period": 30, "socket_timeout": 2.0}))
    socket = settings_of({"CELERY_BROKER_URL": "redis+socket:///run/redis.sock"},
                         "s.REDBEAT_REDIS_URL")
    assert socket.stdout.strip() == "unix:///run/redis.sock?db=0"
