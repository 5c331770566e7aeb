"""The benchmark's request builders and readers (config/bench.py): the raw HTTP/1.1 requests it
sends for each API are what the mock upstream and the gateway accept, its chunked reader gives
back the body, and the chain mode continues each connection's previous response.

The load generator is a hand-written client on raw asyncio streams, so nothing else checks that
its bytes are well-formed requests: a wrong header would only show as a benchmark failing (or,
worse, measuring error answers) at run time.
"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from config.bench import (
    ANTHROPIC_VERSION,
    MODES,
    OUTPUT_TOKENS,
    Api,
    ResponsesChain,
    _read_answer,
    _request_bytes,
    load,
    scenarios,
)
from gateway.mock_upstream import MockUpstream
from tests.gateway.conftest import ANTHROPIC_MOCK_SECRET, GatewayServer, MakeTenant


def _parse(request: bytes) -> tuple[str, dict[str, str], dict[str, object]]:
    """(request line, headers with lower-case names, JSON body) of one raw request."""
    head, body = request.split(b"\r\n\r\n", 1)
    line, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (h.split(": ", 1) for h in lines)}
    assert int(headers["content-length"]) == len(body)
    return line, headers, json.loads(body)


def test_chat_request_is_unchanged_by_default() -> None:
    line, headers, body = _parse(_request_bytes("tg-key", False))
    assert line == "POST /v1/chat/completions HTTP/1.1"
    assert headers["authorization"] == "Bearer tg-key"
    assert body == {"model": "gpt-4o-mini", "max_tokens": OUTPUT_TOKENS,
                    "messages": [{"role": "user", "content": "hello there, how are you today?"}]}
    _, headers, body = _parse(_request_bytes("tg-key", True, forwarded_for="198.51.100.7"))
    assert headers["x-forwarded-for"] == "198.51.100.7"
    assert body["stream"] is True


def test_responses_request() -> None:
    line, headers, body = _parse(_request_bytes("tg-key", True, api=Api.RESPONSES,
                                                previous_response_id="resp_abc"))
    assert line == "POST /v1/responses HTTP/1.1"
    assert headers["authorization"] == "Bearer tg-key"
    assert body == {"model": "gpt-4o-mini", "max_output_tokens": OUTPUT_TOKENS,
                    "input": "hello there, how are you today?",
                    "previous_response_id": "resp_abc", "stream": True}


def test_messages_request_authenticates_as_the_anthropic_sdk() -> None:
    line, headers, body = _parse(_request_bytes("tg-key", False, "claude-x", api=Api.MESSAGES))
    assert line == "POST /v1/messages HTTP/1.1"
    assert headers["x-api-key"] == "tg-key"
    assert headers["anthropic-version"] == ANTHROPIC_VERSION
    assert "authorization" not in headers
    assert body == {"model": "claude-x", "max_tokens": OUTPUT_TOKENS,
                    "messages": [{"role": "user", "content": "hello there, how are you today?"}]}
    with pytest.raises(ValueError):
        _request_bytes("tg-key", False, api=Api.MESSAGES, previous_response_id="resp_abc")


def test_chunked_answer_is_read_whole_and_its_id_found_across_chunks() -> None:
    events = (b'event: response.created\ndata: {"type":"response.created","response":'
              b'{"id":"resp_0123456789","object":"response","previous_response_id":"resp_old"}}'
              b'\n\n')
    cut = events.index(b"0123")  # the id split over two chunks
    wire = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{cut:x}\r\n".encode() + events[:cut] + b"\r\n"
            + f"{len(events) - cut:x}\r\n".encode() + events[cut:] + b"\r\n0\r\n\r\n"
            + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

    async def read() -> list[tuple[bytes, bytes]]:
        reader = asyncio.StreamReader()
        reader.feed_data(wire)
        reader.feed_eof()
        return [await _read_answer(reader), await _read_answer(reader)]

    (head, body), (_, sized) = asyncio.run(read())
    assert head.startswith(b"HTTP/1.1 200") and body == events and sized == b"{}"
    chain = ResponsesChain("tg-key", True, "gpt-4o-mini", 5)
    chain(None)
    _, _, body_json = _parse(chain(body))
    # The answer's own id, not the previous_response_id it names.
    assert body_json["previous_response_id"] == "resp_0123456789"


def test_chain_restarts_after_its_length_and_refuses_an_answer_without_an_id() -> None:
    chain = ResponsesChain("tg-key", False, "gpt-4o-mini", 3)
    named = []
    for turn in range(7):
        answer = None if turn == 0 else f'{{"id": "resp_{turn}"}}'.encode()
        named.append(_parse(chain(answer))[2].get("previous_response_id"))
    assert named == [None, "resp_1", "resp_2", None, "resp_4", "resp_5", None]
    assert (chain.calls, chain.continued) == (7, 4)
    with pytest.raises(RuntimeError):
        chain(b'{"error": {"message": "no"}}')
    with pytest.raises(ValueError):
        ResponsesChain("tg-key", False, "gpt-4o-mini", 0)


def test_modes_give_both_ways_of_each_api() -> None:
    assert [(s.name, s.api, s.stream, s.chain) for s in scenarios(MODES)] == [
        ("plain", Api.CHAT, False, False), ("stream", Api.CHAT, True, False),
        ("responses", Api.RESPONSES, False, False), ("responses stream", Api.RESPONSES, True, False),
        ("messages", Api.MESSAGES, False, False), ("messages stream", Api.MESSAGES, True, False),
        ("responses-chain", Api.RESPONSES, False, True),
        ("responses-chain stream", Api.RESPONSES, True, True)]
    assert scenarios(["long", "queue"]) == []


@pytest.mark.django_db
@pytest.mark.e2e
def test_every_scenario_is_answered_200_direct_and_through_the_gateway(
        gateway: GatewayServer, mock_upstream: MockUpstream, make_tenant: MakeTenant) -> None:
    """load() raises on any answer but a 200 (and the chain on an answer without an id, the
    gateway and the mock on an unknown previous_response_id): each scenario must run clean."""
    key = make_tenant(plan="enterprise", requests_per_second=-1).plaintext
    for scenario in scenarios(MODES):
        for port, secret in ((gateway.port, key), (mock_upstream.port, (
                ANTHROPIC_MOCK_SECRET if scenario.api is Api.MESSAGES else "sk-bench"))):
            chains: list[ResponsesChain] = []
            result = load(port, secret, scenario.stream, 2, 0.3, scenario.model,
                          api=scenario.api, chains=chains,
                          chain_length=3 if scenario.chain else 0, min_calls=2)
            assert result.requests >= 2, (scenario, port)
            if scenario.chain:
                assert len(chains) == 2
                assert sum(chain.calls for chain in chains) == result.requests
                for chain in chains:
                    assert chain.continued == chain.calls - math.ceil(chain.calls / 3)
                assert all(chain.continued >= 1 for chain in chains), (scenario, port)
            else:
                assert chains == []


def test_halt_poll_sets_the_guest_kernels_polling_for_the_run_only(tmp_path) -> None:
    # --halt-poll-us: the haltpoll governor's limit for the run, the machine's value back after
    # it, even when the run fails. A plain file stands in for the module parameter; the real one
    # is never written by the suite (it is the whole machine's).
    from config.bench import guest_halt_polling

    param = tmp_path / "guest_halt_poll_ns"
    param.write_text("0\n")
    with guest_halt_polling(None, param) as state:
        assert state == "halt polling as the machine has it (0 ns)"
    with guest_halt_polling(None, tmp_path / "absent") as state:
        assert "no haltpoll governor" in state
    with guest_halt_polling(200, param) as state:
        assert param.read_text() == "200000"
        assert state == "halt polling 200000 ns for the run (the machine's 0 after it)"
    assert param.read_text() == "0"
    with pytest.raises(RuntimeError):
        with guest_halt_polling(50, param):
            assert param.read_text() == "50000"
            raise RuntimeError("the run failed")
    assert param.read_text() == "0"
    with pytest.raises(SystemExit, match="--halt-poll-us needs"):
        with guest_halt_polling(200, tmp_path / "missing" / "param"):
            pass
    with pytest.raises(SystemExit, match="0 or more"):
        with guest_halt_polling(-1, param):
            pass
    assert param.read_text() == "0"


def test_cpu_awake_holds_the_latency_request_for_the_run_only(tmp_path) -> None:
    # --cpu-awake: the bench's first line says how the CPUs idled, so runs are compared only in
    # the same state. A plain file stands in for the device where it is not writable.
    import os
    import struct

    from config.bench import CPU_DMA_LATENCY, cpus_kept_awake

    with cpus_kept_awake(False) as state:
        assert state.startswith("allowed")
    with pytest.raises(SystemExit, match="--cpu-awake needs"):
        with cpus_kept_awake(True, tmp_path / "missing" / "device"):
            pass
    stand_in = tmp_path / "device"
    stand_in.write_bytes(b"")
    with cpus_kept_awake(True, stand_in) as state:
        assert state.startswith("held off")
        assert stand_in.read_bytes() == struct.pack("i", 0)
    if os.access(CPU_DMA_LATENCY, os.W_OK):  # root on Linux: the kernel's own aggregate
        def held() -> bool:  # this process has the device open (its request stands)
            return any(os.path.realpath(f"/proc/self/fd/{fd}") == str(CPU_DMA_LATENCY)
                       for fd in os.listdir("/proc/self/fd"))

        with cpus_kept_awake(True):
            assert struct.unpack("i", CPU_DMA_LATENCY.read_bytes()[:4])[0] == 0
            assert held()
        assert not held()
