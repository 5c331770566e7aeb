"""Background tasks of a gateway worker: the pub/sub listener that keeps the in-process caches
honest, and the batched `last_used_at` writer that keeps the database off the hot path."""
from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from gateway import metrics
from gateway.circuit import apply_breaker_message
from gateway.runtime import GatewayRuntime
from quotas.client import make_async_redis
from quotas.keys import (
    INVALIDATION_CHANNEL,
    PROVIDER_BREAKER_CHANNEL,
    QUEUE_WAKE_CHANNEL,
    PROVIDER_COOLDOWN_CHANNEL,
    auth_version_key,
)
from tenants.services import touch_last_used

log = logging.getLogger(__name__)
_PING_SECONDS = 5.0


class VersionWatch:
    """This worker's view of the invalidation version (quotas.keys.auth_version_key): every
    message carries the version its publish set, so a version read from Redis that no message
    has reached within one more check means a message was lost."""

    def __init__(self, version: int) -> None:
        self.seen = version  # the highest version applied (or read when subscribing)
        self.unmatched: int | None = None  # read at the last check, not yet reached by a message

    def message(self, version: int) -> bool:
        """Record a message's version; True if messages before it were lost."""
        lost = version > self.seen + 1
        self.seen = max(self.seen, version)
        return lost

    def check(self, current: int) -> bool:
        """Record the version read from Redis; True if a message was (or may have been) lost.
        A version ahead of the messages is given until the next check for its message to arrive
        (the publish and the read travel on different connections)."""
        if current < self.seen:
            # The version went back: Redis lost its data (and maybe messages with it). Start
            # counting again from what it holds now.
            self.seen, self.unmatched = current, None
            return True
        if current == self.seen:
            self.unmatched = None
            return False
        if self.unmatched is not None and self.seen < self.unmatched:
            self.seen, self.unmatched = current, None
            return True
        self.unmatched = current
        return False


async def _read_version(client: Any) -> int:
    return int(await client.get(auth_version_key()) or 0)


async def _apply(runtime: GatewayRuntime, channel: str, data: str,
                 watch: VersionWatch | None = None) -> None:
    if channel == QUEUE_WAKE_CHANNEL:
        runtime.waiting.dispatch(data)  # wakes this worker's waiters: no I/O
        return
    message = json.loads(data)
    if channel == PROVIDER_COOLDOWN_CHANNEL:
        runtime.pool.cool_down(int(message["id"]), float(message["until"]))
        return
    if channel == PROVIDER_BREAKER_CHANNEL:
        apply_breaker_message(runtime.pool, message)
        return
    kind, ident = message.get("kind"), message.get("id")
    if kind == "api_key":
        runtime.auth.forget_key(int(ident))
    elif kind == "tenant":
        runtime.auth.forget_tenant(int(ident))
    elif kind == "plan":
        runtime.auth.clear()  # plans are shared by many tenants: start afresh
    elif kind == "catalog":  # models, prices or aliases
        await runtime.reload_catalog()
    elif kind == "providers":
        if ident is not None:
            # That key was deleted or changed: out of the pool at once, back with the reload
            # if it still serves (a reload that fails keeps it out rather than stale).
            runtime.pool = runtime.pool.without(int(ident))
        await runtime.reload_pool()
        # The catalog's price book holds the provider keys' default prices.
        await runtime.reload_catalog()
    version = message.get("v")
    if watch is not None and version is not None and watch.message(int(version)):
        await _lost_messages(runtime)


async def _lost_messages(runtime: GatewayRuntime) -> None:
    log.warning("invalidation messages were lost; emptying the auth cache and reloading the "
                "catalog and provider keys")
    runtime.auth.clear()
    await _reload_after_gap(runtime)


async def _reload_after_gap(runtime: GatewayRuntime) -> None:
    """Catalog (with its prices) and provider changes published while the subscription was down
    were lost: reload both, or a price change would be missed until the next one."""
    try:
        await runtime.reload_pool()
        await runtime.reload_catalog()
    except Exception:
        log.warning("could not reload the catalog and provider keys after resubscribing",
                    exc_info=True)


