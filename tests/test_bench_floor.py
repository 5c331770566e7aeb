"""The floor bench's replay of the gateway's scripts (config/bench_floor.py): a MONITOR line read
back into its arguments, and each call's request id, queue deadline and usage put in the right
places of the captured reserve and settle, and nowhere else."""
from __future__ import annotations

import json
import time

import pytest

from config.bench_floor import _ARG, Template, _unescape

OLD = b"req_000000000000000000000000"
NEW = b"req_111111111111111111111111"


def _reserve(queue: bool) -> list[bytes]:
    """A reserve call of 2 counters and 1 bucket, with the queue values when `queue`."""
    keys = [b"tg:{t1}:hold:" + OLD, b"tg:{t1}:holds", b"tg:{t1}:q:tenant:d1", b"tg:{t1}:q:key:1:d1",
            b"tg:{t1}:rate:tenant:1000ms"]
    argv = [OLD, b"39", b"20", b"0", b"2", b"1", b"-1", b"600000", b'{"p":1}', b"24", b"15",
            b"150000", b"600000", b"0"]
    argv += [b"1000", b"0", b"100", b"10", b"0"] * 2 + [b"100", b"1000"]
    if queue:
        argv += [b"", b"20", b"1", b"3000", b"100", b"tg:queue-wake", b"1", b"1"]
    return [b"EVALSHA", b"sha-reserve", b"%d" % len(keys), *keys, *argv]


def _settle() -> list[bytes]:
    keys = [b"tg:{t1}:hold:" + OLD, b"tg:{t1}:holds", b"tg:{t1}:usage", b"tg:{t1}:q:tenant:d1"]
    event = json.dumps({"in": 6, "out": 16, "st": 200, "outcome": "complete"}).encode()
    fallback = json.dumps({"units": [0], "amount": "39", "created": "1", "meta": "{}"}).encode()
    return [b"EVALSHA", b"sha-settle", b"%d" % len(keys), *keys, OLD, b"22", b"3600", event,
            b"11", fallback, b"tg:queue-wake"]


def test_a_monitor_line_read_back_into_its_arguments() -> None:
    line = (rb'1796221493.429090 [0 unix:/tmp/r.sock] "EVALSHA" "sha" "1" "tg:{t1}:hold:r" '
            rb'"{\"p\":1,\"m\":\"a\\b\"}" "\x00\xff" "two\nlines"')
    args = [_unescape(a) for a in _ARG.findall(line)]
    assert args == [b"EVALSHA", b"sha", b"1", b"tg:{t1}:hold:r", b'{"p":1,"m":"a\\b"}',
                    b"\x00\xff", b"two\nlines"]


def test_each_reserve_gets_its_request_id_and_a_fresh_deadline() -> None:
    reserve = _reserve(queue=True)
    template = Template(reserve, _settle(), OLD)
    assert template.index_key == b"tg:{t1}:holds"
    assert template.counter_keys == [b"tg:{t1}:q:tenant:d1", b"tg:{t1}:q:key:1:d1"]
    before = int(time.time() * 1000)
    call = template.reserve_call(NEW)
    changed = {i for i, (a, b) in enumerate(zip(reserve, call, strict=True)) if a != b}
    deadline = len(reserve) - 8 + 2  # the queue values: order, priority, deadline_ms, ...
    assert changed == {3, 8, deadline}  # KEYS[1], ARGV[1], the deadline
    assert call[3] == b"tg:{t1}:hold:" + NEW and call[8] == NEW
    assert before + 30_000 <= int(call[deadline]) <= time.time() * 1000 + 30_000
    assert template.reserve == reserve  # the template itself is left as captured


def test_a_reserve_without_the_queue_has_no_deadline_to_move() -> None:
    reserve = _reserve(queue=False)
    call = Template(reserve, _settle(), OLD).reserve_call(NEW)
    assert [i for i, (a, b) in enumerate(zip(reserve, call, strict=True)) if a != b] == [3, 8]


def test_each_settle_gets_its_request_id_usage_and_hold() -> None:
    settle = _settle()
    template = Template(_reserve(queue=True), settle, OLD)
    call = template.settle_call(NEW, {"prompt_tokens": 6, "completion_tokens": 16}, 33, 1234)
    assert call[3] == b"tg:{t1}:hold:" + NEW and call[7] == NEW
    assert call[8] == b"22"  # actual: input + output
    assert json.loads(call[10]) == {"in": 6, "out": 16, "st": 200, "outcome": "complete"}
    assert json.loads(call[12]) == {"units": [0], "amount": "33", "created": "1234", "meta": "{}"}
    unchanged = [i for i in range(len(settle)) if i not in (3, 7, 8, 10, 12)]
    assert [call[i] for i in unchanged] == [settle[i] for i in unchanged]


def test_a_settle_of_another_usage_is_refused() -> None:
    """The replayed money (the settle's actual_money) is the captured call's: right only for its
    usage."""
    template = Template(_reserve(queue=True), _settle(), OLD)
    with pytest.raises(ValueError, match="captured call's"):
        template.settle_call(NEW, {"prompt_tokens": 7, "completion_tokens": 16}, 33, 1234)
