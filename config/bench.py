"""Benchmark: the same load sent directly to the mock upstream and through the gateway, in one run.

    python -m config.bench [--duration 5] [--concurrency 1 32] [--gateway-workers 1]
                           [--modes plain stream responses messages responses-chain long queue]

A config module, like config/serve.py, because it runs the whole system: it starts its own
embedded Redis and PostgreSQL (config/embedded.py, in a temporary directory), the mock upstream
(one worker) and the gateway (uvicorn, `--gateway-workers`, every check on: API key auth,
token estimation, the reserve script with tenant / project / key / model quotas, a monthly
budget, tokens per minute, request-rate buckets and a concurrency cap, then settle with the
usage event), and drives both with a minimal keep-alive HTTP/1.1 client on raw asyncio streams
(an HTTP library in the load generator would measure itself, not the servers).

The gateway runs with its request metrics on, as `make up` (config/serve.py) runs it: each
gateway the bench starts gets PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode), an
empty directory of its own in the run's temporary one, so every figure below includes what the
metrics cost its workers (their tally, and its writes to the directory's files).

Printed per scenario (non-streaming and streaming, each concurrency level): requests per second,
p50 / p90 / p99 latency, direct and through the gateway, and the latency the gateway adds. Then,
per kind of call through the gateway: Redis commands per request (INFO commandstats, which
counts the commands the scripts run too), round trips and the EVALSHA calls among them (below),
database transactions per request
(pg_stat_database) and the gateway worker's CPU per request; and its peak RSS. The kinds: short
non-streamed and streamed calls (done well within GATEWAY_CHECKPOINT_SECONDS: reserve and settle
only), and streams that last `--long-seconds` (`long`: the mock's chunk delay spread over the
stream), so their holds get a progress checkpoint every GATEWAY_CHECKPOINT_SECONDS.

The Responses and Messages APIs (`responses`, `messages` modes): the same measurements with the
same 16-token answer, non-streamed and streamed, as `POST /v1/responses` (`input` a string,
`max_output_tokens`) and `POST /v1/messages` (`max_tokens`, `x-api-key` and `anthropic-version`,
served by an anthropic-kind provider key on the same mock). Every stored response costs the
gateway one more write (the remember, one pipelined round trip); `responses-chain` makes each call
continue the previous answer of its client connection (`previous_response_id`), which costs one
more read (the recall) before the reserve. A connection starts a new chain after
`--chain-length` calls, so the context each call continues stays far below the model's window.
Round trips are counted by Redis (INFO stats `total_reads_processed`: one read event per request
or pipeline the server receives; the gateway's background work and the bench's own INFO calls add
a handful per measurement), beside the EVALSHA calls among them.

Then the queue (`queue` mode): a tenant of the standard plan (over-quota policy "queue") whose key
allows one call in flight; one long call holds it while `--queue-waiters` calls wait in the queue.
Printed: Redis round trips (EVALSHA) and commands per waiter per second while they wait, and the
latency of a queued admission after a wake (the gap between consecutive calls ending, each
admitted by the previous one's settle, minus an unqueued call's median latency), p50/p90/p99.

Then the upstream transports (`transports` mode): one more gateway per transport named by
`--transports` (GATEWAY_UPSTREAM_TRANSPORT: native, aiohttp, httpx; one worker each, same
services, tenant and mock), and the same short plain and streamed chat calls through each at each
`--transport-concurrency` level (and streams paced as a model sends tokens: a millisecond
between events), the transports in turn, `--transport-rounds` times (each round
starts with another transport, so none always goes first). Printed per round: req/s, p50 / p99
and the latency added over the mock's (measured directly in the same round), the worker's CPU per
request (its process CPU time / requests: what the machine's other load changes least) and its
ratio to the native transport's in the same round; then the spread of each over the rounds.

`--cpu-awake` keeps the machine's CPUs out of their idle states for the run (a PM QoS request:
/dev/cpu_dma_latency held at 0, which needs root). On a virtual machine whose idle driver halts
the vCPU (haltpoll), every wake-up of a halted vCPU is slow and finds cold caches; at one client
the gateway waits five times per call (for the request, the reserve, the upstream, the settle and
the next request), and on the 2-core machine of docs/benchmarks.md that added about 0.5 ms to
each call and 0.3 ms to the worker's CPU. The first line printed says which state the run had,
so two runs are compared only in the same one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gateway.upstream_http import TRANSPORTS  # no Django: importable before settings are set

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Result:
    requests: int
    seconds: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000


OUTPUT_TOKENS = 16  # per bench call (max_tokens): the mock streams one chunk per token
PROMPT = "hello there, how are you today?"  # the user turn of every bench call
CHAT_MODEL = "gpt-4o-mini"
# A model of the Messages API: served by the anthropic-kind key (priced by the catalog when it
# lists it, else by that key's default price).
MESSAGES_MODEL = "claude-haiku-4-5"
ANTHROPIC_VERSION = "2023-06-01"
# The secrets the mock sees: faults and its bill are per key, and the direct calls use the same.
MOCK_SECRET = "sk-bench"
ANTHROPIC_MOCK_SECRET = "sk-bench-anthropic"


class Api(StrEnum):
    """The client APIs the bench speaks."""

    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"


_PATHS = {Api.CHAT: b"/v1/chat/completions", Api.RESPONSES: b"/v1/responses",
          Api.MESSAGES: b"/v1/messages"}


def request_body(api: Api, stream: bool, model: str, content: str,
                 previous_response_id: str | None) -> dict[str, Any]:
    """The same short call in each API: one user turn, an answer capped at OUTPUT_TOKENS."""
    body: dict[str, Any]
    if api is Api.RESPONSES:
        body = {"model": model, "max_output_tokens": OUTPUT_TOKENS, "input": content}
        if previous_response_id is not None:
            body["previous_response_id"] = previous_response_id
    else:
        body = {"model": model, "max_tokens": OUTPUT_TOKENS,
                "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    return body


def _request_bytes(key: str, stream: bool, model: str = CHAT_MODEL,
                   content: str = PROMPT,
                   forwarded_for: str | None = None, *, api: Api = Api.CHAT,
                   previous_response_id: str | None = None) -> bytes:
    """One keep-alive request of `api` (a chat completion by default); `forwarded_for` adds an
    X-Forwarded-For hop (the gateway believes it only when the bench trusts loopback as a
    proxy). The Messages API authenticates as the anthropic SDK does (x-api-key plus
    anthropic-version); the others with a bearer key."""
    if previous_response_id is not None and api is not Api.RESPONSES:
        raise ValueError("previous_response_id belongs to the Responses API")
    payload = json.dumps(request_body(api, stream, model, content, previous_response_id)).encode()
    forwarded = (b"X-Forwarded-For: " + forwarded_for.encode() + b"\r\n"
                 if forwarded_for is not None else b"")
    auth = (b"x-api-key: " + key.encode() + b"\r\nanthropic-version: "
            + ANTHROPIC_VERSION.encode() + b"\r\n" if api is Api.MESSAGES
            else b"Authorization: Bearer " + key.encode() + b"\r\n")
    return (b"POST " + _PATHS[api] + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + forwarded
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload)


# A Responses API answer's id, the first in its body or stream (response.created carries it);
# `"previous_response_id"` never matches, the character before its `id"` being `_`.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')


class ResponsesChain:
    """The requests of one client connection in the chain mode: each continues the answer to
    the previous one (`previous_response_id`), and every `length` calls a new chain starts
    (the context each turn continues grows by the whole previous turn)."""

    def __init__(self, key: str, stream: bool, model: str, length: int) -> None:
        if length < 1:
            raise ValueError("a chain has at least one call")
        self.key, self.stream, self.model, self.length = key, stream, model, length
        self.turn = 0  # calls made in the current chain
        self.calls = 0
        self.continued = 0  # calls that named a previous response

    def __call__(self, answer: bytes | None) -> bytes:
        """The next request, given the body of the answer to the last one (None at first)."""
        previous: str | None = None
        if answer is not None and self.turn < self.length:
            found = _RESPONSE_ID.search(answer)
            if found is None:
                raise RuntimeError(f"no response id in the answer: {answer[:200]!r}")
            previous = found.group(1).decode()
        else:
            self.turn = 0
        self.turn += 1
        self.calls += 1
        self.continued += previous is not None
        return _request_bytes(self.key, self.stream, self.model, api=Api.RESPONSES,
                              previous_response_id=previous)


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """Read one whole HTTP/1.1 response (chunked or sized) and return its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        await reader.readuntil(b"\r\n0\r\n\r\n")
    else:
        start = lower.index(b"content-length: ") + 16
        await reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
    return head


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """Read one whole HTTP/1.1 response and return its head and its body, de-chunked (only
    where the body is needed: this costs the load generator more than `_read_response`)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:
        start = lower.index(b"content-length: ") + 16
        return head, await reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the empty line after the last chunk (no trailers)
            return head, b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])


# A client's requests: the same bytes every time, or a factory giving each connection a function
# from the previous answer's body (None at first) to the next request.
NextRequest = Callable[[bytes | None], bytes]
Requests = bytes | Callable[[], NextRequest]


async def _client(port: int, request: bytes | NextRequest, deadline: float,
                  latencies: list[float], min_calls: int = 0) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer: bytes | None = None
    calls = 0
    try:
        while time.monotonic() < deadline or calls < min_calls:
            calls += 1
            payload = request if isinstance(request, bytes) else request(answer)
            started = time.perf_counter()
            writer.write(payload)
            if isinstance(request, bytes):
                head = await _read_response(reader)
            else:
                head, answer = await _read_answer(reader)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer: {head[:200]!r}")
            latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


async def _load(port: int, request: Requests, concurrency: int, seconds: float,
                min_calls: int = 0) -> Result:
    latencies: list[float] = []
    started = time.monotonic()
    await asyncio.gather(*(_client(port, request if isinstance(request, bytes) else request(),
                                   started + seconds, latencies, min_calls)
                           for _ in range(concurrency)))
    return Result(len(latencies), time.monotonic() - started, latencies)


def load(port: int, key: str, stream: bool, concurrency: int, seconds: float,
         model: str = CHAT_MODEL, *, api: Api = Api.CHAT,
         chains: list[ResponsesChain] | None = None, chain_length: int = 0,
         min_calls: int = 0) -> Result:
    """`concurrency` keep-alive clients sending `api` calls back to back for `seconds`, each
    client going on past that until it has sent `min_calls` (a test that needs a chain to
    continue must not depend on how fast a loaded machine answers). With `chain_length`,
    Responses calls in chains (ResponsesChain), one per client, each appended to `chains` when
    given."""
    import uvloop

    if not chain_length:
        return uvloop.run(_load(port, _request_bytes(key, stream, model, api=api), concurrency,
                                seconds, min_calls))

    def one_chain() -> NextRequest:
        chain = ResponsesChain(key, stream, model, chain_length)
        if chains is not None:
            chains.append(chain)
        return chain

    return uvloop.run(_load(port, one_chain, concurrency, seconds, min_calls))


@dataclass
class Work:
    """What the gateway spent on one kind of call: requests, Redis commands, round trips (the
    server's read events) and the EVALSHA calls among them, database transactions and the
    worker's CPU seconds."""

    requests: int = 0
    redis_calls: int = 0
    redis_reads: int = 0
    evalsha: int = 0
    evalsha_usec: int = 0
    db_xacts: int = 0
    cpu_s: float = 0.0

    def add(self, requests: int, before: dict[str, Any], after: dict[str, Any],
            cpu_s: float) -> None:
        self.requests += requests
        self.redis_calls += after["redis_calls"] - before["redis_calls"]
        self.redis_reads += after["redis_reads"] - before["redis_reads"]
        self.evalsha += after["evalsha"] - before["evalsha"]
        self.evalsha_usec += after["evalsha_usec"] - before["evalsha_usec"]
        self.db_xacts += after["db_xacts"] - before["db_xacts"]
        self.cpu_s += cpu_s


def measured(gateway_pid: int, work: Work, run: Callable[[], Result]) -> Result:
    """Run one load through the gateway and add what it cost to `work`."""
    before, cpu_before = _server_counters(), cpu_seconds(gateway_pid)
    result = run()
    work.add(result.requests, before, _server_counters(), cpu_seconds(gateway_pid) - cpu_before)
    return result


def _wait_http(url: str, process: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: server exited")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url}: server did not start")


def soak(port: int, key: str, parent_pid: int, seconds: float) -> None:
    """A long run at steady load: the worker's memory must stay flat (DESIGN.md section 10)."""
    print()
    print(f"{'soak s':>7} {'requests':>9} {'RSS MB':>8}")
    started, served, stream = time.monotonic(), 0, False
    while time.monotonic() - started < seconds:
        served += load(port, key, stream, 16, 10.0).requests
        stream = not stream
        print(f"{time.monotonic() - started:>7.0f} {served:>9} {_rss_mb(parent_pid):>8.1f}")


def _worker_pids(parent_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()] or [parent_pid]


def _rss_mb(parent_pid: int, field: str = "VmRSS:") -> float:
    largest = 0
    for pid in _worker_pids(parent_pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                largest = max(largest, int(line.split()[1]))
    return largest / 1024


def cpu_seconds(parent_pid: int) -> float:
    """User + system CPU time used so far by a server's worker processes: the children of
    `parent_pid` (uvicorn's with --workers), or the process itself when it has none."""
    ticks = 0
    for pid in _worker_pids(parent_pid):
        # Fields 14 and 15 of /proc/<pid>/stat, counted after the parenthesised command name.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(parent_pid: int) -> float:
    return _rss_mb(parent_pid, "VmHWM:")


MODES = ["plain", "stream", "responses", "messages", "responses-chain", "long", "queue",
         "transports"]


@dataclass(frozen=True)
class Scenario:
    """One kind of short call, measured direct and through the gateway at each level."""

    name: str
    api: Api
    stream: bool
    chain: bool = False

    @property
    def model(self) -> str:
        return MESSAGES_MODEL if self.api is Api.MESSAGES else CHAT_MODEL

    @property
    def mock_secret(self) -> str:
        return ANTHROPIC_MOCK_SECRET if self.api is Api.MESSAGES else MOCK_SECRET


def scenarios(modes: list[str]) -> list[Scenario]:
    """The short-call scenarios of `modes`, in the order of MODES: chat's `plain` and `stream`,
    and both ways of each of the other APIs."""
    found: list[Scenario] = []
    for mode in MODES:
        if mode not in modes:
            continue
        if mode in ("plain", "stream"):
            found.append(Scenario(mode, Api.CHAT, mode == "stream"))
        elif mode in ("responses", "messages", "responses-chain"):
            api = Api.MESSAGES if mode == "messages" else Api.RESPONSES
            found += [Scenario(mode + (" stream" if stream else ""), api, stream,
                               chain=mode == "responses-chain") for stream in (False, True)]
    return found


def _print_pair(scenario: str, how: str, level: int, direct: Result | WrkResult,
                through: Result | WrkResult) -> None:
    """A scenario's rows: direct, through the gateway, and what the gateway added."""
    for name, r in ((f"{scenario} direct{how}", direct), (f"{scenario} via gateway{how}", through)):
        print(f"{name:<34} {level:>7} {r.rps:>8.0f} {r.pct(50):>8.2f} "
              f"{r.pct(90):>8.2f} {r.pct(99):>8.2f}")
    print(f"{'  added by gateway' + how:<34} {level:>7} {'':>8} "
          f"{through.pct(50) - direct.pct(50):>8.2f} "
          f"{through.pct(90) - direct.pct(90):>8.2f} "
          f"{through.pct(99) - direct.pct(99):>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES,
                        help="which scenarios to run (plain, stream: chat completions; "
                             "responses, messages: the Responses and Messages APIs, non-streamed "
                             "and streamed; responses-chain: Responses calls continuing the "
                             "previous one; long: streams with checkpoints; queue: what waiting "
                             "in the queue policy's queue costs; transports: the same calls "
                             "through a gateway per upstream transport)")
    parser.add_argument("--chain-length", type=int, default=100,
                        help="calls per chain in responses-chain (each connection then starts "
                             "a new one)")
    parser.add_argument("--queue-waiters", type=int, default=64,
                        help="calls waiting in the queue in the queue scenario (at most "
                             "TOLLGATE_QUEUE_MAX_WAITERS)")
    parser.add_argument("--queue-idle-seconds", type=float, default=3.0,
                        help="how long the waiters wait while Redis commands are counted")
    parser.add_argument("--long-seconds", type=float, default=2.5,
                        help="how long each stream of the long scenario lasts")
    parser.add_argument("--long-clients", type=int, default=64,
                        help="concurrent streams in the long scenario")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                        help="the upstream transports the transports mode compares (the first "
                             "is the reference of the CPU ratio when native is not among them)")
    parser.add_argument("--transport-rounds", type=int, default=2,
                        help="times the transports mode measures every transport")
    parser.add_argument("--transport-concurrency", type=int, nargs="+", default=[1, 16],
                        help="client levels of the transports mode")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                        help="after the measurements, keep 16 clients busy this long (plain and "
                             "streaming in turn) and print the gateway worker's RSS every 10 s")
    parser.add_argument("--cpu-awake", action="store_true",
                        help="keep the CPUs out of idle states for the run (/dev/cpu_dma_latency "
                             "held at 0; root): figures without the idle wake-ups' cost")
    parser.add_argument("--halt-poll-us", type=int, metavar="US",
                        help=HALT_POLL_HELP)
    parser.add_argument("--wrk", action="store_true",
                        help="also measure the plain call at one connection with wrk (the "
                             "issue's load generator; Debian's package, on PATH), after the "
                             "scenarios: p50 / p90 / p99 direct, through the gateway and added")
    parser.add_argument("--gateway-port", type=int, default=18000)
    parser.add_argument("--mock-port", type=int, default=18099)
    args = parser.parse_args(argv)
    if args.wrk and shutil.which("wrk") is None:
        parser.error("--wrk needs wrk on PATH (apt-get install wrk)")

    with cpus_kept_awake(args.cpu_awake) as idle_states, \
            guest_halt_polling(args.halt_poll_us) as halting, \
            running_system("tgb-", args.gateway_port, args.mock_port,
                           args.gateway_workers) as (gateway, key):
        print(f"CPU idle states: {idle_states}; {halting}")
        # Warm up: every worker loads its caches, scripts and connections (as many as the
        # most clients will need, so no measurement pays for opening them), and each API's
        # first call (its provider key's upstream connections) is not measured either.
        widest = max([4, *args.concurrency])
        load(args.gateway_port, key, False, widest, 1.0)
        load(args.mock_port, MOCK_SECRET, False, widest, 1.0)
        for api in sorted({scenario.api for scenario in scenarios(args.modes)} - {Api.CHAT}):
            warm = Scenario("warm-up", api, False)
            load(args.gateway_port, key, False, widest, 0.5, warm.model, api=api)
            load(args.mock_port, warm.mock_secret, False, widest, 0.5, warm.model, api=api)

        print(f"{'scenario':<34} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} "
              f"{'p99 ms':>8}")
        work: dict[str, Work] = {}
        chained: dict[str, list[ResponsesChain]] = {}
        for scenario in scenarios(args.modes):
            spent = work.setdefault(f"{scenario.name} (short)", Work())
            for level in args.concurrency:
                chains = chained.setdefault(f"{scenario.name} (short)", [])

                def run(port: int, secret: str, record: list[ResponsesChain] | None,
                        level: int = level, scenario: Scenario = scenario) -> Result:
                    return load(port, secret, scenario.stream, level, args.duration,
                                scenario.model, api=scenario.api, chains=record,
                                chain_length=args.chain_length if scenario.chain else 0)

                direct = run(args.mock_port, scenario.mock_secret, None)
                through = measured(gateway.pid, spent,
                                   lambda: run(args.gateway_port, key, chains))
                _print_pair(scenario.name, "", level, direct, through)
        if args.wrk:
            _print_pair("plain", " (wrk)", 1, wrk_load(args.mock_port, MOCK_SECRET, args.duration),
                        wrk_load(args.gateway_port, key, args.duration))
        if "long" in args.modes:
            # The mock waits chunk_ms between its events (the role chunk, one per token, the
            # finish chunk, the usage chunk, [DONE]): 19 gaps over --long-seconds. Each client
            # runs back-to-back streams for at least three stream lengths.
            chunk_ms = round(args.long_seconds * 1000 / (OUTPUT_TOKENS + 3))
            model = f"gpt-4o-mini@chunk_ms={chunk_ms}"
            seconds = max(args.duration, 3 * args.long_seconds)
            name = f"stream {args.long_seconds:g} s"
            through = measured(gateway.pid, work.setdefault(name + " (checkpoints)", Work()),
                               lambda: load(args.gateway_port, key, True, args.long_clients,
                                            seconds, model))
            print(f"{name + ' via gateway':<34} {args.long_clients:>7} {through.rps:>8.0f} "
                  f"{through.pct(50):>8.2f} {through.pct(90):>8.2f} {through.pct(99):>8.2f}")
        print()
        # CPU time per request does not depend on what else shares the machine, unlike req/s:
        # 1,000 / (ms per request) is what one worker on a core of its own could serve.
        # Round trips are the read events Redis processed (one per command or pipeline a client
        # sends); EVALSHA calls are the reserve and settle among them (and checkpoints); Redis
        # counts the commands its scripts run as well, hence the first column.
        print(f"{'per gateway request':<34} {'requests':>8} {'Redis cmds':>10} {'trips':>7} "
              f"{'EVALSHA':>8} {'Redis µs':>8} {'DB xacts':>8} {'CPU ms':>7} {'1 core req/s':>12}")
        print(f"{'':<34} {'':>8} {'(+scripts)':>10} {'(reads)':>7} {'':>8} {'(scripts)':>8}")
        for name, spent in work.items():
            n = max(1, spent.requests)
            per_request_ms = 1000 * spent.cpu_s / n
            print(f"{name:<34} {spent.requests:>8} {spent.redis_calls / n:>10.2f} "
                  f"{spent.redis_reads / n:>7.2f} {spent.evalsha / n:>8.2f} "
                  f"{spent.evalsha_usec / n:>8.1f} {spent.db_xacts / n:>8.4f} {per_request_ms:>7.3f} "
                  f"{1000 / per_request_ms if per_request_ms else 0:>12.0f}")
        for name, chains in chained.items():
            if chains:
                calls = sum(chain.calls for chain in chains)
                continued = sum(chain.continued for chain in chains)
                print(f"{name}: {continued} of {calls} calls continued the previous response "
                      f"({continued / max(1, calls):.1%}; chains of {args.chain_length})")
        print(f"gateway worker peak RSS: {_peak_rss_mb(gateway.pid):.0f} MB")
        if "queue" in args.modes:
            queue_bench(args.gateway_port, args.queue_waiters, args.queue_idle_seconds)
        if "transports" in args.modes:
            transport_bench(key, args.mock_port, args.gateway_port, args.transports,
                            args.transport_concurrency, args.transport_rounds, args.duration)
        if args.soak > 0:
            soak(args.gateway_port, key, gateway.pid, args.soak)
    return 0


