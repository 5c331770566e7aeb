"""Racing forecast checkers (billing/forecast_alerts.py) over the session's Redis and PostgreSQL:
a tenant whose three limited scopes (its day, a project's day, a key's cycle) are forecast past
the threshold, checked by many detectors at once. Exactly one ForecastAlert row, one webhook
delivery per subscribed endpoint and one owners' email per scope per window, whatever the number
of detectors and runs; a new window warns again, once.

- threads at a fixed instant (an engine whose clock stands still, as in test_forecast_alerts),
  over a synthetic ledger history: free-for-all rounds, then the next day;
- a detector frozen with its inserts in flight (its transaction held open): the others wait on
  its rows at the unique index and fire nothing once it commits: the race the constraint is
  for, made certain;
- OS processes running the beat's task function (billing.tasks.check_quota_forecasts) on the
  live clock, mails to files, the deliveries then sent to a receiver.

The tenants are committed (the detectors run on connections of their own), each with a slug of
its own, like the other end-to-end tests.
"""
from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.core import mail
from django.db import connection, transaction

from billing.forecast_alerts import ForecastWarning, check_forecasts
from billing.models import ForecastAlert, WebhookDelivery
from billing.webhooks import create_endpoint, deliver
from quotas import keys
from quotas.cycles import calendar_for, schedule_for
from quotas.engine import ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.test_forecast_alerts import NOON, PARIS, add_person, at, burn, counter
from tests.gateway.conftest import ROOT, committed, gateway_env, wait_until
from tests.support.webhook_receiver import Receiver

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]

DETECTORS = 8
DAY, MONTH = WindowKind.DAY, WindowKind.MONTH
HOUR_MS = 3_600_000


@dataclass(frozen=True)
class Racer:
    """The committed tenant of a race: its ids, its scopes and who hears of its warnings."""

    tenant_id: int
    slug: str
    web_scope: str
    key_scope: str
    owner: str  # the owner's address; a member is there too, and is never mailed
    forecast_hooks: tuple[int, ...]  # endpoints subscribed to quota.forecast
    other_hook: int  # an endpoint subscribed to quota.threshold only

    def named(self, scope: str) -> str:
        """A scope as the webhook payload names it (the threshold alerts' way)."""
        return {"tenant": "tenant", self.web_scope: "project:web", self.key_scope: "key:ci"}[scope]


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def make_racer(slug: str, hook_url: str, zone: str) -> Racer:
    """A standard-plan tenant in `zone`: 10,000 tokens a day; project web 4,000 a day; web's key
    ci 50,000 a cycle (the calendar month); project batch unlimited."""
    tenant = create_tenant(slug, plan_name="standard", actor="test", tokens_per_day=10_000)
    # A fresh tenant in its own time zone (no window to finish on the old zone yet).
    Tenant.objects.filter(pk=tenant.pk).update(time_zone=zone)
    tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
    web = create_project(tenant, "web", actor="test", tokens_per_day=4_000)
    create_project(tenant, "batch", actor="test")
    key = issue_key(web, actor="test", name="ci", tokens_per_month=50_000).api_key
    add_person(tenant, f"{slug}-olga")
    add_person(tenant, f"{slug}-mike", role="member")
    hooks = tuple(create_endpoint(tenant, hook_url, ["quota.forecast"], actor="t")[0].pk
                  for _ in range(2))
    other = create_endpoint(tenant, hook_url, ["quota.threshold"], actor="t")[0].pk
    return Racer(tenant.pk, slug, keys.project_scope(web.pk), keys.api_key_scope(key.pk),
                 f"{slug}-olga@{slug}.test", hooks, other)


def history(racer: Racer, until: datetime) -> None:
    """The three hours before `until`: batch at 300 tokens an hour, web's key at 100 (the
    tenant at 400)."""
    tenant = Tenant.objects.get(pk=racer.tenant_id)
    web = tenant.projects.get(slug="web")
    batch = tenant.projects.get(slug="batch")
    burn(tenant, until - timedelta(hours=3), 3, 300, every=3, project=batch)
    burn(tenant, until - timedelta(hours=3), 3, 100, every=1, project=web,
         api_key=web.api_keys.get())


def on_threads(django_db_blocker: Any, work: Any, count: int) -> list[Any]:
    """`work(i)` on `count` threads at once, each on a database connection of its own."""
    start = threading.Barrier(count)

    def run(i: int) -> Any:
        try:
            start.wait()
            return work(i)
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def alerts(django_db_blocker: Any, racer: Racer) -> list[tuple[Any, ...]]:
    return committed(django_db_blocker, lambda: list(
        ForecastAlert.objects.filter(tenant_id=racer.tenant_id).values_list(
            "scope", "window", "threshold", "limit", "used", "forecast", "method")))


