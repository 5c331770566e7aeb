"""Benchmark: what hostile traffic does to other tenants' small calls on the same gateway worker.

    python -m config.bench_abuse [--duration 5] [--clients 8] [--abusers 2] [--prompt-kb 400]
                                 [--flood-clients 32] [--sizes-kb 1 4 16 32 64 256]

Starts what `config/bench.py` starts, with its helpers (embedded Redis and PostgreSQL in a
temporary directory, the mock upstream, one gateway worker: uvicorn, uvloop, every check on),
the gateway trusting X-Forwarded-For from loopback (`TOLLGATE_TRUSTED_PROXIES`, as behind a
reverse proxy), then measures one tenant's small chat completions (`--clients` keep-alive
connections, back to back, sent without X-Forwarded-For) in four scenarios, each for
`--duration` seconds:

- alone;
- beside a stream of large prompts (`--abusers` connections from another tenant, each sending
  a `--prompt-kb` KB prompt, back to back): each one is parsed, token-counted and forwarded;
- beside a flood of random well-formed `tgk_` keys from one client address (`--flood-clients`
  connections, a new random key every request): after the per-address lookup bucket's burst,
  each one is a 429 with no database query;
- beside the same flood from a new client address on every request, so no per-address bucket
  ever fills and only the negative cache and the database stand between the flood and the
  small calls.

Printed per scenario: the small calls' requests per second and p50 / p90 / p99 latency; the
abusive requests' answers per second by status; the database transactions per abusive request
(the small calls make none: their key is cached; the `alone` row shows the baseline). Then, in
this process, the cost of parsing and counting a chat body inline by size against handing it to
a thread (the figures behind GATEWAY_ESTIMATE_THREAD_BYTES). Figures only; nothing is asserted
(docs/benchmarks.md, "Abuse").
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from config.bench import (
    Result,
    _load,
    _read_response,
    _request_bytes,
    _server_counters,
    running_system,
)

# The flood's one address when it does not rotate (TEST-NET-2, documentation only).
_FLOOD_ADDRESS = "198.51.100.1"


@dataclass(frozen=True)
class Abuse:
    """One kind of hostile traffic: `connections` clients, each sending `make_request()` back
    to back until the small calls are measured."""

    name: str
    connections: int
    make_request: Callable[[], bytes]


@dataclass(frozen=True)
class Outcome:
    small: Result
    abusive_statuses: Counter[int]
    abusive_seconds: float
    db_xacts: int

    @property
    def abusive(self) -> int:
        return sum(self.abusive_statuses.values())


def _random_key() -> str:
    """A well-formed API key that exists nowhere."""
    from tenants.api_key_format import generate_key

    return generate_key()[0]


def _rotating_addresses() -> Callable[[], str]:
    """A new client address on each call (10.0.0.1, 10.0.0.2, ...)."""
    numbers = itertools.count(1)

    def next_address() -> str:
        n = next(numbers)
        return f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"

    return next_address


async def _abuser(port: int, make_request: Callable[[], bytes], stop: asyncio.Event,
                  statuses: Counter[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            writer.write(make_request())
            head = await _read_response(reader)
            statuses[int(head[9:12])] += 1
    finally:
        writer.close()


async def _scenario(port: int, small: bytes, clients: int, seconds: float,
                    abuse: Abuse | None) -> tuple[Result, Counter[int], float]:
    stop = asyncio.Event()
    statuses: Counter[int] = Counter()
    started = time.monotonic()
    background = [asyncio.create_task(_abuser(port, abuse.make_request, stop, statuses))
                  for _ in range(abuse.connections if abuse is not None else 0)]
    if background:
        await asyncio.sleep(0.5)  # the abuse is under way before the measurement starts
    result = await _load(port, small, clients, seconds)
    stop.set()
    await asyncio.gather(*background)
    return result, statuses, time.monotonic() - started


def scenario(port: int, small: bytes, clients: int, seconds: float,
             abuse: Abuse | None) -> Outcome:
    """Measure the small calls beside `abuse`, and the database transactions meanwhile."""
    import uvloop

    before = _server_counters()
    result, statuses, abusive_seconds = uvloop.run(
        _scenario(port, small, clients, seconds, abuse))
    after = _server_counters()
    return Outcome(result, statuses, abusive_seconds, after["db_xacts"] - before["db_xacts"])


def _print_outcome(name: str, outcome: Outcome) -> None:
    small = outcome.small
    by_status = ", ".join(f"{status}: {count / outcome.abusive_seconds:.0f}"
                          for status, count in sorted(outcome.abusive_statuses.items())) or "-"
    xacts = (f"{outcome.db_xacts / outcome.abusive:.2f} per abusive request" if outcome.abusive
             else f"{outcome.db_xacts} in all")
    print(f"{name:<30} {small.rps:>7.0f} {small.pct(50):>7.2f} {small.pct(90):>7.2f} "
          f"{small.pct(99):>7.2f}   {by_status}; DB xacts: {xacts}")


def estimation_costs(sizes_kb: list[int], repeats: int = 20) -> None:
    """Parsing and counting a chat body of each size inline, against the same work handed to
    an estimation thread and awaited (what a large /v1 body costs its own call either way)."""
    from gateway.bodies import Endpoint, parse_body
    from gateway.tokens import estimate_chat_prompt, off_loop

    def work(raw: bytes) -> int:
        parsed = parse_body(Endpoint.CHAT, raw)
        return estimate_chat_prompt(parsed.body["messages"], model="gpt-4o-mini",
                                    tokenizer="o200k_base")

    async def threaded(raw: bytes) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            await off_loop(work, raw)
        return (time.perf_counter() - started) / repeats

    print()
    print(f"{'body KB':>8} {'inline ms':>10} {'thread ms':>10} {'hand-off ms':>12}")
    for kb in sizes_kb:
        raw = json.dumps({"model": "gpt-4o-mini",
                          "messages": [{"role": "user", "content": _words(kb * 1024)}]}).encode()
        work(raw)  # warm: the encoding is loaded once
        started = time.perf_counter()
        for _ in range(repeats):
            work(raw)
        inline = (time.perf_counter() - started) / repeats
        thread = asyncio.run(threaded(raw))
        print(f"{kb:>8} {inline * 1000:>10.3f} {thread * 1000:>10.3f} "
              f"{(thread - inline) * 1000:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench_abuse",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    parser.add_argument("--clients", type=int, default=8, help="small-call connections")
    parser.add_argument("--abusers", type=int, default=2,
                        help="connections sending large prompts")
    parser.add_argument("--prompt-kb", type=int, default=400, help="size of a large prompt")
    parser.add_argument("--flood-clients", type=int, default=32,
                        help="connections sending random keys")
    parser.add_argument("--sizes-kb", type=int, nargs="*", default=[1, 4, 16, 32, 64, 256],
                        help="body sizes for the inline / thread cost table (none: skip it)")
    parser.add_argument("--gateway-port", type=int, default=18100)
    parser.add_argument("--mock-port", type=int, default=18199)
    args = parser.parse_args(argv)

    with running_system("tgba-", args.gateway_port, args.mock_port,
                        extra_env={"TOLLGATE_TRUSTED_PROXIES": "127.0.0.1/32"}) as (_, small_key):
        large = _request_bytes(_abusing_tenant_key(), False,
                               content=_words(args.prompt_kb * 1024))
        next_address = _rotating_addresses()
        abuses = [
            Abuse(f"beside {args.prompt_kb} KB prompts", args.abusers, lambda: large),
            Abuse("beside random keys, 1 address", args.flood_clients,
                  lambda: _request_bytes(_random_key(), False, forwarded_for=_FLOOD_ADDRESS)),
            Abuse("beside random keys, rotating", args.flood_clients,
                  lambda: _request_bytes(_random_key(), False, forwarded_for=next_address())),
        ]
        small = _request_bytes(small_key, False)
        port = args.gateway_port
        scenario(port, small, 4, 1.0, Abuse("warm-up", 1, lambda: large))  # both tenants' keys
        print(f"one gateway worker; {args.clients} small-call clients; {args.abusers} "
              f"large-prompt / {args.flood_clients} random-key connections; "
              f"{args.duration:g} s per scenario")
        print(f"{'small calls':<30} {'req/s':>7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}   "
              f"abusive answers/s by status; DB transactions")
        _print_outcome("alone", scenario(port, small, args.clients, args.duration, None))
        for abuse in abuses:
            _print_outcome(abuse.name,
                           scenario(port, small, args.clients, args.duration, abuse))
        if args.sizes_kb:
            estimation_costs(args.sizes_kb)
    return 0


def _abusing_tenant_key() -> str:
    """A second tenant's key with limits far from binding, so every large prompt is counted."""
    from tenants.services import create_project, create_tenant, issue_key

    abuser = create_tenant("abuser", plan_name="enterprise", actor="bench",
                           requests_per_second=1_000_000, tokens_per_minute=10**12,
                           monthly_token_budget=10**13)
    return issue_key(create_project(abuser, "big", actor="bench"), actor="bench",
                     requests_per_minute=10**8, max_concurrency=10_000).plaintext


def _words(size: int) -> str:
    """`size` characters of plain prose."""
    return ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


if __name__ == "__main__":
    sys.exit(main())
