"""Reading the Prometheus text format that /metrics answers with."""
from __future__ import annotations

import re
from typing import Any

# Label values are quoted and may hold any character, braces included ("models/{id}"); only a
# quote, a backslash and a newline are escaped.
_SAMPLE = re.compile(r'^([a-z_]+)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _key(name: str, labels: str | None) -> str:
    """`name{a="x",b="y"}` with its labels in name order: the format does not order them
    (prometheus_client writes them sorted), so a lookup must not depend on it."""
    if not labels:
        return name
    pairs = sorted(_LABEL.findall(labels))
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


def _normal(key: str) -> str:
    name, brace, rest = key.partition("{")
    return _key(name, brace + rest if brace else None)


class Samples(dict[str, float]):
    """Samples by `name{labels}`, looked up whatever the order of the labels in the key."""

    def __getitem__(self, key: str) -> float:
        return super().__getitem__(_normal(key))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(_normal(key))

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(_normal(key), default)


def samples(text: str) -> Samples:
    """Every sample of the page, by name and labels (`name{label="x"}`), comments skipped."""
    out = Samples()
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        dict.__setitem__(out, _key(match.group(1), match.group(2)), float(match.group(3)))
    return out
