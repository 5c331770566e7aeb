"""Trees compared by turns on one bench system: the figure behind issue 16 item 3's ratio.

Each tree (this checkout, and any other checkout given with --tree, e.g. the issue's baseline
commit in a git worktree) runs as its own gateway (one uvicorn worker, as `make bench`) against
one shared system: the same Redis, PostgreSQL, mock upstream and bench tenant. Each turn runs
wrk at one connection against the mock alone, then against each gateway, the gateways' order
reversed every other turn. A turn's added p50 is the gateway's p50 less the mock's of the same
turn, so the machine's drift between turns cancels out of each turn's ratio, and the ratio to
the baseline is the median of the turns' ratios (with a bootstrap 95 % interval of that median).

Why by turns and on one system: this 2-core VM's speed moves by 20-40 % over minutes (its idle
CPUs halt, docs/benchmarks.md), and two whole bench systems differed by about 4 % between
themselves, as much as the changes being measured. Earlier sessions did this with scratch
scripts; this is that method, kept.

    make bench-turns ARGS="--tree base=/tmp/wt-base --baseline base --turns 16 --cpu-awake"

`--tree-env NAME:VAR=VALUE` sets a variable for one tree's gateway: the same checkout under two
names compares two settings, e.g. `--tree nospin=. --tree-env nospin:GATEWAY_IDLE_SPIN_US=0`.

A tree's gateway runs with the tree's own `.venv/bin/python` when it has one (an older commit
may need other packages: `make install` in it), else this one's. The system is migrated by this
checkout: a tree whose code reads another schema fails its first call, and wrk's refusal of a
non-2xx answer stops the run.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from config.bench import (
    CHAT_MODEL,
    HALT_POLL_HELP,
    MOCK_SECRET,
    ROOT,
    _start_gateway,
    _wait_http,
    cpu_seconds,
    cpus_kept_awake,
    guest_halt_polling,
    running_system,
    wrk_load,
)

THIS = "this"  # the name of this checkout's gateway


@dataclass(frozen=True)
class Tree:
    name: str
    path: Path

    @property
    def python(self) -> str:
        own = self.path / ".venv" / "bin" / "python"
        return str(own) if own.exists() else sys.executable


def parse_tree(text: str) -> Tree:
    """NAME=PATH, PATH a checkout of this project (its manage.py and config/ there)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    if name == THIS:
        raise argparse.ArgumentTypeError(f"{name!r} names this checkout; pick another name")
    root = Path(path).resolve()
    if not (root / "config" / "asgi.py").exists():
        raise argparse.ArgumentTypeError(f"{root}: not a checkout of this project")
    return Tree(name, root)


def parse_tree_env(text: str) -> tuple[str, str, str]:
    """NAME:VAR=VALUE, a variable for the gateway of the --tree called NAME."""
    name, sep, assignment = text.partition(":")
    var, equals, value = assignment.partition("=")
    if not sep or not name or not equals or not var:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:VAR=VALUE")
    return name, var, value


def order_of(turn: int, names: Sequence[str]) -> list[str]:
    """The gateways' order in `turn`: as given on even turns, reversed on odd ones, so that no
    tree always runs first after the mock (or last, as the machine warms up)."""
    return list(names) if turn % 2 == 0 else list(reversed(names))


@dataclass
class Figures:
    """One tree's figures, a value per turn."""

    added_p50: list[float] = field(default_factory=list)  # ms, the turn's mock p50 taken off
    p99: list[float] = field(default_factory=list)  # ms
    cpu_us: list[float] = field(default_factory=list)  # the worker's CPU per call


def ratios(tree: Figures, baseline: Figures) -> list[float]:
    """Each turn's added p50 of `tree` over the baseline's in the same turn."""
    return [a / b for a, b in zip(tree.added_p50, baseline.added_p50, strict=True) if b > 0]


def median_interval(values: Sequence[float], resamples: int = 2000,
                    seed: int = 16) -> tuple[float, float]:
    """A bootstrap 95 % interval of the median of `values` (percentile method, seeded: the same
    figures give the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _measure(port: int, pid: int | None, key: str, seconds: float, model: str = CHAT_MODEL,
             ) -> tuple[float, float, float | None]:
    """wrk at one connection: p50 and p99 in ms, and the CPU per call of the server `pid` in us
    (None for the mock, whose CPU is not ours). wrk's request count is its rate times its run."""
    before = cpu_seconds(pid) if pid is not None else 0.0
    result = wrk_load(port, key, seconds, model)
    if pid is None:
        return result.p50, result.p99, None
    calls = max(1.0, result.rps * max(1, round(seconds)))
    return result.p50, result.p99, 1e6 * (cpu_seconds(pid) - before) / calls


