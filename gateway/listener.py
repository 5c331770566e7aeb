"""Background tasks of a gateway worker: the pub/sub listener that keeps the in-process caches
honest, and the batched `last_used_at` writer that keeps the database off the hot path."""
from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime

from django.conf import settings

from gateway.runtime import GatewayRuntime
from quotas.client import make_async_redis
from quotas.keys import INVALIDATION_CHANNEL, PROVIDER_COOLDOWN_CHANNEL
from tenants.services import touch_last_used

log = logging.getLogger(__name__)
_PING_SECONDS = 5.0


async def _apply(runtime: GatewayRuntime, channel: str, data: str) -> None:
    message = json.loads(data)
    if channel == PROVIDER_COOLDOWN_CHANNEL:
        runtime.pool.cool_down(int(message["id"]), float(message["until"]))
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
        await runtime.reload_pool()
        # The catalog's price book holds the provider keys' default prices.
        await runtime.reload_catalog()


async def _reload_after_gap(runtime: GatewayRuntime) -> None:
    """Catalog (with its prices) and provider changes published while the subscription was down
    were lost: reload both, or a price change would be missed until the next one."""
    try:
        await runtime.reload_pool()
        await runtime.reload_catalog()
    except Exception:  # noqa: BLE001 - the previous snapshots stay in use; the next message reloads
        log.warning("could not reload the catalog and provider keys after resubscribing",
                    exc_info=True)


async def listen(runtime: GatewayRuntime) -> None:
    """Subscribe forever. The auth cache is trusted only while subscribed, and emptied on every
    (re)subscription because messages sent while disconnected are lost."""
    resubscribing = False
    while True:
        client = make_async_redis()
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(INVALIDATION_CHANNEL, PROVIDER_COOLDOWN_CHANNEL)
            runtime.auth.clear()
            runtime.auth.trusted = True
            if resubscribing:
                await _reload_after_gap(runtime)
            resubscribing = True
            last_ping = asyncio.get_running_loop().time()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "message":  # not our pongs
                    await _apply(runtime, message["channel"], message["data"])
                # A half-open connection delivers nothing and raises nothing: prove it is alive,
                # or the cache would keep trusting it through missed revocations.
                now = asyncio.get_running_loop().time()
                if now - last_ping >= _PING_SECONDS:
                    await asyncio.wait_for(pubsub.ping(), timeout=_PING_SECONDS)
                    last_ping = now
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - any failure: distrust the cache, reconnect
            log.warning("invalidation subscription lost; authenticating from the database "
                        "until it is back", exc_info=True)
        finally:
            runtime.auth.trusted = False
            try:
                await pubsub.aclose()
                await client.aclose()
            except Exception:  # noqa: BLE001
                pass
        await asyncio.sleep(0.5)


def start_listener(runtime: GatewayRuntime) -> None:
    runtime.spawn(lambda: listen(runtime))


async def publish_cooldown(runtime: GatewayRuntime, provider_key_id: int, until: float) -> None:
    """Tell every process (this one included, through the same message) to skip a provider key
    that answered 429 until `until`."""
    runtime.pool.cool_down(provider_key_id, until)
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
        except Exception:  # noqa: BLE001 - telemetry; retried with the next batch
            log.warning("could not record last use of API keys", exc_info=True)


def start_last_used_flusher(runtime: GatewayRuntime) -> None:
    runtime.spawn(lambda: _flush_forever(runtime))