# -- wrk: the issue's own load generator, at one connection --------------------------------
#
# wrk (Debian's package) is what issue 16's figures were taken with. Its client is C where the
# bench's is Python on asyncio, so it sends the next request sooner after an answer and sees more
# of what a worker does between two calls. `--wrk` adds its figures for the plain call at one
# connection beside the bench's own, so the issue's figures can be compared as they were taken.


@dataclass(frozen=True)
class WrkResult:
    """wrk's figures of one run: requests per second and latency percentiles in ms."""

    rps: float
    p50: float
    p90: float
    p99: float

    def pct(self, p: float) -> float:
        """As Result.pct, for the percentiles wrk reports (50, 90, 99)."""
        return {50: self.p50, 90: self.p90, 99: self.p99}[int(p)]


_WRK_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
_WRK_PERCENTILE = re.compile(r"^\s*(50|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_WRK_RPS = re.compile(r"^Requests/sec:\s+([\d.]+)", re.M)
_WRK_FAILURES = re.compile(r"^\s*(Non-2xx or 3xx responses|Socket errors):.*$", re.M)


def parse_wrk(output: str) -> WrkResult:
    """The figures of `wrk --latency`'s report. Raises when a response was not 2xx or a socket
    failed (a figure of refusals or errors is not the gateway's latency), or a figure is
    missing."""
    failure = _WRK_FAILURES.search(output)
    if failure is not None:
        raise RuntimeError(f"wrk: {failure.group(0).strip()}")
    percentiles = {int(p): float(v) * _WRK_UNITS[unit]
                   for p, v, unit in _WRK_PERCENTILE.findall(output)}
    rps = _WRK_RPS.search(output)
    if rps is None or set(percentiles) != {50, 90, 99}:
        raise RuntimeError(f"wrk's report lacks its figures:\n{output}")
    return WrkResult(float(rps.group(1)), percentiles[50], percentiles[90], percentiles[99])


def _lua_string(data: bytes) -> str:
    """`data` as a Lua string literal that Lua 5.1 and LuaJIT (wrk's) both read back byte for
    byte, whatever the bytes: printable ASCII as is, the rest, quote and backslash as \\ddd
    (always three digits, so a digit after it is never read into it)."""
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:03d}"
                         for b in data) + '"'


