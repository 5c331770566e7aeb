"""The bounded spin (quotas/loop_spin.py): after a kick the loop keeps turning instead of
sleeping, for at most its budget after the latest kick, with one callback however many kicks;
a wait longer than the budget costs no more CPU than the budget. On both loops the gateway and
the tests run: uvloop and asyncio's own. Its callers are pinned too: the script pool's write,
redis-py's path for the scripts, the cluster client, the upstream transport's request."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from django.test import override_settings

from quotas import loop_spin
from quotas.loop_spin import LoopSpin, SpinSite

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
loops = pytest.mark.parametrize("kind", sorted(LOOPS))


def _run(kind: str, scenario: Callable[[], Awaitable[Any]]) -> Any:
    loop = LOOPS[kind]()
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.close()


@loops
def test_a_kick_keeps_the_loop_turning_then_it_stops(kind: str) -> None:
    async def scenario() -> tuple[int, int, bool]:
        spin = LoopSpin(asyncio.get_running_loop(), budget_ns=2_000_000)  # 2 ms
        spin.kick()
        await asyncio.sleep(0.3)  # far past the budget, even on a loaded machine
        stopped_at = spin.turns
        await asyncio.sleep(0.1)
        return stopped_at, spin.turns, spin.spinning

    stopped_at, later, spinning = _run(kind, scenario)
    assert stopped_at > 1  # it turned: the loop polled instead of sleeping through the 2 ms
    assert later == stopped_at and not spinning  # and then it stopped for good


@loops
def test_many_kicks_make_one_callback_and_move_the_end(kind: str) -> None:
    async def scenario() -> tuple[int, int]:
        spin = LoopSpin(asyncio.get_running_loop(), budget_ns=10_000_000_000)  # 10 s
        for _ in range(100):
            spin.kick()
        await asyncio.sleep(0)  # one turn of the loop
        await asyncio.sleep(0)
        after_two_turns = spin.turns
        spin.budget_ns = 0  # ends it at its next turn, without waiting 10 s
        spin.until_ns = 0
        await asyncio.sleep(0.05)
        return after_two_turns, spin.spinning

    after_two_turns, spinning = _run(kind, scenario)
    assert after_two_turns <= 2  # one callback a turn, not one per kick
    assert not spinning


@loops
def test_a_budget_of_zero_never_spins(kind: str) -> None:
    async def scenario() -> tuple[int, bool]:
        spin = LoopSpin(asyncio.get_running_loop(), budget_ns=0)
        spin.kick()
        await asyncio.sleep(0.02)
        return spin.turns, spin.spinning

    assert _run(kind, scenario) == (0, False)


@loops
def test_a_loop_with_two_calls_in_flight_does_not_spin(kind: str) -> None:
    async def scenario() -> list[tuple[int, int]]:
        spin = LoopSpin(asyncio.get_running_loop(), budget_ns=1_000_000)
        seen = []
        for calls in ([], ["a"], ["a", "b"], ["a", "b", "c"], ["a"]):
            spin.in_flight = calls
            seen.append((len(calls), spin.kick()))
        return seen

    assert [(calls, bool(end)) for calls, end in _run(kind, scenario)] == [
        (0, True), (1, True), (2, False), (3, False), (1, True)]


def _site_kicks(site: SpinSite, replies: list[str]) -> list[bool]:
    """Kicks of `site` on a loop whose spin is on (1 ms), each judged by the next of `replies`
    ("hit": its reply came within the spin, "miss": after it); whether each kick spun. A kick
    that does not spin takes no reply (nothing to judge)."""

    async def scenario() -> list[bool]:
        loop = asyncio.get_running_loop()
        spun_list, pending = [], list(replies)
        while pending:
            spun = site.kick(loop)
            spun_list.append(bool(spun))
            if spun:
                reply = pending.pop(0)
                site.replied(spun + 10**12 if reply == "hit" else 1)  # now is before / after
        return spun_list

    with override_settings(GATEWAY_IDLE_SPIN_US=1000):
        return _run("uvloop", scenario)


def test_a_site_whose_replies_come_within_the_spin_spins_every_time() -> None:
    assert _site_kicks(SpinSite(), ["hit"] * 5) == [True] * 5


def test_a_site_that_keeps_missing_sleeps_through_1_2_4_then_up_to_64_waits_between_tries(
) -> None:
    spun = _site_kicks(SpinSite(), ["miss"] * 11)
    skipped = [len(run) for run in "".join("s" if s else "." for s in spun).split("s")[1:-1]]
    assert skipped == [0, 0, 1, 2, 4, 8, 16, 32, 64, 64]  # three misses in a row, then backoff


def test_a_late_reply_now_and_then_does_not_stop_the_spin() -> None:
    spun = _site_kicks(SpinSite(), ["hit", "miss", "hit", "miss", "miss", "hit", "miss"])
    assert spun == [True] * 7


def test_a_hit_after_misses_makes_the_site_spin_again_at_once() -> None:
    spun = _site_kicks(SpinSite(), ["miss", "miss", "miss", "hit", "miss", "hit"])
    assert spun == [True, True, True, False, True, True, True]


def test_a_reply_is_judged_by_when_it_arrived_not_when_its_caller_got_to_it() -> None:
    site = SpinSite()
    for _ in range(3):
        site.replied(kicked=5, arrived=4)  # came in time, read long after (now is past 5)
    assert (site.misses, site.skips) == (0, 0)
    for _ in range(3):
        site.replied(kicked=5, arrived=6)
    assert (site.misses, site.skips) == (3, 1)


def test_a_wait_that_did_not_spin_or_failed_changes_nothing() -> None:
    site = SpinSite()
    site.replied(0)  # a skipped wait's (or a spin that is off): nothing to judge
    assert (site.skips, site.backoff) == (0, 0)
    with override_settings(GATEWAY_IDLE_SPIN_US=0):
        assert _run("uvloop", lambda: _kick_async(site)) == 0  # off: no spin, no record


async def _kick_async(site: SpinSite) -> int:
    return site.kick(asyncio.get_running_loop())


def test_a_long_wait_after_a_kick_costs_the_budget_not_the_wait() -> None:
    """A call waiting a real model's seconds: the loop polls for its budget, then sleeps. The
    bound is the budget (5 ms here) against a wait of 0.5 s: a spin that ignored its budget
    would burn the whole 0.5 s; the margin is for a loaded machine's noise."""

    async def scenario() -> tuple[float, int]:
        spin = LoopSpin(asyncio.get_running_loop(), budget_ns=5_000_000)
        before = time.thread_time()
        spin.kick()
        await asyncio.sleep(0.5)
        return time.thread_time() - before, spin.turns

    cpu, turns = _run("uvloop", scenario)
    assert turns > 1
    assert cpu < 0.1, f"{cpu:.3f} s of CPU over a 0.5 s wait with a 5 ms budget"


