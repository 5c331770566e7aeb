"""A reserve's command is packed ahead (quotas/resp.py, quotas/engine.py _Windowed): its
unchanging stretches once per request shape and window, the dozen arguments that change on each
call. What goes to Redis must be, byte for byte, what hiredis.pack_command makes of the same
EVALSHA, its keys and its arguments, for every shape of request; and the engine must send it only
where EVALSHA goes on the script connections, falling back as EVALSHA does (NOSCRIPT)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import hiredis
import pytest
import redis

from quotas import keys, resp
from quotas.client import make_async_redis
from quotas.engine import (
    AsyncQuotaEngine,
    ConcurrencyLimit,
    EngineSettings,
    Hold,
    QueueTicket,
    QuotaEngine,
    RateLimit,
    ReserveRequest,
    ScopeLimit,
    Unit,
    _Calls,
)
from quotas.windows import RedisClock, WindowKind
from tests.quotas.conftest import new_tenant
from tests.private_redis import PrivateRedis, private_redis  # noqa: F401 - fixture
from tests.support.script_sends import packed_sends
from tests.quotas.test_reserve_shapes import GAUGE, LIMITS, RATES

SHA = "ab" * 20
HEAD = resp.bulks(("EVALSHA", SHA))
DAY = WindowKind.DAY


def _hiredis(call_keys: list[str], args: list[object]) -> bytes:
    return hiredis.pack_command(("EVALSHA", SHA, len(call_keys), *call_keys, *args))


def _requests(tenant: str, clock: RedisClock) -> list[ReserveRequest]:
    ticket = QueueTicket(-7, clock.now_ms() + 60_000, 5000, 100)
    ordered = QueueTicket(3, clock.now_ms() + 60_000, 5000, 100, order=-(3 << 32) + 17)
    one = (ScopeLimit("tenant", DAY, -1),)
    return [
        ReserveRequest(tenant, "plain", 10, one),
        ReserveRequest(tenant, "every-part", 2**40, LIMITS, rates=RATES, concurrency=GAUGE,
                       min_amount=3, money_amount=10**15, input_tokens=7, price_in=150,
                       price_out=600, check_epoch=True, queue=ticket,
                       meta='{"p":1,"m":"gpt-4o-mini","who":"é ü 漢 \\r\\n $3"}'),
        ReserveRequest(tenant, "queued-again", 5, LIMITS, rates=RATES, concurrency=GAUGE,
                       queue=ordered),
        ReserveRequest(tenant, "dry", 1, LIMITS, dry_run=True),
        ReserveRequest(tenant, "no-gauge", 9, LIMITS, rates=RATES),
        ReserveRequest(tenant, "gauge-only", 9, one, concurrency=ConcurrencyLimit("key:k", 0)),
        ReserveRequest(tenant, "money", 9,
                       (ScopeLimit("tenant", WindowKind.MONTH, 10**9, Unit.MICROS),)),
    ]


def test_the_packed_command_is_what_hiredis_packs_for_every_shape() -> None:
    clock = RedisClock()
    calls = _Calls(EngineSettings(), clock, HEAD)
    tenant = new_tenant()
    for request in _requests(tenant, clock):
        first = calls.reserve(request)  # the shape and its window's stretches built
        again = calls.reserve(request)  # reused
        assert first.command == _hiredis(first.keys, first.args), request.request_id
        assert again.command == first.command, request.request_id


def test_a_reused_shape_packs_what_changes_per_call() -> None:
    clock = RedisClock()
    calls = _Calls(EngineSettings(), clock, HEAD)
    tenant = new_tenant()
    ticket = QueueTicket(1, clock.now_ms() + 60_000, 5000, 100)
    calls.reserve(ReserveRequest(tenant, "a", 10, LIMITS, rates=RATES, queue=ticket))
    later = QueueTicket(1, ticket.deadline_ms + 1, 5000, 100)
    second = calls.reserve(ReserveRequest(tenant, "b", 11, LIMITS, rates=RATES, queue=later,
                                          min_amount=4, meta="m"))
    assert second.command == _hiredis(second.keys, second.args)
    assert b"$1\r\nb\r\n" in second.command and b"tg:{" in second.command
    assert f"{later.deadline_ms}".encode() in second.command


def test_a_window_moving_on_repacks_its_stretches() -> None:
    clock = RedisClock()
    calls = _Calls(EngineSettings(), clock, HEAD)
    tenant = new_tenant()
    request = ReserveRequest(tenant, "r", 10, LIMITS, rates=RATES, concurrency=GAUGE)
    before = calls.reserve(request)
    clock.offset_ms += 86_400_000  # a day later on the learnt Redis clock: every window moves
    after = calls.reserve(request)
    assert after.keys != before.keys
    assert after.command == _hiredis(after.keys, after.args)


@pytest.mark.parametrize("with_hiredis", [True, False])
def test_bulks_are_hiredis_bulk_strings_with_or_without_hiredis(
        with_hiredis: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not with_hiredis:
        monkeypatch.setattr(resp, "_pack_command", None)  # the loop that packs without it
    # A first value with a space stays one bulk string (no command name is split here).
    values = ["a b", 0, -7, 2**70, "", "é 漢 \r\n $3", '{"m":"gpt 4"}']
    assert resp.bulks(values) == hiredis.pack_command(tuple(values))[len(b"*7\r\n"):]
    assert resp.bulks([]) == b""


@pytest.mark.parametrize("value", [True, 1.5, None, b"x"])
def test_only_str_and_int_are_packed_ahead(value: object) -> None:
    # A bool or a float would be packed differently from redis-py's encoder: refused, not guessed.
    with pytest.raises(TypeError):
        resp.bulks(["ok", value])  # type: ignore[list-item]


def with_engine(url: str, scenario: Callable[[AsyncQuotaEngine], Awaitable[None]], *,
                cluster: bool = False) -> None:
    """`scenario` run with an AsyncQuotaEngine over the gateway's client for `url`, closed after."""
    async def run() -> None:
        client = make_async_redis(url, cluster=cluster)
        try:
            await scenario(AsyncQuotaEngine(client))
        finally:
            await client.aclose()

    asyncio.run(run())