def wrk_script(key: str, body: bytes) -> str:
    """wrk's script for the bench's plain chat call with `key` as the bearer key."""
    return (f'wrk.method = "POST"\n'
            f"wrk.body = {_lua_string(body)}\n"
            f'wrk.headers["Content-Type"] = "application/json"\n'
            f'wrk.headers["Authorization"] = {_lua_string(b"Bearer " + key.encode())}\n')


def wrk_load(port: int, key: str, seconds: float, model: str = CHAT_MODEL) -> WrkResult:
    """wrk at one connection for `seconds`: the plain chat call, to the mock or the gateway.
    `model` may carry the mock's options (e.g. `@first_byte_ms=500`, a slow model)."""
    body = json.dumps(request_body(Api.CHAT, False, model, PROMPT, None)).encode()
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(wrk_script(key, body))
        script.flush()
        done = subprocess.run(
            ["wrk", "-t1", "-c1", f"-d{max(1, round(seconds))}s", "--latency", "-s", script.name,
             f"http://127.0.0.1:{port}{_PATHS[Api.CHAT].decode()}"],
            capture_output=True, text=True, check=False)
    if done.returncode != 0:  # e.g. a Lua error, or nothing listening: wrk says which
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
    return parse_wrk(done.stdout)


# The transports mode's loads: (name, streamed, model). The mock sends a short stream's events
# at once, so they reach the gateway in one read; "paced" spaces them by a millisecond, as a
# model's tokens come, so each is read, relayed and written on its own.
TRANSPORT_LOADS = (("plain", False, CHAT_MODEL), ("stream", True, CHAT_MODEL),
                   ("paced", True, f"{CHAT_MODEL}@chunk_ms=1"))


