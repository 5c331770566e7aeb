"""Reading the Prometheus text format that /metrics answers with."""
from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (\S+)$')


def samples(text: str) -> dict[str, float]:
    """Every sample of the page, by name and labels (`name{label="x"}`), comments skipped."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out