@loops
def test_each_loop_has_its_spin_with_the_setting_as_it_was_then(kind: str) -> None:
    async def spin_of_this_loop() -> LoopSpin:
        loop = asyncio.get_running_loop()
        spin = loop_spin.loop_spin(loop)
        assert loop_spin.loop_spin(loop) is spin  # one per loop
        return spin

    with override_settings(GATEWAY_IDLE_SPIN_US=300):
        first = _run(kind, spin_of_this_loop)
    with override_settings(GATEWAY_IDLE_SPIN_US=0):
        second = _run(kind, spin_of_this_loop)
    assert first is not second
    assert (first.budget_ns, second.budget_ns) == (300_000, 0)


def _turns_after(kind: str, scenario: Callable[[], Awaitable[None]]) -> int:
    """How many turns the running loop's spin took during `scenario`, with a budget of 10 ms
    (the largest the setting takes)."""

    async def measured() -> int:
        spin = loop_spin.loop_spin(asyncio.get_running_loop())
        await scenario()
        await asyncio.sleep(0)  # a kick at the scenario's very end turns from the next turn on
        turns = spin.turns
        spin.until_ns = 0  # stop it now rather than in 1 s
        await asyncio.sleep(0.01)
        return turns

    with override_settings(GATEWAY_IDLE_SPIN_US=10_000):
        return _run(kind, measured)