def deliveries(django_db_blocker: Any, racer: Racer) -> Counter[tuple[int, str, str]]:
    """How many deliveries each (endpoint, scope, window) has."""
    return Counter(committed(django_db_blocker, lambda: [
        (endpoint, payload["scope"], payload["window"])
        for endpoint, payload in WebhookDelivery.objects.filter(
            endpoint__tenant_id=racer.tenant_id).values_list("endpoint_id", "payload")]))


def send_all(django_db_blocker: Any, racer: Racer) -> None:
    def run() -> None:
        for pk in WebhookDelivery.objects.filter(endpoint__tenant_id=racer.tenant_id) \
                .values_list("pk", flat=True):
            assert deliver(pk).status == WebhookDelivery.Status.DELIVERED

    committed(django_db_blocker, run)


def received(receiver: Receiver) -> Counter[tuple[str, str, str]]:
    return Counter((json.loads(r["body"])["type"], json.loads(r["body"])["scope"],
                    json.loads(r["body"])["window"]) for r in receiver.requests)


def fired_keys(warnings: list[ForecastWarning]) -> Counter[tuple[str, str]]:
    return Counter((w.scope.scope, w.scope.forecast.window.id) for w in warnings)


def test_racing_detectors_warn_once_per_scope_per_window_and_once_more_in_the_next(
        settings: Any, django_db_blocker: Any) -> None:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    slug = unique("fc-race")
    with Receiver() as receiver:
        racer = committed(django_db_blocker, lambda: make_racer(slug, receiver.url, PARIS))
        committed(django_db_blocker, lambda: history(racer, NOON))
        # 13:00 in Paris, 11 hours left of the day, 731 of the month (to 2026-12-31 23:00 UTC).
        counter_of = Tenant(pk=racer.tenant_id)
        counter(counter_of, "tenant", "d2026-12-01", limit=10_000, used=5_500, pending=500)
        counter(counter_of, racer.web_scope, "d2026-12-01", limit=4_000, used=3_000)
        counter(counter_of, racer.key_scope, "m2026-12", limit=50_000, used=40_000)

        def rounds(moment: datetime, count: int) -> Any:
            """Each detector runs `count` checks, all detectors at once in each round."""
            step = threading.Barrier(DETECTORS)

            def work(_: int) -> list[list[ForecastWarning]]:
                done = []
                for _ in range(count):
                    step.wait()
                    done.append(check_forecasts([racer.tenant_id], engine=at(moment)))
                return done

            return on_threads(django_db_blocker, work, DETECTORS)

        first = rounds(NOON, 4)
        # Every warning in the first round (the others found the rows), each once.
        assert [sum(len(runs[r]) for runs in first) for r in range(4)] == [3, 0, 0, 0]
        today = {("tenant", "d2026-12-01"), (racer.web_scope, "d2026-12-01"),
                 (racer.key_scope, "m2026-12")}
        assert fired_keys([w for runs in first for run in runs for w in run]) == Counter(today)
        assert sorted(alerts(django_db_blocker, racer)) == sorted([
            ("tenant", "d2026-12-01", 80, 10_000, 6_000, 10_400, "trailing_rate"),
            (racer.web_scope, "d2026-12-01", 80, 4_000, 3_000, 4_100, "trailing_rate"),
            (racer.key_scope, "m2026-12", 80, 50_000, 40_000, 40_000 + 731 * 100,
             "trailing_rate")])
        assert deliveries(django_db_blocker, racer) == Counter(
            {(hook, racer.named(scope), window): 1 for hook in racer.forecast_hooks
             for scope, window in today})
        mails = [m for m in mail.outbox if m.to == [racer.owner]]
        assert len(mails) == 3 and len(mail.outbox) == len(mails)  # the member is never mailed
        assert sorted(m.subject.split(": ", 1)[1] for m in mails) == sorted([
            "the daily token quota is forecast to reach 104% by the end of its window",
            "the daily token quota of project:web is forecast to reach 102.5% by the end of "
            "its window",
            "the cycle token quota of key:ci is forecast to reach 226.2% by the end of its "
            "window"])

        # The next day: a new day window for the tenant and the project (one more each); the
        # key's cycle is the same month, already warned: nothing more for it.
        tomorrow = NOON + timedelta(days=1)
        committed(django_db_blocker, lambda: history(racer, tomorrow))
        counter(counter_of, "tenant", "d2026-12-02", limit=10_000, used=7_000)
        counter(counter_of, racer.web_scope, "d2026-12-02", limit=4_000, used=3_000)
        second = rounds(tomorrow, 3)
        assert [sum(len(runs[r]) for runs in second) for r in range(3)] == [2, 0, 0]
        tomorrow_keys = {("tenant", "d2026-12-02"), (racer.web_scope, "d2026-12-02")}
        assert fired_keys([w for runs in second for run in runs for w in run]) == Counter(
            tomorrow_keys)
        assert sorted(row[:2] for row in alerts(django_db_blocker, racer)) == sorted(
            today | tomorrow_keys)
        assert deliveries(django_db_blocker, racer) == Counter(
            {(hook, racer.named(scope), window): 1 for hook in racer.forecast_hooks
             for scope, window in today | tomorrow_keys})
        assert len([m for m in mail.outbox if m.to == [racer.owner]]) == 5 == len(mail.outbox)

        # Sent: one request per subscribed endpoint per warning, none to the other endpoint.
        send_all(django_db_blocker, racer)
        assert received(receiver) == Counter(
            {("quota.forecast", racer.named(scope), window): 2
             for scope, window in today | tomorrow_keys})


