"""Admission: check what memory can tell, estimate a call's worst case, reserve it, and apply
the plan's over-quota policy.

Exactly one reserve script call on the hot path; the policies (queue, soft, fallback) add calls
only for requests that were refused. Under the queue policy the reserve itself gates and queues
(lua/reserve.lua "Queue", no extra call); a queued call waits in quotas/waiting.py. A large body
is parsed, checked and counted as one job on an estimation thread (`checked`), so it costs the
event loop nothing and one hand-off.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, replace

from django.conf import settings

from gateway.auth import KeyContext
from gateway.bodies import MIN_THINKING_BUDGET, Endpoint, ParsedBody, parse_body
from gateway.catalog import ModelInfo, hold_for, output_cap_for_hold, reservation_tokens
from gateway.dialects import provider_kind
from gateway.observe import Observation
from gateway.errors import (
    GatewayError,
    bad_request,
    insufficient_quota,
    model_not_allowed,
    model_not_priced,
    not_found,
    queue_full,
    queue_timeout,
    rate_limited,
)
from gateway.prices import Price
from gateway.runtime import GatewayRuntime
from gateway.tokens import (
    estimate_chat_prompt,
    estimate_completion_prompt,
    estimate_embedding_input,
    estimate_messages_prompt,
    estimate_responses_input,
    is_large,
    off_loop,
)
from quotas.cycles import calendar_of
from quotas.engine import (
    QUEUE_PRIORITY_BOUND,
    UNLIMITED,
    Outcome,
    QueueResource,
    QueueTicket,
    Reservation,
    ReserveRequest,
    ScopeLimit,
    SentReserve,
    Unit,
)
from quotas.limits import CONCURRENCY
from quotas.waiting import QueueTimedOut, QueueTiming, wait_in_queue
from quotas.windows import WindowKind
from tenants.models import OverQuotaPolicy


@dataclass(frozen=True)
class Estimate:
    info: ModelInfo
    prompt_tokens: int
    amount: int  # tokens to hold
    output_cap: int | None  # per choice; None for embeddings
    # The call's price (gateway/prices.py), resolved once at admission: the money hold, the
    # settle's cost and the hold record (for the sweep) all use it.
    price: Price

    @property
    def worst_cost_micros(self) -> int:
        """An upper bound of the call's cost: every held token at the dearer of the two prices.

        At least 1 micro-dollar, so that one rule covers a spend budget of 0 and one used up to
        the last micro-dollar: neither admits anything, not even a call of a model priced 0
        (DESIGN.md: limit 0 rejects everything).
        """
        return max(1, self.price.bound(self.amount))


@dataclass(frozen=True)
class Checked:
    """A parsed call that passed every refusal memory can decide, with its estimate: what
    admit() reserves."""

    parsed: ParsedBody
    scopes: tuple[ScopeLimit, ...]  # the quota counters of the asked model
    estimate: Estimate


@dataclass(frozen=True)
class Admission:
    reservation: Reservation
    model: str  # the model forwarded upstream (differs from the asked one after a fallback)
    estimate: Estimate
    output_cap: int | None  # max_tokens to impose upstream (None: leave the client's as is)
    fallback_from: str | None = None
    soft: bool = False

    @property
    def metered(self) -> bool:
        return self.reservation.hold is not None


def priced(runtime: GatewayRuntime, model: str, endpoint: Endpoint) -> Price:
    """The model's price now, or model_not_priced (403): a call is never forwarded for free by
    accident. See gateway/prices.py for the resolution (default prices: only those of the keys
    of the endpoint's kind, the keys that may serve it)."""
    price = runtime.catalog.price(model, kind=provider_kind(endpoint))
    if price is None:
        raise model_not_priced(model)
    return price


def allows(runtime: GatewayRuntime, ctx: KeyContext, model: str) -> bool:
    """Whether the key may call `model`: a key allowed "gpt-4o" may call its dated snapshots
    (the model's aliases), not the other way round."""
    return ctx.allows(model) or ctx.allows(runtime.catalog.canonical(model))


def unmetered(call: Checked, request_id: str) -> Admission:
    """Admission without a hold, for the operator's fail-open mode while Redis is unreachable."""
    est = call.estimate
    reservation = Reservation(admitted=True, request_id=request_id, granted=0, counters=(),
                              refused=None, server_time_ms=0, hold=None)
    return Admission(reservation, call.parsed.model, est, est.output_cap)


# The field a context-length refusal names, per endpoint.
_PROMPT_PARAM = {Endpoint.CHAT: "messages", Endpoint.COMPLETIONS: "prompt",
                 Endpoint.RESPONSES: "input", Endpoint.MESSAGES: "messages"}


def estimate(parsed: ParsedBody, info: ModelInfo, ctx: KeyContext, price: Price) -> Estimate:
    body = parsed.body
    if parsed.endpoint is Endpoint.CHAT:
        prompt = estimate_chat_prompt(body["messages"], model=info.name, tools=body.get("tools"),
                                      functions=body.get("functions"), tokenizer=info.tokenizer)
    elif parsed.endpoint is Endpoint.COMPLETIONS:
        prompt = estimate_completion_prompt(body["prompt"], info.tokenizer)
    elif parsed.endpoint is Endpoint.RESPONSES:
        # Output cap: max_output_tokens (reasoning included), else the model's default.
        prompt = estimate_responses_input(body, model=info.name, tokenizer=info.tokenizer)
    elif parsed.endpoint is Endpoint.MESSAGES:
        # Output cap: max_tokens, required; a thinking budget counts inside it.
        prompt = estimate_messages_prompt(body, model=info.name, tokenizer=info.tokenizer)
    else:
        prompt = estimate_embedding_input(body["input"], info.tokenizer)
        return Estimate(info, prompt, max(1, hold_for(prompt, 0, ctx.limits.safety_factor)), None,
                        price)
    # Legacy completions default to 16 output tokens upstream, so that is their real bound.
    requested = parsed.max_output
    if requested is None and parsed.endpoint is Endpoint.COMPLETIONS:
        requested = 16
    amount, cap = reservation_tokens(prompt, requested, info, ctx.limits.safety_factor,
                                     choices=parsed.choices)
    if cap < least_output(parsed):
        raise bad_request(
            f"This model's maximum context length is {info.context_window} tokens; your "
            f"request has about {prompt} prompt tokens, which leaves no room for an answer.",
            _PROMPT_PARAM[parsed.endpoint], "context_length_exceeded")
    return Estimate(info, prompt, amount, cap, price)


# OpenAI's Responses API refuses a max_output_tokens below 16.
RESPONSES_MIN_OUTPUT = 16


def least_output(parsed: ParsedBody) -> int:
    """The smallest output cap per choice the call's API accepts, so that a cap the gateway
    lowers (to the headroom, or to what the context window leaves) is never one the upstream
    refuses: extended thinking (Messages API) needs its smallest budget plus one token of
    answer, since the budget must stay below max_tokens; the Responses API 16; others 1. Never
    above the client's own cap (a client's smaller cap is the upstream's to judge)."""
    if parsed.thinking_budget:
        least = MIN_THINKING_BUDGET + 1
    elif parsed.endpoint is Endpoint.RESPONSES:
        least = RESPONSES_MIN_OUTPUT
    else:
        least = 1
    return min(least, parsed.max_output) if parsed.max_output is not None else least


def reserve_meta(ctx: KeyContext, parsed: ParsedBody, model: str) -> str:
    """What the hold stores and its usage event carries for the ledger (who, which model)."""
    return _meta(ctx.project.pk, ctx.api_key.pk, parsed.model, model, parsed.endpoint.value)


@functools.lru_cache(maxsize=4096)
def _meta(project: int, key: int, asked: str, served: str, endpoint: str) -> str:
    # The same few strings for every call of a key (a JSON encoding each was ~1 % of the CPU).
    return json.dumps({"p": project, "k": key, "m": asked, "served": served, "ep": endpoint},
                      separators=(",", ":"))


def _request(ctx: KeyContext, parsed: ParsedBody, request_id: str, model: str, est: Estimate,
             scopes: tuple[ScopeLimit, ...], queue: QueueTicket | None = None) -> ReserveRequest:
    min_amount = None
    if ctx.limits.shrink_hold_to_headroom and est.output_cap is not None:
        # The smallest hold still worth sending: the prompt plus the smallest output cap the
        # API accepts (least_output), per choice.
        min_amount = min(est.amount, hold_for(est.prompt_tokens,
                                              least_output(parsed) * parsed.choices,
                                              ctx.limits.safety_factor))
    # The sweep charges a hold it must end without its call at these prices (lua/sweep.lua):
    # the dearest class of each side, since it cannot know the split (cache writes cost more
    # than plain input, reasoning may cost more than plain output).
    pin, pcached, pwrite, pout, preason = est.price.class_prices()
    return ReserveRequest(
        tenant=ctx.tenant_tag, request_id=request_id, amount=est.amount, limits=scopes,
        min_amount=min_amount, rates=ctx.rates, concurrency=ctx.concurrency,
        meta=reserve_meta(ctx, parsed, model), money_amount=est.worst_cost_micros,
        input_tokens=est.prompt_tokens, price_in=max(pin, pcached, pwrite),
        price_out=max(pout, preason),
        check_epoch=True,  # refuse (and rebuild) when Redis lost the tenant's data
        schedule=ctx.schedule,  # the tenant's day and cycle windows
        queue=queue,
    )


def _seconds_until(ms: int) -> int:
    return max(1, -(-ms // 1000))


def window_name(kind: WindowKind) -> str:
    """What a refusal calls a window: the 'month' counters are the tenant's cycle's (a day, a
    week, a billing-day month: quotas/cycles.py)."""
    return "cycle" if kind is WindowKind.MONTH else kind.value


def refusal_error(reservation: Reservation) -> GatewayError:
    if reservation.outcome is Outcome.RATE:
        rate = reservation.refused_rate
        return rate_limited(
            f"Rate limit reached for {rate.scope}: {rate.capacity} requests per "
            f"{rate.period_ms // 1000 or 1}s.", _seconds_until(reservation.retry_after_ms))
    if reservation.outcome is Outcome.CONCURRENCY:
        return rate_limited(
            f"Too many concurrent requests for this API key ({reservation.in_flight} in "
            "flight).", 1, refusal=CONCURRENCY)
    refused = reservation.refused
    assert refused is not None
    # The full counter's refusal reason comes with its definition (quotas/limits.py).
    scope = "tenant's shared pool" if refused.unit is Unit.POOL else refused.scope
    return insufficient_quota(scope, window_name(refused.window.kind),
                              _seconds_until(refused.window.end_ms - reservation.server_time_ms),
                              refusal=refused.reason)


def _with_output_cap(est: Estimate, reservation: Reservation, parsed: ParsedBody,
                     ctx: KeyContext) -> int | None:
    """The max_tokens to impose upstream, so the upstream cannot produce more than was held:
    the estimate's cap (the client's, else the model's default reservation), or less when the
    hold was shrunk to the headroom."""
    if est.output_cap is None:
        return None
    if reservation.granted >= est.amount:
        return est.output_cap
    return output_cap_for_hold(reservation.granted, est.prompt_tokens, ctx.limits.safety_factor,
                               choices=parsed.choices)


def refuse_before_reading(ctx: KeyContext) -> None:
    """Refusals decidable from the key alone: the /v1 views check them before reading the
    body, so nothing after (parsing, counting, admit) checks them again."""
    if ctx.request_rate_blocked():
        raise rate_limited("Your plan allows no requests at the moment.", 60)


def refuse_impossible(ctx: KeyContext, scopes: tuple[ScopeLimit, ...]) -> None:
    """A counter whose limit is 0 refuses every call (DESIGN.md: limit 0 rejects everything),
    whatever its size: refuse before the tokenizer runs, as the reserve would. Not under the
    fallback policy, whose other model may have counters that admit it; under the queue policy
    the refusal comes at once (waiting cannot help), with the counter's reason."""
    if ctx.limits.over_quota_policy == OverQuotaPolicy.FALLBACK:
        return
    for scope in scopes:
        # (an allotment tier or pool of 0 decides nothing alone: its chain's room may be more)
        if scope.limit == 0 and not scope.unit.tiered:
            # This process's clock, not Redis': only the Retry-After (the window's end) uses it.
            now_ms = int(time.time() * 1000)
            window = calendar_of(ctx.schedule).window(scope.window, now_ms)
            raise insufficient_quota(scope.scope, window_name(scope.window),
                                     _seconds_until(window.end_ms - now_ms), refusal=scope.reason)


async def estimated(parsed: ParsedBody, info: ModelInfo, ctx: KeyContext, price: Price) -> Estimate:
    """estimate(), off the event loop for a large body (gateway/tokens.py: off_loop)."""
    if is_large(parsed.size):
        return await off_loop(estimate, parsed, info, ctx, price)
    return estimate(parsed, info, ctx, price)


def refuse_unserved(runtime: GatewayRuntime, ctx: KeyContext, model: str,
                    endpoint: Endpoint = Endpoint.CHAT) -> None:
    """The key may not call the model (403), or no upstream this tenant may use serves it
    through this endpoint's API (an Anthropic model asked of /v1/chat/completions, say)."""
    if not allows(runtime, ctx, model):
        raise model_not_allowed(model)
    if not runtime.pool.serves(model, ctx.tenant_id, kind=provider_kind(endpoint)):
        raise not_found(f"The model '{model}' does not exist or no upstream serves it through "
                        f"this API (/v1/{endpoint.value}).")


def check(runtime: GatewayRuntime, ctx: KeyContext, parsed: ParsedBody) -> Checked:
    """The call's price, its counters and a refusal when one of them is 0, then its estimate:
    everything admit() needs before the reserve. Reads only immutable snapshots (the catalog,
    the key's context) and the context's memo of counters, so it may run on a thread."""
    catalog = runtime.catalog
    price = priced(runtime, parsed.model, parsed.endpoint)
    # Per-model limits count a dated snapshot under its catalog model (one model name).
    scopes = ctx.scopes(catalog.canonical(parsed.model))
    refuse_impossible(ctx, scopes)
    return Checked(parsed, scopes, estimate(parsed, catalog.resolve(parsed.model), ctx, price))


def parse_and_check(runtime: GatewayRuntime, ctx: KeyContext, endpoint: Endpoint,
                    raw: bytes) -> Checked:
    """Parse the body, refuse what memory can tell (cheapest first), count the prompt."""
    parsed = parse_body(endpoint, raw)
    refuse_unserved(runtime, ctx, parsed.model, endpoint)
    return check(runtime, ctx, parsed)


async def checked(runtime: GatewayRuntime, ctx: KeyContext, endpoint: Endpoint,
                  raw: bytes) -> Checked:
    """parse_and_check(): inline for a small body (the hand-off would cost more than the work),
    as one job on an estimation thread for a large one: json.loads and counting megabytes would
    hold the event loop, and every other call on this worker, for tens of milliseconds."""
    if is_large(len(raw)):
        return await off_loop(parse_and_check, runtime, ctx, endpoint, raw)
    return parse_and_check(runtime, ctx, endpoint, raw)


# A waiter's entry outlives its own deadline by this much before others may take it for dead:
# clocks and a last reserve in flight must not drop a waiter that is about to give up anyway.
_QUEUE_GRACE_MS = 1000


def queue_ticket(runtime: GatewayRuntime, ctx: KeyContext) -> QueueTicket | None:
    """What a call under the queue policy brings to reserve (None for other policies, and for a
    queue timeout of 0: nothing to wait for)."""
    limits = ctx.limits
    if limits.over_quota_policy != OverQuotaPolicy.QUEUE or limits.queue_timeout_seconds <= 0:
        return None
    bound = QUEUE_PRIORITY_BOUND - 1
    priority = max(-bound, min(bound, limits.queue_priority))
    deadline_ms = (runtime.engine.clock.now_ms() + limits.queue_timeout_seconds * 1000
                   + _QUEUE_GRACE_MS)
    return QueueTicket(priority, deadline_ms, settings.TOLLGATE_QUEUE_HEAD_LEASE_MS,
                       settings.TOLLGATE_QUEUE_MAX_WAITERS)


def queue_timed_out(timed_out: QueueTimedOut) -> GatewayError:
    """429 queue_timeout, naming what the call waited for, with that resource's Retry-After."""
    last = timed_out.last
    waited_s = timed_out.waited_ms / 1000
    if last.queue_resource is QueueResource.COUNTER and last.refused is not None:
        refused = last.refused
        what = f"the {refused.scope} {window_name(refused.window.kind)} quota"
        retry = _seconds_until(refused.window.end_ms - last.server_time_ms)
    elif last.queue_resource is QueueResource.BUCKET and last.refused_rate is not None:
        what = f"the request rate of {last.refused_rate.scope}"
        retry = _seconds_until(last.retry_after_ms)
    else:
        what = "a free slot of the concurrency limit"
        retry = 1
    return queue_timeout(what, waited_s, retry)


async def _wait_in_queue(runtime: GatewayRuntime, ctx: KeyContext, request: ReserveRequest,
                         first: Reservation, obs: Observation | None) -> Reservation:
    """Wait for a QUEUED call's turn (quotas/waiting.py); 429 queue_timeout when it does not
    come within the plan's queue timeout. The wait is marked in flight on the call's
    Observation: a client leaving meanwhile ends the call mid-wait (its admitted wait is
    counted from the reservation's queue_wait_ms by gateway/forward.py Call)."""
    timing = QueueTiming(float(ctx.limits.queue_timeout_seconds),
                         settings.TOLLGATE_QUEUE_HEAD_RETRY_MS,
                         settings.TOLLGATE_QUEUE_HEAD_LEASE_MS)
    if obs is not None:
        obs.queued_from = time.perf_counter()
    try:
        reservation = await wait_in_queue(runtime.engine, runtime.reserve, request, first,
                                          runtime.waiting, timing)
    except QueueTimedOut as timed_out:
        raise queue_timed_out(timed_out) from None
    if obs is not None:
        obs.queued_from = 0.0
    return reservation


def reserve_request(runtime: GatewayRuntime, ctx: KeyContext, call: Checked,
                    request_id: str) -> ReserveRequest:
    """What admit() reserves first: the call's worst case in every counter it touches, for the
    model it asked for."""
    parsed = call.parsed
    return _request(ctx, parsed, request_id, parsed.model, call.estimate, call.scopes,
                    queue_ticket(runtime, ctx))


async def admit(runtime: GatewayRuntime, ctx: KeyContext, call: Checked,
                request_id: str, obs: Observation | None = None,
                request: ReserveRequest | None = None,
                sent: SentReserve | None = None) -> Admission:
    """Reserve, or apply the plan's policy to a refusal; raises GatewayError (429). `obs`: the
    call's Observation, told about a wait in the queue. `request`: the first reserve's, made
    already (reserve_request); `sent`: that reserve already written (runtime.send_reserve),
    whose reply this waits for."""
    catalog = runtime.catalog
    parsed, scopes, est = call.parsed, call.scopes, call.estimate
    if request is None:
        request = reserve_request(runtime, ctx, call, request_id)
    # runtime.reserve: the engine's, plus the rebuild of counters Redis lost (503 until they are
    # back: nothing is admitted on an empty counter).
    reservation = await runtime.reserve(request, sent)
    if reservation.outcome is Outcome.QUEUE_FULL:
        raise queue_full(reservation.waiters)
    if reservation.outcome is Outcome.QUEUED:
        reservation = await _wait_in_queue(runtime, ctx, request, reservation, obs)
    if reservation.admitted:
        return Admission(reservation, parsed.model, est, _with_output_cap(est, reservation, parsed, ctx))
    if reservation.outcome is not Outcome.QUOTA:
        raise refusal_error(reservation)

    # Under the queue policy a quota refusal here is one waiting cannot help (a counter not
    # queueable, or a call that can never fit a counter: bigger than its limit plus credit):
    # it is answered at once, below.
    policy = ctx.limits.over_quota_policy
    if policy == OverQuotaPolicy.SOFT:
        percent = ctx.limits.soft_limit_percent
        ceiling = tuple(
            s if s.limit == UNLIMITED else replace(s, limit=s.limit * percent // 100)
            for s in request.limits)
        soft = await runtime.reserve(replace(request, limits=ceiling))
        if soft.admitted:
            return Admission(soft, parsed.model, est, _with_output_cap(est, soft, parsed, ctx),
                             soft=True)
    elif policy == OverQuotaPolicy.FALLBACK:
        target = ctx.limits.fallback_model
        # Not for a Responses call continuing a stored response: its hold includes the earlier
        # turns and it must go to the key storing them, which may not serve the other model.
        continues = parsed.context_ref is not None or parsed.conversation is not None
        if (target and target != parsed.model and not continues
                and allows(runtime, ctx, target)
                and runtime.pool.serves(target, ctx.tenant_id,
                                        kind=provider_kind(parsed.endpoint))
                and (fb_price := catalog.price(target,
                                               kind=provider_kind(parsed.endpoint))) is not None):
            fb_est = await estimated(parsed, catalog.resolve(target), ctx, fb_price)
            fb_request = _request(ctx, parsed, request_id, target, fb_est,
                                  ctx.scopes(catalog.canonical(target)))
            fb = await runtime.reserve(fb_request)
            if fb.admitted:
                return Admission(fb, target, fb_est, _with_output_cap(fb_est, fb, parsed, ctx),
                                 fallback_from=parsed.model)
            if fb.outcome is not Outcome.QUOTA:
                raise refusal_error(fb)
    raise refusal_error(reservation)
