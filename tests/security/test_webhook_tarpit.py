"""Issue 11, item 1: a webhook receiver cannot stall Tollgate.

Every delivery attempt has a total deadline (TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS) that cuts a
tarpit (tests/support/tarpit.py) whatever phase it stalls; a person's test event or redelivery
is queued for a worker instead of being sent inside the web request; every Celery task has a
soft and a hard time limit; webhook deliveries have their own queue, which every worker this
repository starts consumes.

The deadline tests run the attempt on the test's own thread with a watchdog: if the attempt is
still running well after its deadline, the watchdog closes the tarpit's connections (so the test
ends) and the test fails on `tarpit.aborted`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from billing import webhooks
from billing.models import WebhookDelivery, WebhookEndpoint
from billing.tasks import deliver_webhook, dispatch_deliveries
from billing.webhooks import create_endpoint
from config import serve
from config.celery import DEFAULT_QUEUE, WEBHOOK_QUEUE, WORKER_QUEUES, app
from tests.billing.conftest import celery_worker_process
from tests.gateway.conftest import ROOT, committed, gateway_env, wait_until
from tests.support.celery_queue import queued_tasks, run_queued_deliveries
from tests.support.tarpit import Tarpit
from tests.support.webhook_receiver import Receiver
from tests.world import World

DEADLINE_S = 2.0
# Far above the deadline and the tarpits' interval: only a missing total deadline reaches it.
WATCHDOG_S = DEADLINE_S + 6
DEADLINE_ERROR = ("no complete answer within the total deadline of 2 s "
                  "(TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS)")


@pytest.fixture
def deadline(settings: Any) -> Any:
    settings.TOLLGATE_WEBHOOK_ALLOW_PRIVATE = True  # the tarpits listen on 127.0.0.1
    settings.TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS = DEADLINE_S
    # Each read is allowed 5 s: a tarpit that sends something every second never trips it.
    settings.TOLLGATE_WEBHOOK_TIMEOUT_SECONDS = 5.0
    return settings


def with_watchdog(tarpit: Tarpit, work: Callable[[], Any]) -> Any:
    watchdog = threading.Timer(WATCHDOG_S, tarpit.abort)
    watchdog.start()
    try:
        return work()
    finally:
        watchdog.cancel()


def due_delivery(endpoint: WebhookEndpoint) -> WebhookDelivery:
    return webhooks.create_test_event(endpoint)


# -- the total deadline -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("mode", ["continue", "head"])
def test_a_tarpit_cannot_hold_a_delivery_past_its_total_deadline(deadline: Any, mode: str) -> None:
    with Tarpit(mode, interval=1.0) as tarpit:  # type: ignore[arg-type]
        endpoint, _ = create_endpoint(_tenant(), tarpit.url, ["test"], actor="test")
        delivery = due_delivery(endpoint)
        left = with_watchdog(tarpit, lambda: webhooks.deliver(delivery.pk))
        assert tarpit.connections == 1
        assert not tarpit.aborted, "the attempt outlived its total deadline"
    assert left.status == "pending" and left.attempts == 1  # a failed attempt, retried later
    assert left.last_status_code is None and left.last_error == DEADLINE_ERROR
    assert left.next_attempt_at is not None


@pytest.mark.django_db
def test_a_body_trickled_after_the_answer_does_not_hold_the_delivery(deadline: Any) -> None:
    """The status line is the answer: the body is never read, so trickling it holds nothing."""
    with Tarpit("body", interval=1.0) as tarpit:
        endpoint, _ = create_endpoint(_tenant(), tarpit.url, ["test"], actor="test")
        delivery = due_delivery(endpoint)
        left = with_watchdog(tarpit, lambda: webhooks.deliver(delivery.pk))
        assert not tarpit.aborted
    assert left.status == "delivered" and left.last_status_code == 200


@pytest.mark.django_db
def test_the_delivery_task_and_its_retry_end_within_the_deadline(deadline: Any) -> None:
    """The Celery task itself (what retry_due_webhooks and a failed attempt queue again)."""
    with Tarpit("continue", interval=1.0) as tarpit:
        endpoint, _ = create_endpoint(_tenant(), tarpit.url, ["test"], actor="test")
        delivery = due_delivery(endpoint)
        first = with_watchdog(tarpit, lambda: deliver_webhook.apply(args=(delivery.pk,)).get())
        # Make the retry due now and run the task again, as the retry would.
        WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=delivery.created_at)
        second = with_watchdog(tarpit, lambda: deliver_webhook.apply(args=(delivery.pk,)).get())
        assert not tarpit.aborted and tarpit.connections == 2
    delivery.refresh_from_db()
    assert (first, second) == ("pending", "pending")
    assert delivery.attempts == 2 and delivery.last_error == DEADLINE_ERROR


@pytest.mark.django_db
def test_name_resolution_is_inside_the_deadline(deadline: Any, monkeypatch: pytest.MonkeyPatch,
                                                ) -> None:
    """Fault injected: a resolver that never answers (a tenant's name server can be slow on
    purpose); the attempt ends at its deadline."""
    import socket

    stuck = threading.Event()
    real = socket.getaddrinfo

    def never(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.example.test":
            stuck.wait(WATCHDOG_S)
        return real(host, *args, **kwargs)

    endpoint = WebhookEndpoint.objects.create(
        tenant=_tenant(), url="http://slow.example.test/hook", events=["test"],
        secret_encrypted=webhooks.encrypt_secret(webhooks.new_secret()))
    monkeypatch.setattr(socket, "getaddrinfo", never)
    try:
        left = webhooks.deliver(due_delivery(endpoint).pk)
    finally:
        stuck.set()
    assert left.attempts == 1 and left.status == "pending"
    assert left.last_error == ("refused: the webhook URL's host 'slow.example.test' did not "
                               "resolve within 2 s")
    assert stuck.is_set()


# -- test events and redeliveries are queued, never sent in the request ----------------------------


@pytest.fixture
def tarpit(deadline: Any) -> Iterator[Tarpit]:
    with Tarpit("continue", interval=1.0) as t:
        yield t


def test_api_test_event_is_queued_and_its_result_shows_later(
        world: World, tarpit: Tarpit, django_capture_on_commit_callbacks: Any) -> None:
    endpoint, _ = create_endpoint(world.acme, tarpit.url, ["test"], actor="test")
    base = f"/api/tenants/{world.acme.public_id}/webhooks/{endpoint.public_id}/"
    owner = world.client(world.owner)
    with django_capture_on_commit_callbacks(execute=True) as queued:
        response = with_watchdog(tarpit, lambda: owner.post(f"{base}test"))
    # Answered without contacting the receiver: 202, the delivery pending, nothing sent.
    assert response.status_code == 202 and len(queued) == 1
    body = response.json()
    assert body["status"] == "pending" and body["attempts"] == 0 and body["last_error"] == ""
    assert tarpit.connections == 0 and not tarpit.aborted
    # The worker of the webhooks queue finds it there and runs it (within its deadline). A
    # person's test event has one attempt: failed, not retried.
    delivery = WebhookDelivery.objects.get(public_id=body["id"])
    assert with_watchdog(tarpit, lambda: run_queued_deliveries({delivery.pk})) == ["failed"]
    assert tarpit.connections == 1 and not tarpit.aborted
    [row] = owner.get(f"{base}deliveries/").json()["results"]
    assert (row["id"], row["attempts"], row["last_error"]) == (body["id"], 1, DEADLINE_ERROR)


def test_console_test_event_is_queued_and_its_result_shows_on_the_detail_page(
        world: World, tarpit: Tarpit, django_capture_on_commit_callbacks: Any) -> None:
    endpoint, _ = create_endpoint(world.acme, tarpit.url, ["test"], actor="test")
    client = world.client(world.owner)
    detail = reverse("console-webhook-detail", args=[world.acme.public_id, endpoint.public_id])
    test = reverse("console-webhook-test", args=[world.acme.public_id, endpoint.public_id])
    with django_capture_on_commit_callbacks(execute=True) as queued:
        response = with_watchdog(tarpit, lambda: client.post(test))
    assert response.status_code == 302 and response["Location"] == detail and len(queued) == 1
    assert tarpit.connections == 0 and not tarpit.aborted
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    assert (delivery.status, delivery.attempts) == ("pending", 0)
    page = client.get(detail).content.decode()
    assert f"Test event queued as delivery {delivery.public_id}" in page
    row = page[page.index(f'data-delivery="{delivery.public_id}"'):]
    assert "Pending" in row[:row.index("</tr>")] and "queued" in row[:row.index("</tr>")]

    assert with_watchdog(tarpit, lambda: run_queued_deliveries({delivery.pk})) == ["failed"]
    assert not tarpit.aborted
    page = client.get(detail).content.decode()
    row = page[page.index(f'data-delivery="{delivery.public_id}"'):]
    assert "no complete answer within the total deadline of 2 s" in row[:row.index("</tr>")]


def test_api_and_console_redelivery_are_queued_too(
        world: World, tarpit: Tarpit, django_capture_on_commit_callbacks: Any) -> None:
    endpoint, _ = create_endpoint(world.acme, tarpit.url, ["test"], actor="test")
    client = world.client(world.owner)
    base = f"/api/tenants/{world.acme.public_id}/webhooks/{endpoint.public_id}/deliveries/"
    for sent, (kind, status) in enumerate((("api", 202), ("console", 302))):
        delivery = due_delivery(endpoint)
        WebhookDelivery.objects.filter(pk=delivery.pk).update(status="failed", attempts=6,
                                                              next_attempt_at=None)
        url = (f"{base}{delivery.public_id}/redeliver" if kind == "api" else reverse(
            "console-webhook-redeliver",
            args=[world.acme.public_id, endpoint.public_id, delivery.public_id]))
        with django_capture_on_commit_callbacks(execute=True) as queued:
            response = with_watchdog(tarpit, lambda: client.post(url))  # noqa: B023
        assert response.status_code == status and len(queued) == 1
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts) == ("pending", 6)
        assert tarpit.connections == sent and not tarpit.aborted
        # The queued task sends the one attempt (the last allowed: failed again).
        assert with_watchdog(tarpit, lambda: run_queued_deliveries({delivery.pk})) == [  # noqa: B023
            "failed"]
        delivery.refresh_from_db()
        assert delivery.attempts == 7 and delivery.last_error == DEADLINE_ERROR
    assert tarpit.connections == 2 and not tarpit.aborted


# -- Celery: queues and time limits on the real app --------------------------------------------


def test_webhook_delivery_has_its_own_queue_and_everything_else_another() -> None:
    """Only webhook work (deliveries, the retry of due ones) is on the webhooks queue; every
    other job has a queue of its own kind (tests/billing/test_celery_hosts.py checks each)."""
    app.loader.import_default_modules()
    route = app.amqp.router.route
    assert route({}, "billing.tasks.deliver_webhook")["queue"].name == WEBHOOK_QUEUE == "webhooks"
    webhook_work = {"billing.tasks.deliver_webhook", "billing.tasks.retry_due_webhooks"}
    ours = sorted(n for n in app.tasks if n.startswith(("billing.", "quotas.")))
    assert "billing.tasks.drain_usage" in ours and "quotas.tasks.sweep_stale_holds" in ours
    for name in ours:
        queue = route({}, name)["queue"].name
        assert (queue == WEBHOOK_QUEUE) == (name in webhook_work), (name, queue)
    assert route({}, "billing.tasks.check_quota_thresholds")["queue"].name == DEFAULT_QUEUE
    # A worker started without -Q consumes every declared queue.
    assert set(app.amqp.queues) == set(WORKER_QUEUES) == {
        "celery", "ledger", "sweep", "webhooks", "reports"}


def test_a_web_process_publishes_with_tollgates_celery_app() -> None:
    """The web process (not a worker: nothing imported config.celery for it) that serves the
    console and the API must queue deliveries on Tollgate's broker and webhooks queue, not on
    Celery's default app (amqp://localhost). A fresh interpreter, as uvicorn starts one."""
    script = ("import django; django.setup()\n"
              "from django.urls import resolve\n"
              "resolve('/api/tenants/ten_x/webhooks/whk_x/test')\n"
              "resolve('/console/t/ten_x/webhooks/whk_x/test/')\n"
              "from billing.tasks import deliver_webhook as t\n"
              "print(t.app.main, t.app.amqp.router.route({}, t.name)['queue'].name)\n")
    done = subprocess.run([sys.executable, "-c", script], env=gateway_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tollgate", WEBHOOK_QUEUE]


@pytest.mark.django_db
def test_dispatch_puts_deliveries_on_the_webhooks_queue_of_the_real_broker(deadline: Any) -> None:
    with Receiver() as receiver:
        endpoint, _ = create_endpoint(_tenant(), receiver.url, ["test"], actor="test")
        delivery = due_delivery(endpoint)
        queued_tasks(WEBHOOK_QUEUE)  # whatever earlier tests left there
        assert dispatch_deliveries([delivery.pk]) == 1
        assert (("billing.tasks.deliver_webhook", (delivery.pk,)) in queued_tasks(WEBHOOK_QUEUE))
        assert all(args != (delivery.pk,) for _name, args in queued_tasks(DEFAULT_QUEUE))


def test_every_task_has_a_soft_and_a_hard_time_limit(settings: Any) -> None:
    app.loader.import_default_modules()
    ours = [app.tasks[n] for n in app.tasks if n.startswith(("billing.", "quotas."))]
    assert len(ours) >= 9
    for task in ours:
        assert task.soft_time_limit is not None and task.time_limit is not None, task.name
        assert 0 < task.soft_time_limit < task.time_limit, task.name
    deliver_task = app.tasks["billing.tasks.deliver_webhook"]
    total = settings.TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS
    assert (deliver_task.soft_time_limit, deliver_task.time_limit) == (total + 20, total + 30)
    sweep = app.tasks["quotas.tasks.sweep_stale_holds"]
    assert (sweep.soft_time_limit, sweep.time_limit) == (
        settings.TOLLGATE_TASK_SOFT_TIME_LIMIT_SECONDS, settings.TOLLGATE_TASK_TIME_LIMIT_SECONDS)
    reconcile = app.tasks["billing.tasks.reconcile_daily"]
    assert reconcile.soft_time_limit == settings.TOLLGATE_RECONCILE_TIME_LIMIT_SECONDS
    assert reconcile.time_limit == reconcile.soft_time_limit + 60
    # The retention may export a month of hundreds of millions of rows first: hours, not the
    # default 240 s, which would cut it every day and never retire the month.
    retention = app.tasks["billing.tasks.ledger_retention"]
    assert retention.soft_time_limit == settings.TOLLGATE_RETENTION_TIME_LIMIT_SECONDS == 6 * 3600
    assert retention.time_limit == retention.soft_time_limit + 60
    # Acknowledged when taken: unacknowledged for hours, a broker delivers it to a second
    # worker (Redis after its 1 h visibility timeout). The others acknowledge at their end.
    assert retention.acks_late is False and sweep.acks_late is True


def test_make_up_runs_workers_for_every_queue() -> None:
    """`make up` (config/serve.py) starts a worker per queue, webhooks among them, and a beat
    process of its own: together they consume every queue, and a slow receiver never takes the
    slot of the sweep or the drain."""
    commands = serve.celery_commands()
    workers = [c for c in commands if "worker" in c]
    consumed = [c[c.index("--queues") + 1].split(",") for c in workers]
    assert sorted(q for queues in consumed for q in queues) == sorted(WORKER_QUEUES)
    assert all(len(queues) == 1 for queues in consumed)
    assert [WEBHOOK_QUEUE] in consumed and [DEFAULT_QUEUE] in consumed
    assert not any("--beat" in c for c in commands)
    assert [c for c in commands if "worker" not in c] == [serve.beat_command()]


@pytest.mark.django_db
@pytest.mark.e2e
def test_a_real_worker_delivers_from_the_webhooks_queue_and_cuts_a_tarpit(
        django_db_setup: None, django_db_blocker: Any, tmp_path: Path) -> None:
    """The worker the billing tests start (tests/billing/conftest.py, no -Q) consumes the
    webhooks queue; the tarpit's delivery fails at its deadline, the good one is delivered."""
    from tenants.services import create_tenant

    env = gateway_env(TOLLGATE_WEBHOOK_ALLOW_PRIVATE="true",
                      TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS=str(DEADLINE_S))
    with Tarpit("continue", interval=1.0) as tarpit, Receiver() as receiver:
        def setup() -> list[int]:
            tenant = create_tenant(f"hooks-{os.getpid()}", plan_name="free", actor="test")
            ids = []
            for url in (tarpit.url, receiver.url):
                endpoint = WebhookEndpoint.objects.create(
                    tenant=tenant, url=url, events=["test"],
                    secret_encrypted=webhooks.encrypt_secret(webhooks.new_secret()))
                ids.append(webhooks.create_test_event(endpoint).pk)
            return ids

        stuck_id, good_id = committed(django_db_blocker, setup)

        def states() -> dict[int, tuple[str, int, str]]:
            return committed(django_db_blocker, lambda: {
                d.pk: (d.status, d.attempts, d.last_error)
                for d in WebhookDelivery.objects.filter(pk__in=[stuck_id, good_id])})

        with celery_worker_process(tmp_path, env) as log:
            assert dispatch_deliveries([stuck_id, good_id]) == 2
            assert wait_until(lambda: states()[stuck_id][1] >= 1
                              and states()[good_id][0] == "delivered", timeout=30), (
                states(), log.read_text()[-3000:])
        assert not tarpit.aborted and len(receiver.requests) == 1
        assert states()[stuck_id][2] == DEADLINE_ERROR


def _tenant() -> Any:
    from tenants.services import create_tenant

    return create_tenant("acme", plan_name="free", actor="test")
