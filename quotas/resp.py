"""Commands packed ahead, in Redis's protocol (RESP): the bytes hiredis.pack_command makes.

A reserve's command is mostly the same bytes call after call: its counters' keys and windows,
its buckets, its queue's keys (quotas/engine.py keeps them packed per request shape and window).
hiredis packs all of its ~120 arguments every time, about 10 us on the bench machine, where
packing the dozen that change takes about 2 us (docs/benchmarks.md, "Issue 16 item 3: the
quota calls in fewer steps"). tests/quotas/test_packed_reserve.py holds the result equal to
hiredis's.
"""
from __future__ import annotations

from collections.abc import Sequence


def bulks(values: Sequence[str | int]) -> bytes:
    """`values` as RESP bulk strings, encoded as hiredis.pack_command encodes them (str as UTF-8,
    int in decimal). Only those two types: a bool or a float packed here by mistake would differ
    from what redis-py sends, so it is refused."""
    out = []
    for value in values:
        if type(value) is str:
            data = value.encode()
        elif type(value) is int:
            data = b"%d" % value
        else:
            raise TypeError(f"only str and int are packed ahead, not {type(value).__name__}")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def packed(count: int, parts: Sequence[bytes]) -> bytes:
    """The command of `count` arguments whose bulk strings (`bulks`) are `parts`, in order."""
    return b"*%d\r\n%s" % (count, b"".join(parts))
