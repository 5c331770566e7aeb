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

try:
    from hiredis import pack_command as _pack_command
except ImportError:  # a declared dependency; the loop in bulks() packs the same bytes
    _pack_command = None

_PACKED_TYPES = frozenset((str, int))


def bulks(values: Sequence[str | int]) -> bytes:
    """`values` as RESP bulk strings, encoded as hiredis.pack_command encodes them (str as UTF-8,
    int in decimal), by hiredis itself when it is there (about 1 us less for the reserve's 20
    changing arguments than the loop below). Only those two types: a bool or a float packed
    here by mistake would differ from what redis-py sends, so it is refused."""
    if not _PACKED_TYPES.issuperset(map(type, values)):
        wrong = next(v for v in values if type(v) not in _PACKED_TYPES)
        raise TypeError(f"only str and int are packed ahead, not {type(wrong).__name__}")
    if not values:
        return b""
    if _pack_command is not None:
        command = _pack_command(tuple(values))
        return command[command.index(b"\r\n") + 2:]  # without its "*<count>" line
    out = []
    for value in values:
        data = value.encode() if type(value) is str else b"%d" % value
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def packed(count: int, parts: Sequence[bytes]) -> bytes:
    """The command of `count` arguments whose bulk strings (`bulks`) are `parts`, in order."""
    return b"*%d\r\n%s" % (count, b"".join(parts))