def test_detectors_racing_an_insert_in_flight_wait_for_it_and_fire_nothing(
        settings: Any, django_db_blocker: Any) -> None:
    """One detector's inserts are in flight (its transaction held open after it fired); seven
    more run meanwhile: not seeing its rows, they insert too and wait on them at the unique
    index; when it commits, their inserts do nothing. One row, two deliveries, one mail per
    scope: the holder's."""
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    slug = unique("fc-held")
    racer = committed(django_db_blocker,
                      lambda: make_racer(slug, "http://127.0.0.1:9/hook", PARIS))
    committed(django_db_blocker, lambda: history(racer, NOON))
    counter_of = Tenant(pk=racer.tenant_id)
    counter(counter_of, "tenant", "d2026-12-01", limit=10_000, used=5_500, pending=500)
    counter(counter_of, racer.web_scope, "d2026-12-01", limit=4_000, used=3_000)
    counter(counter_of, racer.key_scope, "m2026-12", limit=50_000, used=40_000)
    fired_in_flight = threading.Event()
    commit = threading.Event()
    database = settings.DATABASES["default"]["NAME"]

    def holder() -> list[ForecastWarning]:
        try:
            with transaction.atomic():
                warnings = check_forecasts([racer.tenant_id], engine=at(NOON))
                fired_in_flight.set()
                assert commit.wait(60)
            return warnings
        finally:
            connection.close()

    def detector() -> list[ForecastWarning]:
        try:
            return check_forecasts([racer.tenant_id], engine=at(NOON))
        finally:
            connection.close()

    def waiting() -> int:
        """Backends of the test database waiting on a lock (a fresh connection each time:
        pg_stat_activity is a snapshot per transaction)."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                           "wait_event_type = 'Lock'", [database])
            return cursor.fetchone()[0]

    with django_db_blocker.unblock(), ThreadPoolExecutor(DETECTORS) as pool:
        held = pool.submit(holder)
        assert fired_in_flight.wait(60)
        others = [pool.submit(detector) for _ in range(DETECTORS - 1)]
        try:
            assert wait_until(lambda: committed(django_db_blocker, waiting) == DETECTORS - 1,
                              timeout=60)
            assert not any(f.done() for f in others)
        finally:
            commit.set()
        warnings = held.result(timeout=60)
        assert [f.result(timeout=60) for f in others] == [[]] * (DETECTORS - 1)

    assert fired_keys(warnings) == Counter({("tenant", "d2026-12-01"): 1,
                                            (racer.web_scope, "d2026-12-01"): 1,
                                            (racer.key_scope, "m2026-12"): 1})
    assert len(alerts(django_db_blocker, racer)) == 3
    assert deliveries(django_db_blocker, racer) == Counter(
        {(hook, racer.named(scope), window): 1 for hook in racer.forecast_hooks
         for scope, window in fired_keys(warnings)})
    assert [m.to for m in mail.outbox] == [[racer.owner]] * 3


# -- OS processes running the beat's task ----------------------------------------------------------

WORKER_SETTINGS = """
from config.settings import *  # noqa: F403

EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
EMAIL_FILE_PATH = {mail_dir!r}
# The deliveries the task queues stay in the process (the test sends them after).
CELERY_BROKER_URL = "memory://"
"""
PROCESSES = 4
RUNS = 3


def far_from_midnight() -> str:
    """A zone whose day (and month) does not end within ten minutes: the live windows stay."""
    now = datetime.now(UTC)
    for zone in ("Europe/Paris", "Asia/Tokyo", "America/New_York", "Asia/Kolkata"):
        local = now.astimezone(ZoneInfo(zone))
        since = local - local.replace(hour=0, minute=0, second=0, microsecond=0)
        if timedelta(minutes=10) < since < timedelta(hours=23, minutes=50):
            return zone
    raise AssertionError("no zone far from midnight")


def mails_in(directory: Path) -> list[email.message.Message]:
    """The messages the file backend wrote (each followed by a line of 79 dashes)."""
    found = []
    for path in sorted(directory.glob("*")):
        for part in path.read_text().split("\n" + "-" * 79 + "\n"):
            if part.strip():
                found.append(email.message_from_string(part))
    return found


def test_beat_task_racing_in_several_processes_warns_once_per_scope(
        settings: Any, django_db_blocker: Any, tmp_path: Path) -> None:
    """The beat's task function in 4 OS processes at once, 3 runs each, on the live clock (the
    tenant's scopes at 90 % of their limits, with a trailing history): one row, one delivery
    per endpoint and one mail per scope."""
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True
    slug = unique("fc-procs")
    mail_dir = tmp_path / "mail"
    mail_dir.mkdir()
    (tmp_path / "tg_forecast_race_settings.py").write_text(
        WORKER_SETTINGS.format(mail_dir=str(mail_dir)))
    with Receiver() as receiver:
        racer = committed(django_db_blocker,
                          lambda: make_racer(slug, receiver.url, far_from_midnight()))
        committed(django_db_blocker, lambda: history(racer, datetime.now(UTC)))
        tenant = committed(django_db_blocker, lambda: Tenant.objects.select_related("plan")
                           .get(pk=racer.tenant_id))
        engine = get_engine()
        tag, schedule = tenant_tag(tenant.pk), schedule_for(tenant)
        spend = ((3_600, (ScopeLimit("tenant", DAY, 10_000),
                          ScopeLimit(racer.web_scope, DAY, 4_000),
                          ScopeLimit(racer.key_scope, MONTH, 50_000))),
                 (5_400, (ScopeLimit("tenant", DAY, 10_000),)),
                 (41_400, (ScopeLimit(racer.key_scope, MONTH, 50_000),)))
        for i, (tokens, limits) in enumerate(spend):
            hold = engine.reserve(ReserveRequest(tag, f"spend-{i}", tokens, limits,
                                                 schedule=schedule)).hold
            assert hold is not None
            engine.settle(hold, tokens)
        calendar = calendar_for(tenant)
        engine.current_window(DAY, schedule)  # learns the Redis clock
        now_ms = engine.clock.now_ms()
        day, cycle = calendar.window(DAY, now_ms).id, calendar.window(MONTH, now_ms).id
        expected = {("tenant", day), (racer.web_scope, day), (racer.key_scope, cycle)}

        env = gateway_env(DJANGO_SETTINGS_MODULE="tg_forecast_race_settings",
                          PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
        code = ("import json, sys, django\n"
                "django.setup()\n"
                "from billing.tasks import check_quota_forecasts\n"
                "print('ready', flush=True)\n"
                "sys.stdin.readline()\n"
                f"print(json.dumps([check_quota_forecasts() for _ in range({RUNS})]), "
                "flush=True)\n")
        workers = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
                   for _ in range(PROCESSES)]
        try:
            for process in workers:
                line = process.stdout.readline()
                assert line == "ready\n", (line, process.stderr.read())
            for process in workers:  # go, all at once
                process.stdin.write("go\n")
                process.stdin.flush()
            outputs = [process.communicate(timeout=120) for process in workers]
        finally:
            for process in workers:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        assert [p.returncode for p in workers] == [0] * PROCESSES, [o[1][-2000:] for o in outputs]
        # Each run's count covers every tenant of the database; ours are the rows below.
        counts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
        assert all(len(c) == RUNS for c in counts), counts
        assert sum(map(sum, counts)) >= 3, counts  # at least our three (others' are theirs)

        rows = alerts(django_db_blocker, racer)
        assert {(scope, window) for scope, window, *_ in rows} == expected and len(rows) == 3
        assert all(threshold == 80 and forecast * 100 >= 80 * limit and used < limit
                   for _, _, threshold, limit, used, forecast, _ in rows), rows
        assert deliveries(django_db_blocker, racer) == Counter(
            {(hook, racer.named(scope), window): 1 for hook in racer.forecast_hooks
             for scope, window in expected})
        ours = [m for m in mails_in(mail_dir) if m["To"] == racer.owner]
        assert len(ours) == 3, [m["Subject"] for m in ours]
        assert all(slug in m["Subject"] for m in ours)
        assert not [m for m in mails_in(mail_dir) if slug in (m["To"] or "")
                    and m["To"] != racer.owner]  # the member: never
        send_all(django_db_blocker, racer)
        assert received(receiver) == Counter(
            {("quota.forecast", racer.named(scope), window): 2 for scope, window in expected})
