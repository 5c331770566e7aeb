"""Tell every gateway process that cached tenancy data changed.

The gateway caches API keys and tenant limits in process memory (its hot path makes no database
query). A revoked or rotated key, a plan change or new limits must reach every process within a
second: the services below publish after their transaction commits, and each gateway process
drops the affected entries when the message arrives (gateway/listener.py). A process that loses
its subscription, or cannot read the version that numbers the messages, stops trusting its cache
until it can; one that sees the version move without a message empties its cache.

A publish that fails is not forgotten: it is retried at once (about 0.75 s in all), then every
second on a background thread until Redis takes it. Until then the gateways' cache age
(GATEWAY_AUTH_CACHE_SECONDS) bounds how long they can keep what changed.

This module only says what changed. The message travels through a transport set when the apps
are ready: quotas/invalidation.py, which publishes on Redis pub/sub (tenants/ sits below quotas/
and imports nothing from it).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from django.db import transaction

log = logging.getLogger(__name__)

Kind = Literal["api_key", "tenant", "plan", "catalog", "providers"]
Transport = Callable[[str, int | None], Any]

_transport: Transport | None = None
# Pauses between the attempts made at once, before the background thread takes over.
RETRY_DELAYS_S: tuple[float, ...] = (0.05, 0.2, 0.5)
BACKGROUND_RETRY_S = 1.0
_MAX_PENDING = 10_000


def set_transport(transport: Transport) -> None:
    """Install the function that sends a (kind, id) message to every gateway process
    (quotas.apps.QuotasConfig.ready installs Redis pub/sub)."""
    global _transport
    _transport = transport


def _send(kind: str, ident: int | None) -> None:
    if _transport is None:
        raise RuntimeError("no invalidation transport is set (is the quotas app installed?)")
    _transport(kind, ident)


class _Retrier:
    """Messages that could not be sent, retried every BACKGROUND_RETRY_S on a daemon thread,
    oldest first, until sent (each only drops cached data, so their order does not matter)."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, int | None]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, kind: str, ident: int | None) -> None:
        with self._lock:
            if (kind, ident) not in self._pending:
                if len(self._pending) >= _MAX_PENDING:
                    # Bounded: "plan" empties every gateway's auth cache, which covers any key.
                    self._pending = [m for m in self._pending if m[0] not in ("api_key", "tenant")]
                    if ("plan", None) not in self._pending:
                        self._pending.insert(0, ("plan", None))
                self._pending.append((kind, ident))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="invalidation-retry",
                                                daemon=True)
                self._thread.start()

    def pending(self) -> list[tuple[str, int | None]]:
        with self._lock:
            return list(self._pending)

    def _run(self) -> None:
        while True:
            time.sleep(BACKGROUND_RETRY_S)
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                batch = list(self._pending)
            self._send_batch(batch)

    def _send_batch(self, batch: list[tuple[str, int | None]]) -> None:
        """One round, oldest first; stops at the first failure (the rest waits for the next
        round). Nothing one attempt raises may end the thread: the messages would then wait
        for the next add()."""
        for message in batch:
            try:
                _send(*message)
            except Exception:  # noqa: BLE001 - still unreachable, or a bug: next round
                log.warning("retrying the %s %s invalidation failed; next try in %g s",
                            *message, BACKGROUND_RETRY_S, exc_info=True)
                return
            self._sent(message)

    def _sent(self, message: tuple[str, int | None]) -> None:
        with self._lock:
            # An overflow in add() may have rewritten the list meanwhile (this message replaced
            # by the "plan" message that covers it): nothing left to remove then.
            if message in self._pending:
                self._pending.remove(message)
        log.warning("published the %s %s invalidation after retrying", *message)


retrier = _Retrier()


def _publish_now(kind: Kind, ident: int | None) -> None:
    failure: Exception | None = None
    for delay in (0.0, *RETRY_DELAYS_S):
        time.sleep(delay)
        try:
            _send(kind, ident)
            return
        except Exception as error:  # noqa: BLE001 - the change is committed; gateways must hear
            failure = error
    log.error(
        "could not publish %s %s invalidation after %d attempts; retrying every %.0f s in the "
        "background. Until it is sent, gateways keep what they cached for at most "
        "GATEWAY_AUTH_CACHE_SECONDS", kind, ident, 1 + len(RETRY_DELAYS_S), BACKGROUND_RETRY_S,
        exc_info=failure,
    )
    retrier.add(kind, ident)


def publish(kind: Kind, ident: int | None = None) -> None:
    """Publish once the surrounding transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: _publish_now(kind, ident))