def _report(names: Sequence[str], figures: dict[str, Figures], mock_p50: list[float],
            baseline: str | None, mock_p99: Sequence[float] = ()) -> None:
    print()
    print(f"{'tree':<12} {'added p50 ms':>13} {'p99 ms':>8} {'CPU us/call':>12} "
          f"{'ratio to ' + baseline if baseline else '':>22}")
    for name in names:
        own = figures[name]
        line = (f"{name:<12} {statistics.median(own.added_p50):>13.3f} "
                f"{statistics.median(own.p99):>8.2f} {statistics.median(own.cpu_us):>12.0f}")
        if baseline is not None and name != baseline:
            turns = ratios(own, figures[baseline])
            if turns:
                low, high = median_interval(turns)
                line += f" {statistics.median(turns):>8.3f} ({low:.3f}-{high:.3f})"
            else:  # the baseline added nothing in any turn: no ratio to tell
                line += f" {'n/a':>8}"
        print(line)
    # The mock's own p99 is the machine's tail for one hop and back (wrk's process and the
    # mock's, each waking on its CPU): a gateway's call makes four such hops.
    tail = f", p99 {statistics.median(mock_p99):.2f} ms" if mock_p99 else ""
    print(f"{'mock alone':<12} p50 {statistics.median(mock_p50):.3f} ms{tail} "
          "(medians of the turns)")
    print("Medians of the turns; a ratio is the median of the turns' ratios, with a bootstrap "
          "95 % interval.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=parse_tree, action="append", default=[],
                        metavar="NAME=PATH", help="another checkout's gateway, by turns with "
                        f"this one's ({THIS!r}); repeatable")
    parser.add_argument("--tree-env", type=parse_tree_env, action="append", default=[],
                        metavar="NAME:VAR=VALUE", help="a variable for one --tree's gateway "
                        "only; repeatable")
    parser.add_argument("--baseline", help="the tree the others' ratios are to (a --tree name, "
                        f"or {THIS!r})")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="wrk's run per gateway")
    parser.add_argument("--mock-seconds", type=float, default=5.0, help="wrk's run at the mock")
    parser.add_argument("--model", default=CHAT_MODEL,
                        help="the calls' model, with the mock's options if any (e.g. "
                        f"{CHAT_MODEL}@first_byte_ms=200: long calls in flight)")
    parser.add_argument("--cpu-awake", action="store_true",
                        help="hold the CPUs out of their idle states for the run (root)")
    parser.add_argument("--halt-poll-us", type=int, metavar="US", help=HALT_POLL_HELP)
    parser.add_argument("--gateway-port", type=int, default=18000)
    parser.add_argument("--mock-port", type=int, default=18099)
    args = parser.parse_args(argv)
    trees = [Tree(THIS, ROOT), *args.tree]
    names = [tree.name for tree in trees]
    if len(set(names)) != len(names):
        parser.error("each --tree needs a name of its own")
    tree_env: dict[str, dict[str, str]] = {}
    for name, var, value in args.tree_env:
        if name not in names[1:]:
            parser.error(f"--tree-env {name!r}: not a --tree name (this checkout's gateway runs "
                         "with the bench's own environment)")
        tree_env.setdefault(name, {})[var] = value
    if args.baseline is not None and args.baseline not in names:
        parser.error(f"--baseline {args.baseline!r} is none of {names}")
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if args.seconds < 1 or args.mock_seconds < 1:
        parser.error("--seconds and --mock-seconds must be at least 1 (wrk runs whole seconds)")
    if args.gateway_port <= args.mock_port < args.gateway_port + len(trees):
        parser.error(f"the gateways take ports {args.gateway_port}-"
                     f"{args.gateway_port + len(trees) - 1}; --mock-port must be another")
    if shutil.which("wrk") is None:
        parser.error("needs wrk on PATH (apt-get install wrk)")
    ports = {tree.name: args.gateway_port + i for i, tree in enumerate(trees)}

    with cpus_kept_awake(args.cpu_awake) as cpus, \
            guest_halt_polling(args.halt_poll_us) as halting, \
            running_system("tollgate-bench-turns-", args.gateway_port, args.mock_port) \
            as (gateway, key):
        others: list[subprocess.Popen[bytes]] = []
        try:
            pids = {THIS: gateway.pid}
            for tree in trees[1:]:
                process = _start_gateway(ports[tree.name], 1, tree.path, tree.python,
                                         **tree_env.get(tree.name, {}))
                others.append(process)
                pids[tree.name] = process.pid
            for tree in trees[1:]:
                _wait_http(f"http://127.0.0.1:{ports[tree.name]}/healthz",
                           others[trees.index(tree) - 1])
            print(f"CPUs' idle states: {cpus}; {halting}")
            for tree in trees:
                extra = " ".join(f"{k}={v}" for k, v in tree_env.get(tree.name, {}).items())
                print(f"{tree.name:<12} {tree.path} ({tree.python}), port {ports[tree.name]}"
                      + (f", {extra}" if extra else ""))
            for name in names:  # warm: each worker's first calls build its runtime
                wrk_load(ports[name], key, 1)
            figures = {name: Figures() for name in names}
            mock_p50: list[float] = []
            mock_p99: list[float] = []
            print()
            print(f"{'turn':>4} {'mock p50':>9}  " + "  ".join(f"{n + ' added':>16}"
                                                           for n in names))
            for turn in range(args.turns):
                mock, mock_tail, _ = _measure(args.mock_port, None, MOCK_SECRET,
                                              args.mock_seconds, args.model)
                mock_p50.append(mock)
                mock_p99.append(mock_tail)
                for name in order_of(turn, names):
                    p50, p99, cpu = _measure(ports[name], pids[name], key, args.seconds,
                                             args.model)
                    figures[name].added_p50.append(p50 - mock)
                    figures[name].p99.append(p99)
                    assert cpu is not None
                    figures[name].cpu_us.append(cpu)
                print(f"{turn + 1:>4} {mock:>9.3f}  " + "  ".join(
                    f"{figures[n].added_p50[-1]:>16.3f}" for n in names), flush=True)
            _report(names, figures, mock_p50, args.baseline, mock_p99)
        finally:
            for process in others:
                process.terminate()
            for process in others:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)")
    raise SystemExit(code)
