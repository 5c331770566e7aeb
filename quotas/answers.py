"""What the gateway remembers of the answers an upstream stores for later turns (the Responses
API's stored responses and conversations): which provider key holds each, and how many tokens of
context it carries, in the tenant's slot (tg:{t<tenant>}:resp:<id>, tg:{t<tenant>}:conv:<id>).

A call continuing one (`previous_response_id`, `conversation`) makes the upstream re-send those
earlier turns as input the gateway never sees: its hold adds the remembered context size, and it
must go to the provider key that stores them. A response is only reachable through the tenant
that created it: the key is in that tenant's slot, so another tenant's lookup finds nothing. Its
owner is also kept outside the slots (tg:answer-owner:<kind>:<id>), so that a tenant allowed to
continue contexts the gateway has not seen still cannot continue another tenant's (`owner`).

Plain commands, not a script: each write is one hash with its expiry, written in one pipelined
round trip, and a stale read only holds for an older context size.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from quotas import keys
from quotas.engine import store_errors


class AnswerKind(StrEnum):
    RESPONSE = "response"
    CONVERSATION = "conversation"


@dataclass(frozen=True)
class StoredAnswer:
    provider_key_id: int
    context_tokens: int  # every token the next turn's upstream re-sends as input


def _key(tenant: str, kind: AnswerKind, answer_id: str) -> str:
    if kind is AnswerKind.RESPONSE:
        return keys.response_key(tenant, answer_id)
    return keys.conversation_key(tenant, answer_id)


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


async def recall(client: Any, tenant: str, kind: AnswerKind, answer_id: str) -> StoredAnswer | None:
    """The remembered answer, None when this tenant has none by that id (never made here, made
    by another tenant, expired or deleted)."""
    with store_errors():
        provider_key, tokens = await client.hmget(_key(tenant, kind, answer_id), ["pk", "tokens"])
    pk, count = _int(provider_key), _int(tokens)
    if pk is None or count is None:
        return None
    return StoredAnswer(pk, count)


async def owner(client: Any, kind: AnswerKind, answer_id: str) -> str | None:
    """The tenant whose call made this answer through the gateway, if any still remembers it."""
    with store_errors():
        value = await client.get(keys.answer_owner_key(kind.value, answer_id))
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


async def remember(client: Any, tenant: str, answers: list[tuple[AnswerKind, str]],
                   stored: StoredAnswer, ttl_s: int) -> None:
    """Remember each (kind, id) as `stored` for `ttl_s` seconds (each turn of a conversation
    remembers it again, so an active one never expires), with its owner (one pipelined round
    trip; on a cluster the owner keys live in other slots, sent in the same pipeline).

    A response's owner expires with it (the upstream keeps stored responses 30 days); a
    conversation's owner never does (the upstream keeps conversations until deleted), so no
    tenant can ever continue another's conversation, however long it sat idle."""
    pipe = client.pipeline(transaction=False)
    for kind, answer_id in answers:
        key = _key(tenant, kind, answer_id)
        pipe.hset(key, mapping={"pk": stored.provider_key_id, "tokens": stored.context_tokens})
        pipe.expire(key, ttl_s)
        owner_ttl = ttl_s if kind is AnswerKind.RESPONSE else None
        pipe.set(keys.answer_owner_key(kind.value, answer_id), tenant, ex=owner_ttl)
    with store_errors():
        await pipe.execute()


async def forget(client: Any, tenant: str, kind: AnswerKind, answer_id: str) -> None:
    """Forget an answer the upstream no longer has (deleted). Its owner record stays: nobody
    else may continue that id either."""
    with store_errors():
        await client.delete(_key(tenant, kind, answer_id))
