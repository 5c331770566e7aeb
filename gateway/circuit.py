"""Circuit breakers on upstream provider keys: a worker's side of them (issue 12, part 2).

The rule
  * A transport failure (connect error, reset, timeout, a broken answer before its headers)
    counts against the provider key's own breaker: the key is skipped for every model.
  * A 5xx answer counts against the (key, model) breaker: the key is skipped for that model.
  * Any other answer is a success for both (a 5xx is one for the key's breaker: its transport
    worked), except client errors (4xx, including 429 and 401 / 403, which keep their
    cooldowns), which count for neither.
  * A key is skipped for a model while either breaker is open.

The shared state (closed / open / half-open, the window's counts) lives in Redis in the key's
slot (lua/breaker_record.lua, lua/breaker_probe.lua, wrapped in quotas/breakers.py); every
process keeps what it knows of open breakers in its ProviderPool, which skips those keys as it
skips cooling ones.

Round trips
  * A success costs no Redis call: it is counted here (a dict increment) and flushed every
    TOLLGATE_BREAKER_FLUSH_SECONDS, one script call per (key, model) that had successes.
  * A failure is recorded at once, one script call (with the successes not flushed yet), on the
    failure path only. The script answers with the breakers' state and any transition.
  * A key whose breaker is known open costs nothing (skipped in memory). Past its cool-down, the
    next call that would use it takes a probe slot first (one script call per breaker due); a
    probe's result is recorded at once (one more).

Transitions (opened, half_opened, closed) are acted on by the worker whose script made them:
its pool at once, then published on PROVIDER_BREAKER_CHANNEL (every worker's listener applies
it), then audited (provider_key.breaker_<transition>) on the database threads. An audit that
fails (PostgreSQL down) is logged with the transition's details and not retried: the breaker
works on regardless, and its Redis hash still counts the transition for /metrics.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from gateway.providers import KEY_BREAKER, ProviderPool, Upstream
from gateway.runtime import GatewayRuntime
from quotas.breakers import (
    AsyncBreakerStore,
    BreakerRules,
    BreakerState,
    Outcomes,
    RecordResult,
    SLOT_BACK,
)
from quotas.keys import PROVIDER_BREAKER_CHANNEL
from tenants.services.audit import record_audit_event

log = logging.getLogger(__name__)

# A failure's record is awaited this long at most before the call goes on (to the next key or
# its error); the record itself finishes in the background.
_RECORD_WAIT_S = 0.5


def rules_from_settings() -> BreakerRules:
    return BreakerRules(
        window_ms=max(1, round(settings.TOLLGATE_BREAKER_WINDOW_SECONDS * 1000)),
        min_calls=settings.TOLLGATE_BREAKER_MIN_CALLS,
        error_percent=settings.TOLLGATE_BREAKER_ERROR_PERCENT,
        cooldown_ms=max(1, round(settings.TOLLGATE_BREAKER_COOLDOWN_SECONDS * 1000)),
        probes=settings.TOLLGATE_BREAKER_PROBES,
        # A probe call ends within the call deadline; a slot whose result never came is free
        # again after that.
        lease_ms=max(1, round(settings.GATEWAY_CALL_DEADLINE_SECONDS * 1000)),
    )


@dataclass
class Ticket:
    """The probe slots a call holds: its result must be recorded with them (report), or the
    slots handed back (give_back), exactly once. A slot neither reported nor handed back stays
    taken a whole lease (the call deadline), and with `probes` slots per lease one such leak
    keeps a healed key skipped that long."""

    key: bool = False  # a slot of the key's own breaker
    model: bool = False  # a slot of the (key, model) breaker
    spent: bool = field(default=False, compare=False)  # reported or handed back

    def __bool__(self) -> bool:
        return self.key or self.model


NO_PROBE = Ticket()


class Circuit:
    """One worker's breaker bookkeeping: successes not flushed yet, and the script calls."""

    def __init__(self, runtime: GatewayRuntime, store: AsyncBreakerStore,
                 rules: BreakerRules, flush_s: float) -> None:
        self.runtime = runtime
        self.store = store
        self.rules = rules
        self.flush_s = flush_s
        self.pending: dict[tuple[int, str], int] = {}
        self.flushing = False

    # -- the hot path ----------------------------------------------------------------------

    def ok(self, upstream: Upstream, model: str) -> None:
        """An ordinary success: counted here, flushed later (no round trip)."""
        key = (upstream.id, model)
        self.pending[key] = self.pending.get(key, 0) + 1
        if not self.flushing:
            self.flushing = True
            self.runtime.spawn(self._flush_forever)

    # -- probes ---------------------------------------------------------------------------------

    async def admit(self, upstream: Upstream, model: str, due: list[str]) -> Ticket | None:
        """Take a probe slot of every breaker of this key that is past its cool-down; None: skip
        the key (a slot was refused: other calls are probing it)."""
        pool = self.runtime.pool
        ticket = NO_PROBE
        try:
            for name in due:
                try:
                    result = await self.store.probe(upstream.id, name, self.rules)
                except Exception as exc:  # noqa: BLE001 - Redis away: try the key, unprobed
                    log.warning("breaker probe of provider key %s not taken (%s)",
                                upstream.public_id, exc)
                    continue
                if result.transition:
                    self._transition(upstream, name, result.transition, "half_open", 0, 0, 0.0)
                if not result.granted:
                    wait = min(result.wait_ms, self.rules.cooldown_ms) / 1000
                    pool.hold_breaker(upstream.id, name, time.time() + wait)
                    self.give_back(upstream, model, ticket)  # the key's slot, if taken first
                    return None
                if result.state == "closed":
                    pool.close_breaker(upstream.id, name)  # closed meanwhile: an ordinary call
                elif name == KEY_BREAKER:
                    ticket = Ticket(True, ticket.model)
                else:
                    ticket = Ticket(ticket.key, True)
        except BaseException:
            self.give_back(upstream, model, ticket)  # cancelled between the two probes
            raise
        return ticket

    def give_back(self, upstream: Upstream, model: str, ticket: Ticket) -> None:
        """Hand back the slots of a ticket whose call will not report a result for them (a
        second slot refused, no RPM / TPM capacity, the client left, an error): one script call,
        detached (so it runs even from a cancelled call's cleanup). Nothing for NO_PROBE or a
        ticket already reported."""
        if not ticket or ticket.spent:
            return
        ticket.spent = True
        self.runtime.detach(self._record(upstream, model,
                                         SLOT_BACK if ticket.key else Outcomes(),
                                         SLOT_BACK if ticket.model else Outcomes()))

    # -- outcomes -------------------------------------------------------------------------------

    async def report(self, upstream: Upstream, model: str, ticket: Ticket, *,
                     transport_failed: bool = False, server_failed: bool = False) -> None:
        """Record a failure, or a probe's result, at once (one script call)."""
        if ticket:
            ticket.spent = True
        # A failure takes the successes not flushed yet along; a probe's record leaves them to
        # the flush (a breaker holding a probe slot would count them as nothing).
        pending = 0 if ticket else self.pending.pop((upstream.id, model), 0)
        if ticket.key:
            key = Outcomes(int(not transport_failed), int(transport_failed), probe=True)
        else:
            key = Outcomes(pending + int(not transport_failed), int(transport_failed))
        if ticket.model:
            # A transport failure says nothing of the model: no result, its slot is handed
            # back (neither a success nor a failure for the model's breaker).
            mod = Outcomes(int(not server_failed), int(server_failed), probe=True) \
                if not transport_failed else SLOT_BACK
        else:
            mod = Outcomes(pending + int(not transport_failed and not server_failed),
                           int(server_failed))
        task = self.runtime.detach(self._record(upstream, model, key, mod))
        # Awaited briefly, so the next call in this worker already skips a key it opened.
        await asyncio.wait({task}, timeout=_RECORD_WAIT_S)

    async def _record(self, upstream: Upstream, model: str, key: Outcomes,
                      mod: Outcomes) -> None:
        try:
            result = await self.store.record(upstream.id, model, key, mod, self.rules)
        except Exception as exc:  # noqa: BLE001 - a breaker must never fail a call
            log.warning("breaker record of provider key %s failed (%s)", upstream.public_id, exc)
            return
        self._apply(upstream, result)

    def _apply(self, upstream: Upstream, result: RecordResult) -> None:
        for breaker in (result.key, result.model):
            until = time.time() + max(0, breaker.until_ms - result.now_ms) / 1000
            self._learn(upstream.id, breaker, until)
            if breaker.transition:
                self._transition(upstream, breaker.model, breaker.transition, breaker.state,
                                 breaker.calls, breaker.errors,
                                 max(0, breaker.until_ms - result.now_ms) / 1000)

    def _learn(self, upstream_id: int, breaker: BreakerState, until: float) -> None:
        pool = self.runtime.pool
        if breaker.state == "open":
            pool.open_breaker(upstream_id, breaker.model, until)
        elif breaker.state == "closed":
            pool.close_breaker(upstream_id, breaker.model)

    def _transition(self, upstream: Upstream, model: str, transition: str, state: str,
                    calls: int, errors: int, left_s: float) -> None:
        """This worker's script made a transition: tell every worker, and audit it."""
        log.warning("provider key %s breaker %s%s (calls %d, errors %d)", upstream.public_id,
                    transition, f" for model {model}" if model else "", calls, errors)
        message = json.dumps({"id": upstream.id, "model": model, "state": state,
                              "left": round(left_s, 3)})
        self.runtime.spawn(lambda: self._publish(message))
        data = {"breaker": "model" if model else "key", "model": model or None,
                "calls": calls, "errors": errors}
        if transition == "opened":
            data["open_seconds"] = round(left_s, 3)
        self.runtime.spawn(lambda: self._audit(upstream, f"provider_key.breaker_{transition}",
                                               data))

    async def _publish(self, message: str) -> None:
        try:
            await self.store.client.publish(PROVIDER_BREAKER_CHANNEL, message)
        except Exception:  # noqa: BLE001 - other workers learn it at their next failure
            log.warning("could not publish a breaker transition: %s", message)

    async def _audit(self, upstream: Upstream, action: str, data: dict[str, Any]) -> None:
        try:
            await self.runtime.db.run(_record_transition, upstream, action, data)
        except Exception:  # noqa: BLE001 - PostgreSQL down: the log line is the record
            log.exception("audit of %s on provider key %s not recorded: %s", action,
                          upstream.public_id, data)

    # -- the flush ------------------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """One script call per (key, model) with successes counted since the last flush. Lost
        when Redis is away (nothing is admitted then, fail closed, so few are lost)."""
        pending, self.pending = self.pending, {}
        pool = self.runtime.pool
        for (upstream_id, model), ok in pending.items():
            upstream = pool.get(upstream_id)
            if upstream is None:
                continue  # deleted or disabled since
            await self._record(upstream, model, Outcomes(ok), Outcomes(ok))


def _record_transition(upstream: Upstream, action: str, data: dict[str, Any]) -> None:
    from tenants.models import Tenant

    tenant = Tenant.objects.filter(pk=upstream.tenant_id).first() \
        if upstream.tenant_id is not None else None
    record_audit_event(actor="gateway", action=action, target=upstream.public_id,
                       tenant=tenant, data=data)


def apply_breaker_message(pool: ProviderPool, message: dict[str, Any]) -> None:
    """A transition another worker published (gateway/listener.py)."""
    provider_key_id, model = int(message["id"]), str(message.get("model") or KEY_BREAKER)
    state = message.get("state")
    if state == "open":
        pool.open_breaker(provider_key_id, model, time.time() + float(message["left"]))
    elif state == "closed":
        pool.close_breaker(provider_key_id, model)
    # half_open: the key stays offered; a call takes a probe slot (or learns to wait) first.


_circuit: Circuit | None = None


def circuit_for(runtime: GatewayRuntime) -> Circuit:
    """The worker's Circuit (one per runtime, like its event loop)."""
    global _circuit
    if _circuit is None or _circuit.runtime is not runtime:
        _circuit = Circuit(runtime, AsyncBreakerStore(runtime.engine.client),
                           rules_from_settings(), settings.TOLLGATE_BREAKER_FLUSH_SECONDS)
    return _circuit
