"""One client process of the HTTP race: fire N concurrent chat completions (run) or requests of
any API shape (run_specs: chat completions, responses, messages, streamed or not) at the gateway
and report each outcome. Spawned, so it imports nothing of Django."""
from __future__ import annotations

import asyncio
import json
from multiprocessing.synchronize import Barrier
from typing import Any

import httpx


async def _fire(base_url: str, key: str, model: str, n: int, barrier: Barrier) -> list[tuple]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
        body = {"model": model, "messages": [{"role": "user", "content": "race"}],
                "max_tokens": 10}
        headers = {"Authorization": f"Bearer {key}"}
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

        async def one() -> tuple:
            response = await client.post("/chat/completions", json=body, headers=headers)
            try:
                data = response.json()
            except ValueError:
                return (response.status_code, 0, f"not json: {response.text[:200]}")
            if response.status_code == 200:
                return (200, data["usage"]["total_tokens"], None)
            return (response.status_code, 0, data["error"]["code"])

        return await asyncio.gather(*(one() for _ in range(n)))


def run(base_url: str, key: str, model: str, n: int, barrier: Barrier) -> list[tuple]:
    return asyncio.run(_fire(base_url, key, model, n, barrier))


# -- request shapes for the other APIs (tests/gateway/test_e2e_race_apis.py) ---------------------

# One request of a mixed race: (endpoint, model, stream). Endpoints: "chat" (/chat/completions),
# "responses" (/responses), "messages" (/messages, Anthropic's API with x-api-key).
Spec = tuple[str, str, bool]
# The prompt and the output cap every shape sends, so a test can compute each shape's hold.
PROMPT = "race to the finish line"
MAX_OUTPUT = 10
ANTHROPIC_VERSION = "2023-06-01"
# One client's outcome per request: (status, input tokens, output tokens, error code (OpenAI's
# `code`, Anthropic's error `type`) or None, endpoint, stream, x-request-id). The tokens are the
# usage the client itself received: the answer's, or a stream's final figures.
Outcome = tuple[int, int, int, str | None, str, bool, str]


def request_for(spec: Spec, key: str) -> tuple[str, dict, dict[str, str]]:
    """(path, JSON body, headers) of one request of this shape."""
    endpoint, model, stream = spec
    if endpoint == "chat":
        body: dict = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": MAX_OUTPUT}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return "/chat/completions", body, {"Authorization": f"Bearer {key}"}
    if endpoint == "responses":
        body = {"model": model, "input": PROMPT, "max_output_tokens": MAX_OUTPUT}
        if stream:
            body["stream"] = True
        return "/responses", body, {"Authorization": f"Bearer {key}"}
    if endpoint == "messages":
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": MAX_OUTPUT}
        if stream:
            body["stream"] = True
        return "/messages", body, {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}
    raise ValueError(f"unknown endpoint {endpoint!r}")


def _answer_usage(endpoint: str, data: dict) -> tuple[int, int]:
    """(input, output) of a whole answer, each API's usage read as its SDK would."""
    usage = data.get("usage") or {}
    if endpoint == "chat":
        return usage["prompt_tokens"], usage["completion_tokens"]
    if endpoint == "responses":
        return usage["input_tokens"], usage["output_tokens"]
    # Anthropic's input_tokens exclude cache reads and writes: the input is their sum.
    return (usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
            + (usage.get("cache_creation_input_tokens") or 0)), usage["output_tokens"]


def _stream_usage(endpoint: str, events: list[dict]) -> tuple[int, int]:
    """(input, output) from a stream's events: the usage chunk (chat), the terminal event
    (responses), message_start's input side and the last message_delta (messages)."""
    if endpoint == "chat":
        [final] = [e for e in events if e.get("usage")]
        return _answer_usage("chat", final)
    if endpoint == "responses":
        terminal = [e for e in events if e.get("type") in
                    ("response.completed", "response.incomplete", "response.failed")]
        return _answer_usage("responses", terminal[-1]["response"])
    [start] = [e for e in events if e.get("type") == "message_start"]
    deltas = [e for e in events if e.get("type") == "message_delta"]
    start_in, _ = _answer_usage("messages", start["message"])
    return start_in, deltas[-1]["usage"]["output_tokens"]


def _error_code(data: dict) -> str | None:
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    return error.get("code") if data.get("type") != "error" else error.get("type")


async def _one_of(client: httpx.AsyncClient, spec: Spec, key: str) -> Outcome:
    endpoint, _, stream = spec
    path, body, headers = request_for(spec, key)
    async with client.stream("POST", path, json=body, headers=headers) as response:
        raw = await response.aread() if not (stream and response.status_code == 200) else b""
        request_id = response.headers.get("x-request-id", "")
        if response.status_code != 200 or not stream:
            try:
                data = json.loads(raw)
            except ValueError:
                return (response.status_code, 0, 0, f"not json: {raw[:200]!r}", endpoint, stream,
                        request_id)
            if response.status_code != 200:
                return (response.status_code, 0, 0, _error_code(data), endpoint, stream,
                        request_id)
            return (200, *_answer_usage(endpoint, data), None, endpoint, stream, request_id)
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
        try:
            tokens = _stream_usage(endpoint, events)
        except (KeyError, IndexError, ValueError) as exc:
            return (200, 0, 0, f"stream without usage: {exc!r}", endpoint, stream, request_id)
        return (200, *tokens, None, endpoint, stream, request_id)


async def _fire_specs(base_url: str, key: str, specs: list[Spec], barrier: Barrier,
                      answered: Any, slot: int) -> list[Outcome]:
    n = len(specs)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        done = 0

        async def one(spec: Spec) -> Outcome:
            nonlocal done
            outcome = await _one_of(client, spec, key)
            done += 1
            # Only this process writes its slot: the test sums the slots to know how many
            # requests have their answer (the refused ones, while the upstream is frozen).
            answered[slot] = done
            return outcome

        return await asyncio.gather(*(one(spec) for spec in specs))


def run_specs(base_url: str, key: str, specs: list[Spec], barrier: Barrier, answered: Any,
              slot: int) -> list[Outcome]:
    """Fire every request of `specs` at once (after the barrier) and report each outcome;
    `answered[slot]` counts this process's requests answered so far (a Manager list)."""
    return asyncio.run(_fire_specs(base_url, key, specs, barrier, answered, slot))


async def _fire_spread(base_urls: list[str], key: str, specs: list[Spec], barrier: Barrier,
                       answered: Any, slot: int) -> list[Outcome]:
    per_host = -(-len(specs) // len(base_urls))
    limits = httpx.Limits(max_connections=per_host, max_keepalive_connections=per_host)
    clients = [httpx.AsyncClient(base_url=url, limits=limits, timeout=120) for url in base_urls]
    try:
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        done = 0

        async def one(index: int, spec: Spec) -> Outcome:
            nonlocal done
            outcome = await _one_of(clients[(index + slot) % len(clients)], spec, key)
            done += 1
            answered[slot] = done
            return outcome

        return await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
    finally:
        for client in clients:
            await client.aclose()


def run_specs_spread(base_urls: list[str], key: str, specs: list[Spec], barrier: Barrier,
                     answered: Any, slot: int) -> list[Outcome]:
    """run_specs over several gateway hosts: request i goes to host (i + slot) % len(base_urls),
    as a round-robin load balancer in front of them would send it."""
    return asyncio.run(_fire_spread(base_urls, key, specs, barrier, answered, slot))