def _open_holds(redis_url: str, tenant: str) -> list[str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return QuotaEngine(client).open_hold_ids(tenant)
    finally:
        client.close()


def test_the_engine_sends_the_packed_command_on_the_script_connections(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        request = ReserveRequest(tenant, "r1", 40, LIMITS, rates=RATES, concurrency=GAUGE)
        reservation = await engine.reserve(request)
        assert reservation.admitted and reservation.granted == 40
        assert reservation.hold is not None
        assert [s.remaining for s in reservation.counters[:3]] == [960, 9960, 760]
        # Sent once, as packed, and its hold is the one the script wrote.
        assert len(sent) == 1 and b"$2\r\nr1\r\n" in sent[0]
        assert (await engine.settle(reservation.hold, 25)).outcome == "settled"

    with_engine(redis_url, scenario)
    assert _open_holds(redis_url, tenant) == []


def test_a_server_without_the_script_loads_it_as_evalsha_does(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The packed command names a digest the server does not know (NOSCRIPT, as after a SCRIPT
    # FLUSH or a failover to an empty replica): the script is loaded and run with the same keys
    # and arguments, once.
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        engine._calls.reserve_head = resp.bulks(("EVALSHA", "0" * 40))
        reservation = await engine.reserve(ReserveRequest(tenant, "r1", 40, LIMITS))
        assert reservation.admitted and reservation.granted == 40
        assert len(sent) == 1 and b"0" * 40 in sent[0]
        used = {s.scope: s.remaining for s in reservation.counters if s.window.kind is DAY}
        assert used == {"tenant": 960, "key:k": 760}

    with_engine(redis_url, scenario)
    assert _open_holds(redis_url, tenant) == ["r1"]


@pytest.mark.cluster
def test_a_cluster_reserve_goes_through_evalsha(redis_cluster_url: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        reservation = await engine.reserve(ReserveRequest(tenant, "r1", 40, LIMITS))
        assert reservation.admitted and reservation.granted == 40
        assert sent == []  # no script connections on a cluster: redis-py's EVALSHA

    with_engine(redis_cluster_url, scenario, cluster=True)


# -- the settle, packed while the upstream answers ------------------------------------------------


def _hold(tenant: str, *, gauge: bool, money: int = 0, meta: str = "") -> Hold:
    counter_keys = tuple(keys.counter_key(tenant, scope, "d2026-12-03")
                         for scope in ("tenant", "key:k"))
    return Hold(tenant, "req_1", 40, counter_keys,
                keys.gauge_key(tenant, "key:k") if gauge else "", money, (0, 0), meta,
                1796278300207)


@pytest.mark.parametrize("gauge", [True, False])
def test_the_packed_settle_is_what_hiredis_packs(gauge: bool) -> None:
    calls = _Calls(EngineSettings(), RedisClock(), HEAD)
    hold = _hold(new_tenant(), gauge=gauge, money=12, meta='{"m":"é 漢 \\r\\n $5"}')
    packed = calls.packed_settle(hold, SHA)
    for actual, event, money in [(0, "", 0), (17, '{"in":1,"out":16,"w":"ü"}', 10**12)]:
        expected = _hiredis(calls.end_keys(hold), calls.settle_args(hold, actual, event, money))
        assert packed.command(actual, event, money) == expected


def test_a_packed_settle_ends_the_hold_as_the_plain_one(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()
    event = '{"in":3,"out":7,"note":"é"}'

    async def scenario(engine: AsyncQuotaEngine) -> None:
        first = await engine.reserve(ReserveRequest(tenant, "a", 40, LIMITS, rates=RATES,
                                                    concurrency=GAUGE, meta="m"))
        second = await engine.reserve(ReserveRequest(tenant, "b", 40, LIMITS, meta="m"))
        assert first.hold is not None and second.hold is not None
        packed = engine.packed_settle(first.hold)
        assert packed is not None and packed.hold is first.hold
        sent.clear()
        result = await engine.settle(first.hold, 10, event, 5, packed)
        assert (result.outcome, result.held, result.charged) == ("settled", 40, 10)
        assert len(sent) == 1 and sent[0] == packed.command(10, event, 5)
        # Packed for another hold: not used (the other hold's own keys and id are sent).
        sent.clear()
        other = await engine.settle(second.hold, 20, event, 0, packed)
        assert (other.outcome, other.charged) == ("settled", 20) and sent == []
        # Again: settled already, the same answer as the plain settle gives.
        assert (await engine.settle(first.hold, 10, event, 5, packed)).outcome == \
            (await engine.settle(first.hold, 10, event, 5)).outcome

    with_engine(redis_url, scenario)
    sync = QuotaEngine(redis.Redis.from_url(redis_url, decode_responses=True))
    assert sync.open_hold_ids(tenant) == []
    day = sync.counter(tenant, "tenant")
    assert (day.used, day.pending) == (30, 0)
    events = [fields for _, fields in sync.client.xrange(keys.usage_stream_key(tenant))]
    assert [e["event"] for e in events[:2]] == [event, event]
    assert [e["request_id"] for e in events[:2]] == ["a", "b"]


def test_a_packed_settle_to_a_server_without_the_script_loads_it(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        reservation = await engine.reserve(ReserveRequest(tenant, "a", 40, LIMITS))
        hold = reservation.hold
        assert hold is not None
        packed = engine._calls.packed_settle(hold, "0" * 40)
        result = await engine.settle(hold, 9, "{}", 0, packed)
        assert (result.outcome, result.charged) == ("settled", 9)
        assert b"0" * 40 in sent[-1]

    with_engine(redis_url, scenario)
    sync = QuotaEngine(redis.Redis.from_url(redis_url, decode_responses=True))
    day = sync.counter(tenant, "tenant")
    assert (day.used, day.pending) == (9, 0)


@pytest.mark.cluster
def test_a_cluster_engine_packs_no_settle(redis_cluster_url: str) -> None:
    async def scenario(engine: AsyncQuotaEngine) -> None:
        reservation = await engine.reserve(ReserveRequest(new_tenant(), "a", 4, LIMITS))
        assert reservation.hold is not None
        assert engine.packed_settle(reservation.hold) is None

    with_engine(redis_cluster_url, scenario, cluster=True)


def test_an_engine_that_sends_nothing_packed_packs_nothing() -> None:
    # The sync engine (and any _Calls without the reserve's head) builds the arguments only.
    calls = _Calls(EngineSettings(), RedisClock())
    call = calls.reserve(ReserveRequest(new_tenant(), "r", 10, LIMITS, rates=RATES))
    assert call.command == b"" and call.args and call.keys


def test_a_fractional_min_amount_is_refused() -> None:
    # Packed ahead, a float could not be sent as redis-py sent it ("3.0"): refused at the door.
    with pytest.raises(ValueError, match="min_amount"):
        ReserveRequest(new_tenant(), "r", 10, LIMITS, min_amount=3.0)  # type: ignore[arg-type]


def test_a_settle_packed_by_another_engine_is_not_sent(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its digest and tombstone are that engine's: the settle goes the plain way.
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        other = AsyncQuotaEngine(engine.client, EngineSettings(tombstone_s=7200))
        reservation = await engine.reserve(ReserveRequest(tenant, "a", 40, LIMITS))
        hold = reservation.hold
        assert hold is not None
        foreign = other.packed_settle(hold)
        assert foreign is not None
        sent.clear()
        result = await engine.settle(hold, 9, "{}", 0, foreign)
        assert (result.outcome, result.charged) == ("settled", 9) and sent == []

    with_engine(redis_url, scenario)


def test_after_a_script_flush_the_packed_calls_load_their_scripts(
        private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A server that lost its scripts (SCRIPT FLUSH, a restart, a failover to an empty replica):
    the packed reserve and settle are refused NOSCRIPT, their scripts are loaded and run once,
    and the next calls go packed again. On a Redis of the test's own: the session's shared one
    keeps its scripts."""
    sent = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        warm = await engine.reserve(ReserveRequest(tenant, "w", 10, LIMITS))
        assert warm.hold is not None
        await engine.settle(warm.hold, 10, "{}", 0, engine.packed_settle(warm.hold))
        await engine.client.script_flush()
        sent.clear()
        first = await engine.reserve(ReserveRequest(tenant, "a", 40, LIMITS))
        assert first.admitted and first.hold is not None
        packed = engine.packed_settle(first.hold)
        result = await engine.settle(first.hold, 25, "{}", 0, packed)
        assert (result.outcome, result.held, result.charged) == ("settled", 40, 25)
        assert len(sent) == 2  # each packed once, refused, then run by the script object
        second = await engine.reserve(ReserveRequest(tenant, "b", 5, LIMITS))
        assert second.hold is not None
        await engine.settle(second.hold, 5, "{}", 0, engine.packed_settle(second.hold))
        assert len(sent) == 4  # packed again, and answered

    with_engine(private_redis.url, scenario)
    sync = QuotaEngine(private_redis.client())
    day = sync.counter(tenant, "tenant")
    assert (day.used, day.pending) == (40, 0) and sync.open_hold_ids(tenant) == []


# -- the reserve written before the call's task starts ---------------------------------------------


def test_a_reserve_sent_ahead_answers_as_reserve(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncQuotaEngine.send_reserve writes the reserve's packed command in the caller's own step
    (the gateway then starts the call's task while Redis runs it): the hold is in Redis before
    the event loop turns. reserve(request, sent) gives the Reservation reserve() would, and the
    connection
    back. A tenant whose activity mark is not written yet: None (reserve() writes the mark
    first)."""
    sent_commands = packed_sends(monkeypatch)
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        assert engine.send_reserve(ReserveRequest(tenant, "first", 10, LIMITS)) is None
        first = await engine.reserve(ReserveRequest(tenant, "first", 10, LIMITS))
        assert first.admitted
        sent_commands.clear()
        request = ReserveRequest(tenant, "ahead", 40, LIMITS, rates=RATES, concurrency=GAUGE)
        sent = engine.send_reserve(request)
        assert sent is not None and sent.call.request is request
        assert len(sent_commands) == 1 and b"$5\r\nahead\r\n" in sent_commands[0]
        # Still in this step: a blocking client finds the hold.
        for _ in range(2000):
            if "ahead" in _open_holds(redis_url, tenant):
                break
        assert "ahead" in _open_holds(redis_url, tenant)
        reservation = await engine.reserve(request, sent)
        assert reservation.admitted and reservation.granted == 40
        assert reservation.hold is not None and reservation.hold.request_id == "ahead"
        assert [s.remaining for s in reservation.counters[:3]] == [950, 9950, 750]
        scripts = engine.client.scripts
        assert scripts.in_use == 0 and len(sent_commands) == 1

    with_engine(redis_url, scenario)
    assert sorted(_open_holds(redis_url, tenant)) == ["ahead", "first"]


def test_a_reserve_sent_ahead_whose_connection_breaks_holds_once(
        redis_url: str) -> None:
    """The connection breaks right after send_reserve wrote: reserve sends it once more on
    a new connection; whether Redis ran the first write or not, the call holds its tokens once
    (a second run finds the hold: the duplicate reply recovers it)."""
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        assert (await engine.reserve(ReserveRequest(tenant, "first", 10, LIMITS))).admitted
        request = ReserveRequest(tenant, "ahead", 40, LIMITS)
        sent = engine.send_reserve(request)
        assert sent is not None
        sent.sent.conn.transport.abort()  # injected: the socket breaks after the write
        reservation = await engine.reserve(request, sent)
        assert reservation.admitted and reservation.granted == 40
        assert reservation.hold is not None and reservation.hold.amount == 40
        assert engine.client.scripts.in_use == 0

    with_engine(redis_url, scenario)
    assert sorted(_open_holds(redis_url, tenant)) == ["ahead", "first"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        day = QuotaEngine(client).counter(tenant, "tenant")
    finally:
        client.close()
    assert (day.used, day.pending) == (0, 50)


def test_a_reserve_sent_ahead_to_a_server_without_the_script_loads_it(
        private_redis: PrivateRedis) -> None:  # noqa: F811
    # NOSCRIPT for the command written ahead: the script is loaded and run once, as EVALSHA does.
    # Its round trip (the gateway's Redis latency histogram) is then the whole of it, from the
    # write to the script's reply: no reply ended it on its own connection.
    tenant = new_tenant()

    async def scenario(engine: AsyncQuotaEngine) -> None:
        assert (await engine.reserve(ReserveRequest(tenant, "first", 10, LIMITS))).admitted
        await engine.client.script_flush()
        request = ReserveRequest(tenant, "ahead", 40, LIMITS)
        sent = engine.send_reserve(request)
        assert sent is not None
        reservation = await engine.reserve(request, sent)
        assert reservation.admitted and reservation.granted == 40
        assert sent.sent.replied_at == 0.0
        assert 0 < sent.sent.round_trip() <= time.perf_counter() - sent.sent.at

    with_engine(private_redis.url, scenario)
    sync = QuotaEngine(private_redis.client())
    day = sync.counter(tenant, "tenant")
    assert (day.used, day.pending) == (0, 50)
    assert sorted(sync.open_hold_ids(tenant)) == ["ahead", "first"]
