"""`make bench ARGS=--wrk` (config/bench.py): wrk's report read into figures, refused when any
response was not 2xx or a socket failed, and the Lua script's strings read back byte for byte.

wrk itself is not installed where the suite runs (a benchmark tool, not a test dependency): the
report below is one it printed, against the bench's gateway at one connection, with its 99 %
line edited to 1.78s so that all three units are read."""
from __future__ import annotations

import re

import pytest

from config.bench import WrkResult, _lua_string, parse_wrk, wrk_script

REPORT = """Running 2s test @ http://127.0.0.1:18000/v1/chat/completions
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   722.15us  184.82us   6.54ms   97.23%
    Req/Sec     1.39k    51.14     1.45k    75.00%
  Latency Distribution
     50%  707.00us
     75%  758.00us
     90%    0.87ms
     99%    1.78s
  2770 requests in 2.00s, 1.90MB read
Requests/sec:   1383.76
Transfer/sec:    969.98KB
"""


def test_the_report_s_percentiles_in_ms_whatever_their_unit() -> None:
    assert parse_wrk(REPORT) == WrkResult(rps=1383.76, p50=pytest.approx(0.707),
                                          p90=pytest.approx(0.87), p99=pytest.approx(1780.0))


@pytest.mark.parametrize("line", ["  Non-2xx or 3xx responses: 5",
                                  "  Socket errors: connect 0, read 1, write 0, timeout 0"])
def test_a_run_with_refusals_or_socket_errors_gives_no_figures(line: str) -> None:
    report = REPORT.replace("Requests/sec:", f"{line}\nRequests/sec:")
    with pytest.raises(RuntimeError, match=re.escape(line.strip())):
        parse_wrk(report)


def test_a_report_without_its_percentiles_is_refused() -> None:
    with pytest.raises(RuntimeError, match="lacks its figures"):
        parse_wrk(REPORT.replace("     90%    0.87ms\n", ""))


def _lua_read(literal: str) -> bytes:
    """What Lua reads from a literal made only of printable ASCII and \\ddd escapes."""
    assert literal[0] == literal[-1] == '"'
    inner = literal[1:-1]
    # Nothing Lua would read differently: no bare quote, and every backslash starts \ddd.
    assert '"' not in inner and re.fullmatch(r'(?:[ -~]|\\\d{3})*', inner)
    assert "\\" not in re.sub(r"\\\d{3}", "", inner)
    return re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1))), inner).encode("latin-1")


@pytest.mark.parametrize("data", [b'{"model": "gpt-4o-mini"}', b'a\\"b\\\\c', "é\n\t\x00ü".encode(),
                                  bytes(range(256))])
def test_a_lua_string_reads_back_byte_for_byte(data: bytes) -> None:
    assert _lua_read(_lua_string(data)) == data


def test_the_script_posts_the_body_with_the_bearer_key() -> None:
    script = wrk_script("tgk_k\"ey", b'{"a": 1}')
    lines = dict(line.split(" = ", 1) for line in script.strip().split("\n"))
    assert lines["wrk.method"] == '"POST"'
    assert _lua_read(lines["wrk.body"]) == b'{"a": 1}'
    assert _lua_read(lines['wrk.headers["Content-Type"]']) == b"application/json"
    assert _lua_read(lines['wrk.headers["Authorization"]']) == b'Bearer tgk_k"ey'
