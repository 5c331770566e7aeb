"""gateway/forward.py usage_event: a call's usage event, the text json.dumps makes of it (the
ledger parses it; its figures are written in place for speed), for every shape a call's event
takes: each token class, a fallback model whose name needs escaping, no provider key, a soft or
streamed call, and figures json.dumps would write otherwise (a bool) handed to json.dumps."""
from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.forward import usage_event
from gateway.usage import Usage


def _dumped(tokens: dict[str, Any], status: Any, outcome: str, pk: Any, lat: Any, stream: bool,
            soft: bool, fb: str | None) -> str:
    return json.dumps({**tokens, "st": status, "outcome": outcome, "pk": pk, "lat": lat,
                       "stream": stream, "soft": soft, "fb": fb}, separators=(",", ":"))


CASES = [
    (Usage.of(12, 16).event_fields(), 200, "complete", 1, 3, False, False, None),
    (Usage.of(1200, 0, cached=1000, cache_write=50, reasoning=0).event_fields(), 200,
     "no_usage", 17, 0, True, True, "gpt-4o"),
    (Usage.of(5, 7, reasoning=3).event_fields(), 502, "upstream_broken_counted", None, 60000,
     True, False, 'a "quoted" \\ name \u00e9\u4e2d\n'),
    ({"in": 0, "out": 0}, 499, "client_gone", 2**40, 12, False, True, ""),
    ({"in": 3, "out": 4}, 200, 'out"come\u2028', 9, 1, False, False, None),
]


@pytest.mark.parametrize("case", CASES)
def test_the_event_is_the_text_json_dumps_makes(case: tuple[Any, ...]) -> None:
    made = usage_event(*case)
    assert made == _dumped(*case)
    assert json.loads(made)["outcome"] == case[2]


@pytest.mark.parametrize(("tokens", "status", "pk", "lat"), [
    ({"in": True, "out": 2}, 200, 1, 3),  # a bool is JSON's true, not 1
    ({"in": 1, "out": 2}, 200, True, 3),
    ({"in": 1, "out": 2}, 200, 1, 2.5),
    ({"in": 1.0, "out": 2}, 200, 1, 3),
])
def test_a_figure_that_is_not_a_plain_integer_is_written_as_json_dumps_writes_it(
        tokens: dict[str, Any], status: Any, pk: Any, lat: Any) -> None:
    case = (tokens, status, "complete", pk, lat, False, False, None)
    assert usage_event(*case) == _dumped(*case)
