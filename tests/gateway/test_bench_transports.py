"""The transport comparison's report (config/bench.py, `transports` mode): each run's CPU per
request against the native transport's in the same round and load, the spread over the rounds,
and issue 16's rule (a maintained client within 10% of the native CPU per request) applied to
the median of the rounds, load by load."""
from __future__ import annotations

from pathlib import Path

import pytest

from config.bench import Result, TransportRun, metrics_env, print_transport_runs


def _run(round_: int, kind: str, load: str, cpu_s: float, requests: int = 1000) -> TransportRun:
    through = Result(requests, 5.0, [0.002] * requests)
    direct = Result(requests, 5.0, [0.001] * requests)
    return TransportRun(round_, kind, load, 16, through, direct, cpu_s)


def test_ratios_spread_and_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [
        _run(1, "native", "plain", 0.50), _run(1, "aiohttp", "plain", 0.54),
        _run(2, "native", "plain", 0.40), _run(2, "aiohttp", "plain", 0.48),
        _run(3, "native", "plain", 0.50), _run(3, "aiohttp", "plain", 0.52),
        _run(1, "native", "stream", 0.60), _run(1, "aiohttp", "stream", 0.90),
        _run(2, "native", "stream", 0.60), _run(2, "aiohttp", "stream", 0.60),
        _run(3, "native", "stream", 0.60), _run(3, "aiohttp", "stream", 0.72),
    ]
    assert runs[1].cpu_ms == pytest.approx(0.54)
    assert runs[1].added(50) == pytest.approx(1.0)
    print_transport_runs(runs, ["native", "aiohttp"])
    out = capsys.readouterr().out.splitlines()
    # Each run against native in its own round: 0.54 / 0.50, 0.48 / 0.40.
    assert out[4].split()[-2:] == ["0.540", "1.08"]
    assert out[6].split()[-2:] == ["0.480", "1.20"]
    spread = next(line for line in out if line.startswith("plain ") and "aiohttp" in line
                  and line.count("-") >= 4)
    assert spread.split()[-2:] == ["0.480-0.540", "1.04-1.20"]
    # Medians of the rounds: plain 1.08, stream 1.20 (of 1.50, 1.00, 1.20): not within 10%.
    assert out[-1] == ("aiohttp: CPU per request vs native, median of the rounds per load: "
                       "plain c=16 1.08, stream c=16 1.20; highest 1.20 (stream c=16): "
                       "not within 10%")


def test_within_ten_percent(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run(1, "native", "plain", 0.50), _run(1, "aiohttp", "plain", 0.55),
            _run(2, "native", "plain", 0.50), _run(2, "aiohttp", "plain", 0.45)]
    print_transport_runs(runs, ["native", "aiohttp"])
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "highest 1.00 (plain c=16): within 10%")


def test_each_gateway_of_the_bench_records_metrics_in_a_directory_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench measures the gateway as `make up` runs it, request metrics on in multiprocess
    mode: each gateway it starts gets an empty directory of its own in the run's temporary data
    directory, never the caller's PROMETHEUS_MULTIPROC_DIR."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "counter_1.db").write_bytes(b"")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mine))
    monkeypatch.setenv("TOLLGATE_DATA_DIR", str(tmp_path / "run"))
    first = Path(metrics_env(9100)["PROMETHEUS_MULTIPROC_DIR"])
    (first / "counter_7.db").write_bytes(b"")  # a previous gateway on that port
    again = Path(metrics_env(9100)["PROMETHEUS_MULTIPROC_DIR"])
    other = Path(metrics_env(9101)["PROMETHEUS_MULTIPROC_DIR"])
    assert again == first != other
    assert first.parent == other.parent == tmp_path / "run"
    assert list(first.iterdir()) == [] and list(other.iterdir()) == []
    assert [p.name for p in mine.iterdir()] == ["counter_1.db"]  # the caller's, untouched
