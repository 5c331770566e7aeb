"""Holding honestly for the turns a Responses API call does not send.

A call with `previous_response_id` or `conversation` makes the upstream add the earlier turns to
its input: tokens the gateway never sees in the body, billed all the same. The rule:

- Every stored response (and conversation) a call creates through the gateway is remembered with
  its context size, its usage's input plus output tokens (all of it is the next turn's input),
  and the provider key that stores it (quotas/answers.py), for TOLLGATE_RESPONSES_TTL_SECONDS.
- A call continuing one adds that size to its prompt estimate, so the hold covers it, and goes to
  that provider key only (no other key knows the id).
- A reference the gateway has not seen (made elsewhere, expired here, or another tenant's) is
  refused with a 400 before anything is held, unless the tenant's plan names an explicit context
  allowance (`responses_context_allowance_tokens`): then that many tokens are held for it and any
  provider key of the kind may serve it. Never for another tenant's stored response: the
  gateway remembers who made each (quotas/answers.py `owner`), and refuses it as unseen.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from django.conf import settings

from gateway.admission import Checked, least_output
from gateway.auth import KeyContext
from gateway.bodies import Endpoint, ParsedBody
from gateway.catalog import reservation_tokens
from gateway.errors import GatewayError, bad_request
from gateway.runtime import GatewayRuntime
from gateway.usage import Usage
from quotas.answers import AnswerKind, StoredAnswer, owner, recall, remember
from quotas.engine import QuotaStoreUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    tokens: int  # held on top of the call's own prompt
    pinned: int | None  # the provider key that stores it; None: any key (an allowance)


def _reference(parsed: ParsedBody) -> tuple[AnswerKind, str, str] | None:
    """(kind, id, the request's field) of what the call continues, if anything."""
    if parsed.context_ref:
        return AnswerKind.RESPONSE, parsed.context_ref, "previous_response_id"
    if parsed.conversation:
        return AnswerKind.CONVERSATION, parsed.conversation, "conversation"
    return None


def unseen_reference(field: str, answer_id: str) -> GatewayError:
    noun = "response" if field == "previous_response_id" else "conversation"
    return bad_request(
        f"The {noun} '{answer_id}' was not made through this gateway with your API keys (or it "
        f"has expired here), so the earlier turns it adds to the input cannot be held for. Send "
        "the earlier turns in 'input' instead, or ask your administrator for a context allowance.",
        field, f"{noun}_not_found" if noun == "conversation" else "previous_response_not_found")


async def held_context(runtime: GatewayRuntime, ctx: KeyContext,
                       parsed: ParsedBody) -> Context | None:
    """What a Responses call continuing an earlier response must hold for it (one Redis read,
    only for such calls); None for a call that continues nothing."""
    reference = _reference(parsed) if parsed.endpoint is Endpoint.RESPONSES else None
    if reference is None:
        return None
    kind, answer_id, field = reference
    try:
        stored = await recall(runtime.engine.client, ctx.tenant_tag, kind, answer_id)
    except QuotaStoreUnavailable:
        if not settings.GATEWAY_FAIL_OPEN:
            raise  # 503 quota_store_unavailable, like every call while Redis is away
        # Fail-open: the call goes on unmetered (the reserve fails the same way), to any key of
        # its kind; one that does not store the response answers the upstream's own error.
        log.error("FAIL-OPEN: the earlier turns of %s cannot be looked up (quota store "
                  "unreachable)", answer_id[:64])
        return None
    if stored is not None:
        return Context(stored.context_tokens, stored.provider_key_id)
    allowance = ctx.limits.responses_context_allowance_tokens
    if allowance is None:
        raise unseen_reference(field, answer_id)
    made_by = await owner(runtime.engine.client, kind, answer_id)
    if made_by is not None and made_by != ctx.tenant_tag:
        # Another tenant's response, on a provider key they may share: the allowance is for
        # contexts made outside the gateway, never for continuing someone else's. The same
        # answer as for an unknown id, so nothing tells the caller it exists.
        raise unseen_reference(field, answer_id)
    return Context(allowance, None)


def with_context(checked: Checked, context: Context, ctx: KeyContext) -> Checked:
    """The call's estimate with the earlier turns added to its prompt (the output cap kept,
    within what the context window leaves)."""
    est, parsed = checked.estimate, checked.parsed
    prompt = est.prompt_tokens + context.tokens
    amount, cap = reservation_tokens(prompt, parsed.max_output, est.info,
                                     ctx.limits.safety_factor, choices=parsed.choices)
    if cap < least_output(parsed):
        raise bad_request(
            f"This model's maximum context length is {est.info.context_window} tokens; with the "
            f"earlier turns ({context.tokens} tokens) your request has about {prompt} input "
            "tokens, which leaves no room for an answer.",
            "previous_response_id" if parsed.context_ref else "conversation",
            "context_length_exceeded")
    return replace(checked, estimate=replace(est, prompt_tokens=prompt, amount=amount,
                                             output_cap=cap))


async def remember_answer(runtime: GatewayRuntime, ctx: KeyContext, parsed: ParsedBody,
                          response_id: str | None, provider_key_id: int | None,
                          usage: Usage) -> None:
    """Remember a stored response (and the conversation it extends) for the next turn. Never
    raises: a response not remembered is refused as unseen later, which the client can retry
    with the turns in its input."""
    if parsed.endpoint is not Endpoint.RESPONSES or not parsed.store:
        return
    if response_id is None or provider_key_id is None:
        return
    answers = [(AnswerKind.RESPONSE, response_id)]
    if parsed.conversation:
        answers.append((AnswerKind.CONVERSATION, parsed.conversation))
    try:
        await remember(runtime.engine.client, ctx.tenant_tag, answers,
                       StoredAnswer(provider_key_id, usage.total),
                       settings.TOLLGATE_RESPONSES_TTL_SECONDS)
    except ValueError:
        log.warning("response id %r from the upstream is not a valid id; not remembered",
                    response_id[:64])
    except Exception as exc:  # noqa: BLE001 - the call is answered and charged already
        log.warning("response %s not remembered (%s): a call continuing it will be refused as "
                    "unseen", response_id[:64], type(exc).__name__)