def test_the_script_pool_spins_after_writing_a_script_call(redis_url: str) -> None:
    from quotas.client import make_async_redis

    async def scenario() -> None:
        client = make_async_redis(redis_url, cluster=False)
        script = client.register_script("return 1")
        assert await script() == 1
        await client.aclose()

    assert _turns_after("uvloop", scenario) > 0


def test_a_script_call_written_ahead_and_read_late_is_no_miss(redis_url: str) -> None:
    """The gateway writes its reserve, then does the call's other work, then reads the reply
    (ScriptPool.send_now): a reply that came within the spin is a hit however late it is read."""
    from quotas.client import make_async_redis

    async def scenario() -> tuple[int, int]:
        client = make_async_redis(redis_url, cluster=False)
        pool = client.script_pool()
        assert pool is not None
        sha = await client.script_load("return 1")
        assert await pool.call(["EVALSHA", sha, 0]) == 1  # a connection opened and free
        for _ in range(3):
            sent = pool.send_now(b"*3\r\n$7\r\nEVALSHA\r\n$40\r\n" + sha.encode()
                                 + b"\r\n$1\r\n0\r\n")
            assert sent is not None
            await asyncio.sleep(0.05)  # the call's other work: five times the 10 ms spin
            assert await pool.reply(sent) == 1
        misses = pool.spin.misses, pool.spin.skips
        await client.aclose()
        return misses

    with override_settings(GATEWAY_IDLE_SPIN_US=10_000):
        assert _run("uvloop", scenario) == (0, 0)


def test_the_upstream_transport_spins_after_writing_a_request() -> None:
    import httpx

    from gateway.upstream_http import make_transport

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = make_transport("native", max_connections=1)
        response = await transport.handle_async_request(httpx.Request(
            "GET", f"http://127.0.0.1:{port}/", extensions={"timeout": {"read": 2.0}}))
        assert await response.aread() == b"ok"
        await transport.aclose()
        server.close()

    assert _turns_after("uvloop", scenario) > 0


def test_an_upstream_slower_than_the_spin_is_not_spun_for_at_its_next_call() -> None:
    """A real model's answer takes far longer than any spin: after three misses in a row the
    origin's next call sleeps through its wait, the one after spins again to see (then 2, 4 ...
    skipped)."""
    import httpx

    from gateway.upstream_http import make_transport

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            await asyncio.sleep(0.05)  # 50 ms: five times the 10 ms spin
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def scenario() -> list[int]:
        spin = loop_spin.loop_spin(asyncio.get_running_loop())
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = make_transport("native", max_connections=1)
        turns = []
        for _ in range(5):
            before = spin.turns
            response = await transport.handle_async_request(httpx.Request(
                "GET", f"http://127.0.0.1:{port}/", extensions={"timeout": {"read": 2.0}}))
            assert await response.aread() == b"ok"
            turns.append(spin.turns - before)
        await transport.aclose()
        server.close()
        return turns

    with override_settings(GATEWAY_IDLE_SPIN_US=10_000):
        turns = _run("uvloop", scenario)
    assert all(turns[:3]) and turns[4] > 0  # spun and missed three times; then tried again
    assert turns[3] == 0  # slept through the wait after the third miss


def test_redis_py_s_path_for_the_scripts_spins_too(redis_url: str) -> None:
    """A URL the script pool does not speak (here: a client made without it) sends its scripts
    through redis-py's connection; the spin follows the write there as well."""
    from quotas.client import make_async_redis

    async def scenario() -> None:
        client = make_async_redis(redis_url, cluster=False)
        client.scripts = None  # as for a TLS URL: redis-py's path
        script = client.register_script("return 2")
        assert await script() == 2
        await client.aclose()

    assert _turns_after("uvloop", scenario) > 0


@pytest.mark.cluster
def test_the_cluster_client_spins_for_its_commands(redis_cluster_url: str) -> None:
    from quotas.client import make_async_redis

    async def scenario() -> None:
        client = make_async_redis(redis_cluster_url, cluster=True)
        script = client.register_script("return 3")
        assert await script(keys=["{t}k"]) == 3
        await client.aclose()

    assert _turns_after("uvloop", scenario) > 0
