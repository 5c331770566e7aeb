"""One client process of the allotment race through HTTP (tests/gateway/test_e2e_allotment_race.py):
chat completions through the official openai SDK, streamed and not, with the keys of several
projects of one tenant, all fired at once. Spawned, so it imports nothing of Django."""
from __future__ import annotations

import asyncio
from multiprocessing.synchronize import Barrier
from typing import Any

import openai

# The shape test_e2e_race_apis.hold_of computes the hold of.
from tests.gateway.race_client import MAX_OUTPUT, PROMPT

# One call: (who: the project's name in the test, API key, streamed?)
Call = tuple[str, str, bool]
# One outcome: (status, prompt tokens, completion tokens, error code or None, who, streamed,
# x-request-id); the tokens are the usage the client itself received.
Outcome = tuple[int, int, int, str | None, str, bool, str]


async def _one(client: openai.AsyncOpenAI, model: str, who: str, stream: bool) -> Outcome:
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_OUTPUT,
            stream=stream, **extra)
    except openai.APIStatusError as exc:
        return (exc.status_code, 0, 0, exc.code, who, stream,
                exc.response.headers.get("x-request-id", ""))
    request_id = raw.headers.get("x-request-id", "")
    parsed = raw.parse()
    if not stream:
        usage = parsed.usage
    else:
        usage = None
        async for chunk in parsed:
            usage = chunk.usage or usage
        if usage is None:
            return (200, 0, 0, "stream without usage", who, stream, request_id)
    return (200, usage.prompt_tokens, usage.completion_tokens, None, who, stream, request_id)


async def _fire(base_url: str, model: str, calls: list[Call], barrier: Barrier, answered: Any,
                slot: int) -> list[Outcome]:
    clients = {key: openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                       timeout=180)
               for key in {c[1] for c in calls}}
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    done = 0

    async def one(who: str, key: str, stream: bool) -> Outcome:
        nonlocal done
        outcome = await _one(clients[key], model, who, stream)
        done += 1
        answered[slot] = done  # only this process writes its slot
        return outcome

    try:
        return await asyncio.gather(*(one(*call) for call in calls))
    finally:
        for client in clients.values():
            await client.close()


def run(base_url: str, model: str, calls: list[Call], barrier: Barrier, answered: Any,
        slot: int) -> list[Outcome]:
    """Fire every call at once (after the barrier) and report each outcome; `answered[slot]`
    counts this process's calls answered so far (a Manager list)."""
    return asyncio.run(_fire(base_url, model, calls, barrier, answered, slot))