@dataclass(frozen=True)
class TransportRun:
    """One load through one transport's gateway in one round, with the mock's direct figures
    of the same round and load."""

    round: int
    kind: str
    load: str
    clients: int
    through: Result
    direct: Result
    cpu_s: float

    @property
    def cpu_ms(self) -> float:
        """The gateway worker's CPU milliseconds per request."""
        return 1000 * self.cpu_s / max(1, self.through.requests)

    def added(self, p: float) -> float:
        return self.through.pct(p) - self.direct.pct(p)


def transport_bench(key: str, mock_port: int, gateway_port: int, kinds: list[str],
                    levels: list[int], rounds: int, seconds: float) -> list[TransportRun]:
    """The transports mode (see the module's docstring): a gateway per transport on the ports
    after `gateway_port`, the same loads through each in turn; prints and returns the runs."""
    ports = {kind: gateway_port + 1 + i for i, kind in enumerate(kinds)}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for kind in kinds:
            processes[kind] = _start_gateway(ports[kind], 1, GATEWAY_UPSTREAM_TRANSPORT=kind)
        for kind in kinds:
            _wait_http(f"http://127.0.0.1:{ports[kind]}/healthz", processes[kind])
            for stream in (False, True):  # caches, scripts and as many connections as needed
                load(ports[kind], key, stream, max(levels), 1.0)
        runs: list[TransportRun] = []
        for round_ in range(1, rounds + 1):
            order = kinds[(round_ - 1) % len(kinds):] + kinds[:(round_ - 1) % len(kinds)]
            for name, stream, model in TRANSPORT_LOADS:
                for level in levels:
                    direct = load(mock_port, MOCK_SECRET, stream, level, seconds, model)
                    for kind in order:
                        pid = processes[kind].pid
                        cpu_before = cpu_seconds(pid)
                        through = load(ports[kind], key, stream, level, seconds, model)
                        runs.append(TransportRun(round_, kind, name, level, through, direct,
                                                 cpu_seconds(pid) - cpu_before))
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=15)
    print_transport_runs(runs, kinds)
    return runs