async def listen(runtime: GatewayRuntime) -> None:
    """Subscribe forever. The auth cache is trusted only while subscribed and while the version
    was read within the last two checks, and emptied on every (re)subscription because messages
    sent while disconnected are lost."""
    interval = settings.GATEWAY_AUTH_VERSION_CHECK_SECONDS
    # A slow read is waited for rather than torn down (the trust it renews lapses on its own
    # two intervals after the last good read).
    read_timeout = max(interval, settings.REDIS_SOCKET_TIMEOUT)
    resubscribing = False
    while True:
        client = make_async_redis()
        pubsub = client.pubsub()
        try:
            if settings.REDIS_CLUSTER:
                # redis-py's cluster pub/sub picks its node from the client's slot map, which
                # only commands fill in: without this every subscribe failed (KeyError on the
                # slot) and the cache was never trusted. Classic SUBSCRIBE on one node hears
                # every PUBLISH of the cluster (the cluster bus forwards them to every node).
                await client.initialize()
            await pubsub.subscribe(INVALIDATION_CHANNEL, PROVIDER_COOLDOWN_CHANNEL,
                                   PROVIDER_BREAKER_CHANNEL, QUEUE_WAKE_CHANNEL)
            # Read after subscribing: a message published in between is not lost, merely old.
            # Bounded by asyncio.timeout, never asyncio.wait_for: on Python 3.11, wait_for
            # returns the result of a read that finished in the same turn as a cancellation and
            # drops the cancellation (fixed in 3.12), so a stopping worker waited forever for
            # this loop (tests/security/test_auth_and_revocation.py).
            async with asyncio.timeout(read_timeout):
                watch = VersionWatch(await _read_version(client))
            runtime.auth.clear()
            runtime.auth.trust_for(2 * interval)
            if resubscribing:
                # Queue wakes sent meanwhile were lost: each queue's front waiter looks again.
                runtime.waiting.wake_fronts()
                await _reload_after_gap(runtime)
            resubscribing = True
            loop = asyncio.get_running_loop()
            last_ping = next_check = loop.time()
            next_check += interval
            while True:
                wait = min(1.0, max(0.0, next_check - loop.time()))
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                if message is not None and message["type"] == "message":  # not our pongs
                    await _apply(runtime, message["channel"], message["data"], watch)
                now = loop.time()
                if now >= next_check:
                    # At most once per interval per worker, never per request.
                    async with asyncio.timeout(read_timeout):
                        current = await _read_version(client)
                    if watch.check(current):
                        await _lost_messages(runtime)
                    runtime.auth.trust_for(2 * interval)
                    next_check = now + interval
                # A half-open connection delivers nothing and raises nothing: prove it is alive,
                # or the cache would keep trusting it through missed revocations.
                if now - last_ping >= _PING_SECONDS:
                    async with asyncio.timeout(_PING_SECONDS):
                        await pubsub.ping()
                    last_ping = now
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("invalidation subscription lost; authenticating from the database "
                        "until it is back", exc_info=True)
        finally:
            runtime.auth.distrust()
            try:
                await pubsub.aclose()
                await client.aclose()
            except Exception:  # noqa: BLE001, S110 - a connection already broken: nothing to close
                pass
        await asyncio.sleep(0.5)


def start_listener(runtime: GatewayRuntime) -> None:
    runtime.spawn(lambda: listen(runtime))


async def publish_cooldown(runtime: GatewayRuntime, provider_key_id: int, until: float) -> None:
    """Tell every process (this one included, through the same message) to skip a provider key
    that answered 429 until `until`. Counted here, where the cool-down starts, not where its
    message arrives (every worker gets it)."""
    runtime.pool.cool_down(provider_key_id, until)
    upstream = runtime.pool.get(provider_key_id)
    metrics.cooldown(upstream.public_id if upstream is not None else str(provider_key_id))
    try:
        await runtime.engine.client.publish(
            PROVIDER_COOLDOWN_CHANNEL, json.dumps({"id": provider_key_id, "until": until}))
    except Exception:  # noqa: BLE001 - the local cooldown still applies
        log.warning("could not publish the cooldown of provider key %s", provider_key_id)


async def flush_last_used(runtime: GatewayRuntime) -> None:
    if not runtime.used_keys:
        return
    ids, runtime.used_keys = runtime.used_keys, set()
    await runtime.db.run(touch_last_used, ids, datetime.now(UTC))


async def _flush_forever(runtime: GatewayRuntime) -> None:
    while True:
        await asyncio.sleep(settings.GATEWAY_LAST_USED_FLUSH_SECONDS)
        try:
            await flush_last_used(runtime)
        except Exception:
            log.warning("could not record last use of API keys", exc_info=True)


def start_last_used_flusher(runtime: GatewayRuntime) -> None:
    runtime.spawn(lambda: _flush_forever(runtime))
