"""What one call used, by token class: the figures an upstream bills, as the gateway settles them
and the ledger records them.

Every API reports usage its own way (gateway/dialects.py reads each); this is the one shape the
rest of Tollgate sees. `input_tokens` and `output_tokens` are totals: quota counts their sum (every
token the upstream bills), and the classes say how much of each total is priced differently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The usage event's field for each class (the settle's JSON event, read by billing/ledger.py).
EVENT_FIELDS = {"input_tokens": "in", "output_tokens": "out", "cached_input_tokens": "ci",
                "cache_write_tokens": "cw", "reasoning_tokens": "rs"}
# The classes, each a part of a total: also the ledger's columns (billing.UsageRecord) and the
# reports' and usage API's fields.
TOKEN_CLASSES = ("cached_input_tokens", "cache_write_tokens", "reasoning_tokens")


def token_count(value: Any) -> int | None:
    """A token count as an upstream or an event reports it: an integer >= 0 (not a boolean),
    else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


@dataclass(frozen=True, slots=True)
class Usage:
    # Every input token billed: the uncached ones, cache reads and cache writes together.
    input_tokens: int = 0
    # Every output token billed, reasoning (thinking) included.
    output_tokens: int = 0
    cached_input_tokens: int = 0  # of input_tokens: read from the provider's prompt cache
    cache_write_tokens: int = 0  # of input_tokens: written to the prompt cache (Anthropic)
    reasoning_tokens: int = 0  # of output_tokens: reasoning / thinking

    def __post_init__(self) -> None:
        for name in EVENT_FIELDS:
            if token_count(getattr(self, name)) is None:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.cached_input_tokens + self.cache_write_tokens > self.input_tokens:
            raise ValueError("cached and cache-write tokens are part of input_tokens")
        if self.reasoning_tokens > self.output_tokens:
            raise ValueError("reasoning tokens are part of output_tokens")

    @property
    def total(self) -> int:
        """What the call's quota is charged: every token billed."""
        return self.input_tokens + self.output_tokens

    @property
    def plain_input_tokens(self) -> int:
        """Input tokens at the plain input price (neither read from nor written to a cache)."""
        return self.input_tokens - self.cached_input_tokens - self.cache_write_tokens

    @property
    def plain_output_tokens(self) -> int:
        return self.output_tokens - self.reasoning_tokens

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, *, cached: int = 0, cache_write: int = 0,
           reasoning: int = 0) -> Usage:
        """From an upstream's figures, clamping the classes into their totals (an upstream that
        reports more cached than input tokens is not trusted on the split, only on the totals)."""
        cache_write = min(cache_write, input_tokens)
        cached = min(cached, input_tokens - cache_write)
        return cls(input_tokens, output_tokens, cached, cache_write,
                   min(reasoning, output_tokens))

    def event_fields(self) -> dict[str, int]:
        """The usage event's fields: the totals always, a class only when not 0."""
        fields = {"in": self.input_tokens, "out": self.output_tokens}
        for name, short in EVENT_FIELDS.items():
            value = getattr(self, name)
            if value and short not in fields:
                fields[short] = value
        return fields

    @classmethod
    def from_event(cls, details: dict[str, Any]) -> Usage | None:
        """The usage an event carries; None without both totals or with a count that is not
        one (an event that has no split). The ledger's drain calls it once per event."""
        get = details.get
        values = (get("in"), get("out"), get("ci", 0), get("cw", 0), get("rs", 0))
        for value in values:
            # token_count's rule, inline (the event's JSON decodes to plain ints): an integer
            # >= 0, not a boolean, not None (a total missing).
            if value.__class__ is not int or value < 0:
                return None
        return cls.of(values[0], values[1], cached=values[2], cache_write=values[3],
                      reasoning=values[4])