def print_transport_runs(runs: list[TransportRun], kinds: list[str]) -> None:
    """Each run, its CPU per request against the reference transport's in the same round and
    load (native, else the first), then the spread over the rounds."""
    reference = "native" if "native" in kinds else kinds[0]
    cpu_of = {(r.round, r.load, r.clients, r.kind): r.cpu_ms for r in runs}

    def ratio(run: TransportRun) -> float:
        base = cpu_of[(run.round, run.load, run.clients, reference)]
        return run.cpu_ms / base if base else float("nan")

    print()
    print(f"transports: a gateway per transport (1 worker each), the same loads in turn; "
          f"CPU = the worker's process CPU time / requests, vs {reference} in the same round")
    print(f"{'load':<7} {'clients':>7} {'round':>5} {'transport':<9} {'req/s':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} {'CPU ms':>7} {'vs ' + reference:>10}")
    for run in runs:
        print(f"{run.load:<7} {run.clients:>7} {run.round:>5} {run.kind:<9} "
              f"{run.through.rps:>8.0f} {run.through.pct(50):>7.2f} {run.through.pct(99):>7.2f} "
              f"{run.added(50):>8.2f} {run.added(99):>8.2f} {run.cpu_ms:>7.3f} "
              f"{ratio(run):>10.2f}")
    print()
    print(f"{'spread over rounds':<18} {'clients':>7} {'transport':<9} {'req/s':>11} "
          f"{'+p50 ms':>11} {'+p99 ms':>11} {'CPU ms':>13} {'vs ' + reference:>11}")
    groups: dict[tuple[str, int, str], list[TransportRun]] = {}
    for run in runs:
        groups.setdefault((run.load, run.clients, run.kind), []).append(run)

    def spread(values: list[float], digits: int) -> str:
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    for (name, clients, kind), group in groups.items():
        print(f"{name:<18} {clients:>7} {kind:<9} "
              f"{spread([r.through.rps for r in group], 0):>11} "
              f"{spread([r.added(50) for r in group], 2):>11} "
              f"{spread([r.added(99) for r in group], 2):>11} "
              f"{spread([r.cpu_ms for r in group], 3):>13} "
              f"{spread([ratio(r) for r in group], 2):>11}")
    # Issue 16's rule: a maintained client replaces the native one if its CPU per request is
    # within 10% of it. Per load and level, the median of the rounds' ratios.
    for kind in kinds:
        if kind == reference:
            continue
        medians = {(name, clients): statistics.median(ratio(r) for r in group)
                   for (name, clients, k), group in groups.items() if k == kind}
        worst = max(medians, key=lambda key: medians[key])
        print(f"{kind}: CPU per request vs {reference}, median of the rounds per load: "
              + ", ".join(f"{name} c={clients} {value:.2f}"
                          for (name, clients), value in medians.items())
              + f"; highest {medians[worst]:.2f} ({worst[0]} c={worst[1]}): "
              + ("within 10%" if medians[worst] <= 1.10 else "not within 10%"))


