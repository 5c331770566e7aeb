"""`make bench-turns` (config/bench_turns.py): how trees are named, ordered by turns and
compared. The run itself needs wrk and minutes of load (a benchmark, not a test); what it
computes from the turns is checked here."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from config.bench import ROOT
from config.bench_turns import (
    THIS,
    Figures,
    Tree,
    _report,
    main,
    median_interval,
    order_of,
    parse_tree,
    parse_tree_env,
    ratios,
)


def test_a_tree_is_a_name_and_a_checkout() -> None:
    assert parse_tree(f"base={ROOT}") == Tree("base", ROOT)


@pytest.mark.parametrize("text", ["base", "=.", "base=", f"{THIS}={ROOT}"])
def test_a_tree_without_a_name_or_path_or_named_like_this_checkout_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_tree(text)


def test_a_path_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a checkout"):
        parse_tree(f"base={tmp_path}")


def test_a_tree_runs_on_its_own_venv_when_it_has_one(tmp_path: Path) -> None:
    assert Tree("x", tmp_path).python != str(tmp_path / ".venv" / "bin" / "python")
    own = tmp_path / ".venv" / "bin" / "python"
    own.parent.mkdir(parents=True)
    own.touch()
    assert Tree("x", tmp_path).python == str(own)


def test_a_tree_s_variable_is_its_name_and_an_assignment() -> None:
    assert parse_tree_env("nospin:GATEWAY_IDLE_SPIN_US=0") == ("nospin", "GATEWAY_IDLE_SPIN_US",
                                                                "0")
    assert parse_tree_env("a:X=") == ("a", "X", "")  # an empty value is a value
    for text in ("nospin", ":X=1", "a:=1", "a:X"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tree_env(text)


def test_the_order_is_reversed_every_other_turn() -> None:
    names = ["this", "base", "prev"]
    assert order_of(0, names) == names
    assert order_of(1, names) == ["prev", "base", "this"]
    assert order_of(2, names) == names
    # Over two turns each tree has every position's neighbour once: none is always first.
    assert {order_of(0, names)[0], order_of(1, names)[0]} == {"this", "prev"}


def test_the_ratio_is_taken_turn_by_turn() -> None:
    # The machine slows down by half at turn 2: both trees with it, the ratio stays.
    tree = Figures(added_p50=[0.6, 0.9, 0.62])
    base = Figures(added_p50=[1.0, 1.5, 1.0])
    assert ratios(tree, base) == pytest.approx([0.6, 0.6, 0.62])
    assert statistics.median(ratios(tree, base)) == pytest.approx(0.6)


def test_a_turn_whose_baseline_added_nothing_is_left_out_of_the_ratios() -> None:
    assert ratios(Figures(added_p50=[0.5, 0.6]), Figures(added_p50=[0.0, 1.0])) == [0.6]


def test_the_median_s_interval_holds_it_is_ordered_and_repeatable() -> None:
    values = [0.58, 0.6, 0.61, 0.59, 0.63, 0.6, 0.75, 0.57, 0.6, 0.62]
    low, high = median_interval(values)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)
    assert median_interval(values) == (low, high)
    assert median_interval([0.6] * 8) == (0.6, 0.6)


@pytest.mark.parametrize(("argv", "says"), [
    (["--turns", "0"], "--turns must be at least 1"),
    (["--seconds", "0.5"], "must be at least 1"),
    (["--mock-seconds", "0"], "must be at least 1"),
    (["--tree", f"base={ROOT}", "--gateway-port", "18000", "--mock-port", "18001"],
     "the gateways take ports 18000-18001"),
    (["--baseline", "nobody"], "--baseline 'nobody' is none of"),
    (["--tree", f"base={ROOT}", "--tree", f"base={ROOT}"], "a name of its own"),
    (["--tree", f"base={ROOT}", "--tree-env", "other:X=1"], "'other': not a --tree name"),
    (["--tree-env", f"{THIS}:X=1"], "not a --tree name"),
    (["--tree", f"base={ROOT}", "--tree-env", "base=X"], "expected NAME:VAR=VALUE"),
])
def test_bad_arguments_are_refused_before_anything_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2  # argparse's error, before wrk or any server is looked for
    assert says in capsys.readouterr().err


def test_a_report_without_any_ratio_to_tell_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"this": Figures([0.5], [1.0], [500.0]), "base": Figures([0.0], [1.0], [800.0])}
    _report(["this", "base"], figures, [0.05], "base")
    [line] = [row for row in capsys.readouterr().out.splitlines() if row.startswith("this ")]
    assert line.split()[-1] == "n/a"


def test_the_report_gives_the_mock_s_own_p99_the_machine_s_tail_for_one_hop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = {"this": Figures([0.5, 0.6], [1.0, 1.4], [500.0, 520.0])}
    _report(["this"], figures, [0.05, 0.07], None, [0.2, 0.9, 0.4])
    [line] = [row for row in capsys.readouterr().out.splitlines() if row.startswith("mock alone")]
    assert "p50 0.060 ms, p99 0.40 ms" in line  # medians of the turns
