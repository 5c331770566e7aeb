"""Stand in for a Celery worker inside a test: take the tasks queued on the real broker (the test
session's Redis) for a queue, and run those a test is waiting for in this process, inside the
test's transaction (so they see its rows). Other messages found there (left by earlier tests
whose rows were rolled back) are acknowledged and dropped."""
from __future__ import annotations

from queue import Empty
from typing import Any

from config.celery import WEBHOOK_QUEUE, app


def queued_tasks(queue_name: str = WEBHOOK_QUEUE) -> list[tuple[str, tuple[Any, ...]]]:
    """Every message waiting on `queue_name`, taken off the broker: (task name, args)."""
    taken: list[tuple[str, tuple[Any, ...]]] = []
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(app.amqp.queues[queue_name])
        try:
            while True:
                try:
                    message = simple.get(timeout=0.5)
                except Empty:
                    break
                args, _kwargs, _embed = message.decode()
                taken.append((message.headers["task"], tuple(args)))
                message.ack()
        finally:
            simple.close()
    return taken


def run_queued_deliveries(delivery_ids: set[int]) -> list[str]:
    """Run the deliver_webhook tasks queued for `delivery_ids`, as a worker of the webhooks queue
    would; their results (the delivery's status after the attempt)."""
    results = []
    for name, args in queued_tasks(WEBHOOK_QUEUE):
        if name == "billing.tasks.deliver_webhook" and args and args[0] in delivery_ids:
            results.append(app.tasks[name].apply(args=args).get())
    return results