async def _one_call(port: int, request: bytes) -> tuple[float, float]:
    """One call on its own connection: (when it was sent, when its answer was read), by
    time.perf_counter()."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        sent = time.perf_counter()
        writer.write(request)
        head = await _read_response(reader)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected answer: {head[:200]!r}")
        return sent, time.perf_counter()
    finally:
        writer.close()


async def _queue_run(port: int, key: str, waiters: int, idle_s: float
                     ) -> tuple[dict[str, Any], dict[str, Any], list[float], list[float]]:
    """The holder, the waiters, the counters around the idle wait; then each admission gap
    and the latencies of unqueued calls."""
    hold_ms = int((idle_s + 2.5) * 1000)
    holder = asyncio.ensure_future(_one_call(port, _request_bytes(
        key, False, f"gpt-4o-mini@first_byte_ms={hold_ms}")))
    await asyncio.sleep(0.5)
    request = _request_bytes(key, False)
    calls = [asyncio.ensure_future(_one_call(port, request)) for _ in range(waiters)]
    await asyncio.sleep(1.0)  # every waiter has queued
    # (a thread: Django refuses database work inside an event loop)
    before = await asyncio.to_thread(_server_counters)
    await asyncio.sleep(idle_s)
    after = await asyncio.to_thread(_server_counters)
    ends = sorted([(await holder)[1]] + [end for _, end in await asyncio.gather(*calls)])
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    alone = []
    for _ in range(30):
        sent, ended = await _one_call(port, request)
        alone.append(ended - sent)
    return before, after, gaps, alone


def queue_bench(port: int, waiters: int, idle_s: float) -> None:
    import uvloop

    key = _setup_queue_tenant()
    before, after, gaps, alone = uvloop.run(_queue_run(port, key, waiters, idle_s))
    evalsha = after["evalsha"] - before["evalsha"]
    commands = after["redis_calls"] - before["redis_calls"]
    per = waiters * idle_s
    print()
    print(f"queue: {waiters} waiters for {idle_s:g} s: {evalsha} EVALSHA = "
          f"{evalsha / per:.4f} per waiter per second; {commands} Redis commands with those the "
          f"scripts ran and the workers' own checks = {commands / per:.4f} per waiter per second")
    base = Result(len(alone), 1.0, alone).pct(50)
    admitted = Result(len(gaps), 1.0, gaps)
    print(f"{'queued admission after a wake':<30} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    print(f"{'  gap between admissions':<30} {admitted.pct(50):>8.2f} {admitted.pct(90):>8.2f} "
          f"{admitted.pct(99):>8.2f}")
    print(f"{'  unqueued call (p50)':<30} {base:>8.2f}")
    print(f"{'  added by the queue':<30} {admitted.pct(50) - base:>8.2f} "
          f"{admitted.pct(90) - base:>8.2f} {admitted.pct(99) - base:>8.2f}")


def _setup_queue_tenant() -> str:
    """A tenant of the standard plan (the queue policy) whose key allows one call in flight."""
    from tenants.services import create_project, create_tenant, issue_key

    # The standard plan waits up to 10 s: the holder lasts --queue-idle-seconds + 2.5 s.
    tenant = create_tenant("bench-queue", plan_name="standard", actor="bench",
                           requests_per_second=1_000_000)
    project = create_project(tenant, "queue", actor="bench")
    return issue_key(project, actor="bench", max_concurrency=1).plaintext


CPU_DMA_LATENCY = Path("/dev/cpu_dma_latency")
HALT_POLL_HELP = ("set the guest kernel's halt polling (haltpoll's guest_halt_poll_ns) to this "
                  "many us for the run, then put the machine's value back (root): the kernel's "
                  "default is 200")


@contextmanager
def cpus_kept_awake(wanted: bool, device: Path = CPU_DMA_LATENCY) -> Iterator[str]:
    """While open, a PM QoS request of 0 us wake-up latency keeps every CPU out of its idle
    states (the kernel's interface: the request lasts as long as the file stays open). Yields
    how the run's CPUs idle, for its first line; exits with a clear message when it cannot."""
    if not wanted:
        yield "allowed (the machine's default; --cpu-awake holds them off)"
        return
    try:
        fd = os.open(device, os.O_WRONLY)
    except OSError as exc:
        raise SystemExit(f"--cpu-awake needs {device} writable (root, on Linux): {exc}") from None
    try:
        os.write(fd, struct.pack("i", 0))
        yield f"held off ({device} = 0 for the run)"
    finally:
        os.close(fd)


GUEST_HALT_POLL_NS = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


@contextmanager
def guest_halt_polling(us: int | None, param: Path = GUEST_HALT_POLL_NS) -> Iterator[str]:
    """Sets the guest kernel's halt polling (cpuidle haltpoll's `guest_halt_poll_ns`: how long
    an idle vCPU polls before it halts, adaptively per CPU) to `us` for the run and puts the
    machine's value back after. Unlike the gateway's own spin it covers every process on the
    machine (Redis, the mock, wrk). The kernel's default is 200 us; docs/benchmarks.md's
    machines set 0. Yields how the run's vCPUs halt, for its first lines."""
    if us is None:
        try:
            current = f"{param.read_text().strip()} ns"
        except OSError:
            current = "no haltpoll governor here"
        yield f"halt polling as the machine has it ({current})"
        return
    if us < 0:
        raise SystemExit(f"--halt-poll-us must be 0 or more, got {us}")
    try:
        before = param.read_text().strip()
        param.write_text(str(us * 1000))
    except OSError as exc:
        raise SystemExit(f"--halt-poll-us needs {param} writable (root, the haltpoll cpuidle "
                         f"governor): {exc}") from None
    try:
        yield f"halt polling {us * 1000} ns for the run (the machine's {before} after it)"
    finally:
        param.write_text(before)


@contextmanager
def running_system(data_prefix: str, gateway_port: int, mock_port: int, gateway_workers: int = 1,
                   extra_env: dict[str, str] | None = None,
                   ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Embedded Redis and PostgreSQL in a temporary directory, migrated, the bench tenant, the
    mock upstream and the gateway (uvicorn, uvloop, httptools, `gateway_workers`), all stopped
    and removed on exit. `extra_env` is added to this process's and the servers' environment.
    Yields the gateway's process and the bench tenant's API key; Django is set up, so the
    caller can create more with the services."""
    data_dir = Path(tempfile.mkdtemp(prefix=data_prefix, dir="/tmp"))
    os.environ.update({"TOLLGATE_DATA_DIR": str(data_dir), "TOLLGATE_ENV": "development",
                       "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING",
                       **(extra_env or {})})
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    from config import embedded

    embedded.start_all(data_dir, persistent=False)
    children: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env,
                       check=True)
        import django

        django.setup()
        key = _setup_tenant(mock_port)

        mock = subprocess.Popen([sys.executable, "-m", "gateway.mock_upstream", "--port",
                                 str(mock_port)], cwd=ROOT, env=env)
        children.append(mock)
        gateway = _start_gateway(gateway_port, gateway_workers)
        children.append(gateway)
        _wait_http(f"http://127.0.0.1:{mock_port}/v1/models", mock)
        _wait_http(f"http://127.0.0.1:{gateway_port}/healthz", gateway)
        yield gateway, key
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=15)
        embedded.stop_all(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def _start_gateway(port: int, workers: int, root: Path = ROOT, python: str = sys.executable,
                   **env: str) -> subprocess.Popen[bytes]:
    """The gateway under uvicorn (uvloop, httptools) with this process's environment (that of
    running_system), its metrics directory, plus `env`. `root` and `python`: another checkout's
    gateway (config/bench_turns.py), on its own interpreter."""
    return subprocess.Popen(
        [python, "-m", "uvicorn", "config.asgi:application", "--port", str(port),
         "--workers", str(workers), "--loop", "uvloop", "--http", "httptools", "--log-level",
         "warning", "--no-access-log", "--no-proxy-headers"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root), **metrics_env(port), **env})


def metrics_env(port: int) -> dict[str, str]:
    """PROMETHEUS_MULTIPROC_DIR for the gateway on `port`: an empty directory of its own in the
    run's data directory (TOLLGATE_DATA_DIR, removed at the end), so its workers record the
    request metrics in multiprocess mode as under `make up`. Never the caller's own
    PROMETHEUS_MULTIPROC_DIR: the bench would add its calls to it (and empty it)."""
    path = Path(os.environ["TOLLGATE_DATA_DIR"]) / f"prometheus-{port}"
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return {"PROMETHEUS_MULTIPROC_DIR": str(path)}


def _setup_tenant(mock_port: int) -> str:
    from gateway.providers import create_provider_key
    from tenants.services import create_project, create_tenant, issue_key

    from gateway.prices import Price

    # A default price: the long scenario's model carries the mock's latency suffix, which the
    # catalog does not know (an unpriced model is refused).
    create_provider_key("mock", base_url=f"http://127.0.0.1:{mock_port}/v1", secret=MOCK_SECRET,
                        default_price=Price(150_000, 600_000))
    # The same mock speaks the Messages API: a key of that kind serves /v1/messages.
    create_provider_key("mock-anthropic", base_url=f"http://127.0.0.1:{mock_port}/v1",
                        secret=ANTHROPIC_MOCK_SECRET, kind="anthropic",
                        default_price=Price(1_000_000, 5_000_000))
    # Every limit on and far from binding, so each request runs every check.
    tenant = create_tenant("bench", plan_name="enterprise", actor="bench",
                           requests_per_second=1_000_000, tokens_per_minute=10**12,
                           monthly_token_budget=10**13,
                           model_tokens_per_day={CHAT_MODEL: 10**12, MESSAGES_MODEL: 10**12})
    project = create_project(tenant, "load", actor="bench", tokens_per_day=10**12,
                             tokens_per_month=10**13)
    issued = issue_key(project, actor="bench", tokens_per_day=10**12, requests_per_minute=10**8,
                       max_concurrency=10_000)
    return issued.plaintext


def _server_counters() -> dict[str, Any]:
    from django.db import connection

    from quotas.client import make_redis

    client = make_redis()
    stats = client.info("commandstats")
    # One read event per request (or pipeline) a client sends: the round trips. Counted by the
    # server, since the scripts' own commands make per-command counts useless for this.
    reads = client.info("stats")["total_reads_processed"]
    # INFO itself and the per-second PINGs of health checks are not request work.
    calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))
    evalsha = stats.get("cmdstat_evalsha", {}).get("calls", 0)
    # The server's time in the scripts (the commands they run included): what a Redis core
    # spends per request, the figure that sizes the shards (docs/capacity.md).
    evalsha_usec = stats.get("cmdstat_evalsha", {}).get("usec", 0)
    client.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                       "WHERE datname = current_database()")
        xacts = cursor.fetchone()[0]
    connection.close()
    return {"redis_calls": calls, "redis_reads": reads, "evalsha": evalsha,
            "evalsha_usec": evalsha_usec, "db_xacts": xacts}


if __name__ == "__main__":
    sys.exit(main())
