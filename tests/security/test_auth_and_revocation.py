"""Issue 11, items 3 and 7, in process: unauthenticated load on the gateway's auth cache (negative
answers cached briefly in a store of their own, known keys evicted least recently used, database
lookups bounded per client address) and revocation that outlasts neither a lookup in flight nor
a lost invalidation message.

The cache runs here on the test's event loop with the real loader (gateway.auth.load_key_context)
against the test database, so database queries are counted exactly; the listener runs against
the test session's Redis. The end-to-end counterparts, against running gateway processes, are in
test_auth_and_revocation_e2e.py.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.test.utils import CaptureQueriesContext

from gateway.auth import AuthCache, KeyContext, load_key_context
from gateway.client_address import client_address, parse_networks, rate_limit_key
from gateway.errors import GatewayError
from gateway.listener import VersionWatch, _apply, listen
from gateway.providers import ProviderPool, Upstream
from quotas.invalidation import publish_invalidation
from quotas.keys import INVALIDATION_CHANNEL, auth_version_key
from quotas.runtime import get_engine
from quotas.waiting import WaitRoom
from tenants import invalidation
from tenants.api_key_format import generate_key
from tenants.services import issue_key, revoke_key
from tests.test_settings import load_settings
from tests.world import World

pytestmark = pytest.mark.django_db


class Database:
    """The cache's loader (gateway.auth.load_key_context) with its queries counted. It runs
    through sync_to_async on the test's thread (the scenarios run under async_to_sync), so it
    shares the test's transaction; the gateway runs it on its database threads instead."""

    def __init__(self) -> None:
        self.queries = 0
        self.load = sync_to_async(self._load_counted)

    def _load_counted(self, prefix: str) -> KeyContext | None:
        with CaptureQueriesContext(connection) as captured:
            context = load_key_context(prefix)
        self.queries += len(captured.captured_queries)
        return context

    def queries_of(self, run: Callable[[], Awaitable[Any]]) -> tuple[Any, int]:
        """Run a coroutine; return its result and how many database queries it made."""
        async def main() -> Any:
            return await run()

        before = self.queries
        result = async_to_sync(main)()
        return result, self.queries - before


@pytest.fixture
def db_loader() -> Database:
    return Database()


def random_key() -> str:
    return generate_key()[0]


class Clock:
    """gateway.auth's time.time(), moved by hand."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("gateway.auth.time", fake)
    return fake


def trusted_cache(database: Database, **options: Any) -> AuthCache:
    cache = AuthCache(60, database.load, **options)
    cache.trusted_until = float("inf")  # as if the listener had confirmed the version
    return cache


# -- the client address -------------------------------------------------------------------------

PROXIES = parse_networks(["10.0.0.0/8", "fd00::/8"])


@pytest.mark.parametrize(("peer", "forwarded", "expected"), [
    ("203.0.113.7", None, "203.0.113.7"),
    # Not from our proxy: whatever the header says is the client's own claim.
    ("203.0.113.7", "198.51.100.1", "203.0.113.7"),
    # From our proxy: the rightmost hop it did not add itself.
    ("10.0.0.2", "198.51.100.1", "198.51.100.1"),
    ("10.0.0.2", "1.2.3.4, 198.51.100.1", "198.51.100.1"),  # 1.2.3.4: forged by the client
    ("10.0.0.2", "1.2.3.4, 198.51.100.1, 10.0.0.9", "198.51.100.1"),  # two proxies of ours
    ("10.0.0.2", "10.0.0.8, 10.0.0.9", "10.0.0.8"),  # only our own hops: the first one
    ("10.0.0.2", "garbage, 198.51.100.1", "198.51.100.1"),
    ("10.0.0.2", "198.51.100.1, garbage", "10.0.0.2"),  # a hop no proxy of ours writes
    ("10.0.0.2", "", "10.0.0.2"),
    ("fd00::1", "2001:db8::5", "2001:db8::5"),
    ("::ffff:203.0.113.7", None, "203.0.113.7"),  # IPv4 seen through an IPv6 socket
    ("10.0.0.2", "[2001:db8::5]:443, 198.51.100.1:5000", "198.51.100.1"),
    (None, "198.51.100.1", "unknown"),
])
def test_the_client_is_the_rightmost_hop_no_trusted_proxy_added(
    peer: str | None, forwarded: str | None, expected: str,
) -> None:
    assert client_address(peer, forwarded, PROXIES) == expected


def test_without_trusted_proxies_the_forwarded_header_is_ignored() -> None:
    assert client_address("10.0.0.2", "198.51.100.1", ()) == "10.0.0.2"


def test_limits_count_an_ipv6_client_by_its_64() -> None:
    assert rate_limit_key("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert rate_limit_key("2001:db8:1:2::ffff") == "2001:db8:1:2::/64"
    assert rate_limit_key("203.0.113.7") == "203.0.113.7"
    assert rate_limit_key("unknown") == "unknown"


def test_a_bad_trusted_proxy_entry_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'10.0.0.0/33'"):
        parse_networks(["10.0.0.0/8", "10.0.0.0/33"])
    assert parse_networks(["192.0.2.1"]) == (ipaddress.ip_network("192.0.2.1/32"),)


# -- item 3: unauthenticated load ---------------------------------------------------------------

def test_a_flood_of_random_keys_leaves_a_real_key_cached(world: World, db_loader: Database) -> None:
    cache = trusted_cache(db_loader, max_entries=4, max_negative=100)
    real = world.issued.plaintext
    first, looked_up = db_loader.queries_of(lambda: cache.authenticate(real))
    assert first is not None and first.api_key.pk == world.issued.api_key.pk and looked_up > 0

    async def flood() -> list[KeyContext | None]:
        return [await cache.authenticate(random_key()) for _ in range(1_000)]

    answers, flood_queries = db_loader.queries_of(flood)
    assert answers == [None] * 1_000 and flood_queries == 1_000  # one query each, no more
    again, looked_up = db_loader.queries_of(lambda: cache.authenticate(real))
    assert again is first and looked_up == 0


def test_known_keys_are_evicted_least_recently_used_first(
    world: World, db_loader: Database,
) -> None:
    cache = trusted_cache(db_loader, max_entries=2)
    acme, globex = world.issued.plaintext, world.other_issued.plaintext
    third = issue_key(world.web, actor="test").plaintext

    async def fill() -> None:
        for key in (acme, globex, acme, third):  # acme used again before the third arrives
            assert await cache.authenticate(key) is not None

    db_loader.queries_of(fill)
    assert db_loader.queries_of(lambda: cache.authenticate(acme))[1] == 0  # kept
    # The least recently used: evicted, looked up again.
    assert db_loader.queries_of(lambda: cache.authenticate(globex))[1] > 0


def test_an_unknown_key_is_remembered_until_its_ttl(
    world: World, db_loader: Database, clock: Clock,
) -> None:
    cache = trusted_cache(db_loader, negative_ttl_s=5.0)
    stranger = random_key()
    assert db_loader.queries_of(lambda: cache.authenticate(stranger)) == (None, 1)
    clock.now += 4.9
    assert db_loader.queries_of(lambda: cache.authenticate(stranger)) == (None, 0)
    clock.now += 0.2  # 5.1 s after the lookup: expired
    assert db_loader.queries_of(lambda: cache.authenticate(stranger)) == (None, 1)


def test_unknown_keys_have_a_bounded_store_of_their_own(
    world: World, db_loader: Database,
) -> None:
    cache = trusted_cache(db_loader, max_entries=10, max_negative=3)
    strangers = [random_key() for _ in range(4)]

    async def look_up_all() -> None:
        for key in strangers:
            await cache.authenticate(key)

    db_loader.queries_of(look_up_all)
    assert db_loader.queries_of(lambda: cache.authenticate(strangers[3]))[1] == 0  # newest kept
    assert db_loader.queries_of(lambda: cache.authenticate(strangers[0]))[1] == 1  # oldest gone


def test_lookups_beyond_an_address_bucket_are_refused_without_a_query(
    world: World, db_loader: Database, clock: Clock,
) -> None:
    cache = trusted_cache(db_loader, lookups_per_second=0.5, lookup_burst=3)
    real = world.issued.plaintext

    def from_address(key: str, client: str) -> tuple[KeyContext | None, int]:
        return db_loader.queries_of(lambda: cache.authenticate(key, client))

    # The real key's own lookup counts too; once known, it is never refused.
    assert from_address(real, "198.51.100.1")[0] is not None
    for _ in range(2):
        assert from_address(random_key(), "198.51.100.1") == (None, 1)
    before = db_loader.queries
    with pytest.raises(GatewayError) as refused:
        from_address(random_key(), "198.51.100.1")
    assert db_loader.queries == before  # refused before any query
    response = refused.value.response()
    assert response.status_code == 429
    assert response["Retry-After"] == "2"  # one lookup back at 0.5 per second
    assert json.loads(response.content) == {"error": {
        "message": "Too many API key lookups from your address; retry shortly.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    # The known key still passes from the refused address, with no query; another address
    # has a bucket of its own.
    assert from_address(real, "198.51.100.1")[1] == 0
    assert from_address(random_key(), "198.51.100.2") == (None, 1)
    # The address may be given as a function, called only when a lookup is needed.
    asked: list[str] = []

    def address() -> str:
        asked.append("asked")
        return "198.51.100.1"

    assert db_loader.queries_of(lambda: cache.authenticate(real, address))[1] == 0
    assert asked == []  # a cached key: not even the address was worked out
    with pytest.raises(GatewayError):
        db_loader.queries_of(lambda: cache.authenticate(random_key(), address))
    assert asked == ["asked"]
    # Emptied (a plan change, a lost message): the key is looked up again, never refused.
    cache.clear()
    context, looked_up = from_address(real, "198.51.100.1")
    assert context is not None and looked_up > 0
    clock.now += 2.0  # one lookup back
    assert from_address(random_key(), "198.51.100.1") == (None, 1)


def test_a_burst_with_one_new_key_is_one_lookup_and_no_refusal(
    world: World, db_loader: Database,
) -> None:
    cache = trusted_cache(db_loader, lookups_per_second=0.001, lookup_burst=1)
    fresh = issue_key(world.web, actor="test").plaintext

    async def burst() -> list[KeyContext | None]:
        return list(await asyncio.gather(*(cache.authenticate(fresh, "198.51.100.9")
                                           for _ in range(50))))

    answers, looked_up = db_loader.queries_of(burst)
    assert looked_up > 0 and all(a is not None for a in answers) and len(answers) == 50
    assert len({id(a) for a in answers}) == 1  # one lookup, shared


def test_ipv6_clients_of_one_64_share_a_bucket(world: World, db_loader: Database) -> None:
    cache = trusted_cache(db_loader, lookups_per_second=0.001, lookup_burst=2)
    for host in ("2001:db8:1:2::1", "2001:db8:1:2::2"):
        assert db_loader.queries_of(
            lambda host=host: cache.authenticate(random_key(), host)) == (None, 1)
    with pytest.raises(GatewayError):
        db_loader.queries_of(lambda: cache.authenticate(random_key(), "2001:db8:1:2::3"))
    assert db_loader.queries_of(
        lambda: cache.authenticate(random_key(), "2001:db8:1:3::1")) == (None, 1)


def test_a_key_revoked_unheard_costs_one_lookup_per_negative_ttl(
    world: World, db_loader: Database, clock: Clock, django_capture_on_commit_callbacks: Any,
) -> None:
    """A key revoked while no message reaches this worker: once its entry is past the cache's
    age, the lookup's "unusable" answer replaces it. Before, the stale entry stayed and was
    checked first, so every request was a lookup of its own (and, the key being known, none
    was throttled): now at most one lookup per negative TTL, and after that the key counts
    against its address like any unknown key."""
    key = issue_key(world.web, actor="test")
    lookups: list[str] = []

    async def counted(prefix: str) -> KeyContext | None:
        lookups.append(prefix)
        return await db_loader.load(prefix)

    cache = AuthCache(60, counted, negative_ttl_s=5.0, lookups_per_second=0.001,
                      lookup_burst=2)
    cache.trusted_until = float("inf")
    address = "198.51.100.40"

    def calls(n: int) -> tuple[list[KeyContext | None], int]:
        async def run() -> list[KeyContext | None]:
            return [await cache.authenticate(key.plaintext, address) for _ in range(n)]

        before = len(lookups)
        answers = db_loader.queries_of(run)[0]
        return answers, len(lookups) - before

    answers, looked_up = calls(1)  # the first lookup takes one of the address's two tokens
    assert answers[0] is not None and looked_up == 1
    with django_capture_on_commit_callbacks(execute=False):  # the message never leaves
        revoke_key(key.api_key, actor="test")
    clock.now += 61  # past the cache's age (60 s here): the entry must be read again
    assert calls(50) == ([None] * 50, 1)
    clock.now += 4.9  # still within the negative TTL
    assert calls(50) == ([None] * 50, 0)
    clock.now += 0.2  # past it: looked up again, now against the address's bucket (1 left)
    assert calls(1) == ([None], 1)
    clock.now += 5.1
    with pytest.raises(GatewayError) as refused:
        calls(1)
    assert (refused.value.status, refused.value.refusal) == (429, None)
    assert len(lookups) == 3


def test_the_lookup_bucket_store_is_bounded_by_its_setting(
    world: World, db_loader: Database, settings: Any,
) -> None:
    """GATEWAY_AUTH_LOOKUP_MAX_CLIENTS addresses are tracked; the least recently seen is
    forgotten and starts again with a full bucket."""
    settings.GATEWAY_AUTH_LOOKUP_MAX_CLIENTS = 2
    cache = trusted_cache(db_loader, lookups_per_second=0.001, lookup_burst=1)

    def lookup(client: str) -> tuple[KeyContext | None, int]:
        return db_loader.queries_of(lambda: cache.authenticate(random_key(), client))

    assert lookup("198.51.100.1") == (None, 1)
    with pytest.raises(GatewayError):
        lookup("198.51.100.1")  # its one token is spent
    assert lookup("198.51.100.2") == (None, 1)
    assert lookup("198.51.100.3") == (None, 1)  # a third address: .1 is forgotten
    assert lookup("198.51.100.1") == (None, 1)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_lookup_client_bound_that_is_not_positive_refuses_to_start(value: str) -> None:
    result = load_settings(GATEWAY_AUTH_LOOKUP_MAX_CLIENTS=value)
    assert result.returncode != 0
    assert (f"GATEWAY_AUTH_LOOKUP_MAX_CLIENTS must be a positive integer, got {value}"
            in result.stderr)


# -- item 7 (a): a lookup in flight when the revocation arrives ------------------------------

def test_a_lookup_in_flight_when_the_key_is_revoked_is_not_kept(
    world: World, db_loader: Database, django_capture_on_commit_callbacks: Any,
) -> None:
    key = world.issued
    hold = {"on": True}

    async def paused_load(prefix: str) -> KeyContext | None:
        context = await db_loader.load(prefix)  # reads the key while it is valid ...
        if hold["on"]:
            queried.set()
            await resume.wait()  # ... and is slow to come back
        return context

    def revoke() -> None:
        with django_capture_on_commit_callbacks(execute=False):  # no gateway listens here
            revoke_key(key.api_key, actor="test")

    cache = AuthCache(60, paused_load)
    cache.trust_for(3600)
    runtime = SimpleNamespace(auth=cache)

    async def scenario() -> tuple[KeyContext | None, KeyContext | None]:
        in_flight = asyncio.ensure_future(cache.authenticate(key.plaintext))
        await queried.wait()
        await sync_to_async(revoke)()
        # The gateway hears of the revocation while the lookup is still out.
        await _apply(runtime, INVALIDATION_CHANNEL,  # type: ignore[arg-type]
                     json.dumps({"kind": "api_key", "id": key.api_key.pk}))
        hold["on"] = False
        resume.set()
        raced = await in_flight
        return raced, await cache.authenticate(key.plaintext)

    queried, resume = asyncio.Event(), asyncio.Event()
    before = db_loader.queries
    raced, after = async_to_sync(scenario)()
    # The call that raced the revocation was answered from what it read; nothing was kept,
    # so the next call read the revoked key from the database (a second lookup) and failed.
    assert raced is not None and raced.api_key.pk == key.api_key.pk
    assert after is None
    first_lookup = db_loader.queries - before
    assert first_lookup > 0 and cache._entries == {}


def test_callers_arriving_after_an_invalidation_do_not_join_the_stale_lookup() -> None:
    loads: list[str] = []

    async def slow_load(prefix: str) -> KeyContext | None:
        loads.append(prefix)
        await release.wait()
        return None

    cache = AuthCache(60, slow_load)
    cache.trust_for(3600)
    stranger = random_key()

    async def scenario() -> None:
        first = asyncio.ensure_future(cache.authenticate(stranger))
        await asyncio.sleep(0)
        cache.forget_key(1)
        second = asyncio.ensure_future(cache.authenticate(stranger))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, second)

    release = asyncio.Event()
    asyncio.run(scenario())
    assert len(loads) == 2  # the second caller started a lookup of its own


# -- item 7 (b): a lost or failed publish ------------------------------------------------------

def test_the_version_watch_tells_a_late_message_from_a_lost_one() -> None:
    watch = VersionWatch(10)
    assert watch.check(10) is False
    assert watch.check(11) is False  # published, message not read yet: one more check
    assert watch.message(11) is False
    assert watch.check(11) is False
    assert watch.check(12) is False
    assert watch.check(12) is True  # still no message for 12: lost
    assert watch.seen == 12
    assert watch.message(15) is True  # 13 and 14 never arrived
    # Redis lost its data (a flush, a restart without persistence): the version starts again,
    # and losses must be seen from the new count on.
    assert watch.check(0) is True
    assert watch.seen == 0
    assert watch.check(1) is False
    assert watch.check(1) is True


def test_each_message_carries_the_version_its_publish_set() -> None:
    client = get_engine().client
    before = int(client.get(auth_version_key()) or 0)
    pubsub = client.pubsub()
    pubsub.subscribe(INVALIDATION_CHANNEL)
    pubsub.get_message(timeout=1)
    try:
        assert publish_invalidation("api_key", 42) == before + 1
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    finally:
        pubsub.close()
    assert json.loads(message["data"]) == {"kind": "api_key", "id": 42, "v": before + 1}
    assert int(client.get(auth_version_key())) == before + 1


class FakeRuntime:
    """What the listener touches of a gateway runtime: the auth cache, a provider pool and the
    room of queued calls (woken after each resubscription)."""

    def __init__(self, auth: AuthCache) -> None:
        self.auth = auth
        self.pool = ProviderPool([])
        self.waiting = WaitRoom()
        self.reloads = 0

    async def reload_pool(self) -> None:
        self.reloads += 1

    async def reload_catalog(self) -> None:
        pass


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Wait on the loop (the listener runs meanwhile) until `predicate` holds; a generous
    deadline for a loaded machine, not a measure of speed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def with_listener(database: Database,
                  scenario: Callable[[FakeRuntime], Awaitable[None]]) -> FakeRuntime:
    """Run gateway.listener.listen (against the session's Redis) beside `scenario` on one
    loop; the cache's lookups run on the test's thread, in its transaction."""
    runtime = FakeRuntime(AuthCache(3600, database.load))

    async def main() -> None:
        listener = asyncio.ensure_future(listen(runtime))  # type: ignore[arg-type]
        try:
            assert await until(lambda: runtime.auth.trusted)
            await scenario(runtime)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async_to_sync(main)()
    return runtime


def cached_ids(cache: AuthCache) -> set[int]:
    return {context.api_key.pk for _, context in cache._entries.values()}


@pytest.fixture
def fast_checks(settings: Any) -> None:
    settings.GATEWAY_AUTH_VERSION_CHECK_SECONDS = 0.2


def test_a_lost_message_empties_the_cache_within_two_version_checks(
    world: World, db_loader: Database, fast_checks: None,
) -> None:
    key = world.issued

    async def scenario(runtime: FakeRuntime) -> None:
        assert await runtime.auth.authenticate(key.plaintext) is not None
        assert cached_ids(runtime.auth) == {key.api_key.pk}
        # A publish whose message never reached this gateway: the version moved, no message.
        get_engine().client.incr(auth_version_key())
        assert await until(lambda: not runtime.auth._entries)  # bound: two checks, 0.4 s
        assert runtime.auth.trusted

    runtime = with_listener(db_loader, scenario)
    assert runtime.reloads == 1  # the catalog and provider keys were reloaded too


def test_the_cache_is_bypassed_while_the_version_cannot_be_read(
    world: World, db_loader: Database, fast_checks: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gateway.listener as listener_module

    failing = {"on": False}
    real_read = listener_module._read_version

    async def read_version(client: Any) -> int:
        if failing["on"]:
            raise ConnectionError("injected: the version cannot be read")
        return await real_read(client)

    monkeypatch.setattr(listener_module, "_read_version", read_version)

    async def scenario(runtime: FakeRuntime) -> None:
        assert await runtime.auth.authenticate(world.issued.plaintext) is not None
        failing["on"] = True
        assert await until(lambda: not runtime.auth.trusted)
        # Untrusted: every call reads the database, so a revocation applies at once.
        before = db_loader.queries
        assert await runtime.auth.authenticate(world.issued.plaintext) is not None
        assert db_loader.queries > before
        failing["on"] = False
        assert await until(lambda: runtime.auth.trusted)

    with_listener(db_loader, scenario)


@pytest.mark.parametrize("read", ["at_start", "on_a_check"])
def test_a_listener_cancelled_in_the_turn_its_version_read_returns_ends(
    world: World, db_loader: Database, fast_checks: None, monkeypatch: pytest.MonkeyPatch,
    read: str,
) -> None:
    """A stopping worker cancels its listener and waits for it (gateway/shutdown.py). When the
    cancellation comes in the same turn as a version read's reply, the listener still ends:
    with asyncio.wait_for (Python 3.11) the reply was returned and the cancellation dropped,
    so the listener went on and the worker waited for it forever."""
    import gateway.listener as listener_module

    real_read = listener_module._read_version
    listeners: list[asyncio.Future[None]] = []
    reads = {"n": 0, "cancel_on": 1 if read == "at_start" else 3}

    async def read_version(client: Any) -> int:
        version = await real_read(client)
        reads["n"] += 1
        if reads["n"] >= reads["cancel_on"]:
            listeners[0].cancel()  # the worker stopping, as the reply came
        return version

    monkeypatch.setattr(listener_module, "_read_version", read_version)
    runtime = FakeRuntime(AuthCache(3600, db_loader.load))

    async def main() -> None:
        listener = asyncio.ensure_future(listen(runtime))  # type: ignore[arg-type]
        listeners.append(listener)
        done, _ = await asyncio.wait([listener], timeout=5)
        if not done:  # the cancellations were dropped: stop it while it waits for a message
            reads["cancel_on"] = 10**9
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        assert done, "the listener went on after its cancellation"
        assert listener.cancelled()
        assert reads["n"] == reads["cancel_on"]  # it ended at that read, not at a later one
        assert not runtime.auth.trusted  # and distrusted the cache on its way out

    async_to_sync(main)()


def test_a_publish_that_fails_is_retried_and_the_revocation_lands(
    world: World, db_loader: Database, fast_checks: None, monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    key = world.issued
    attempts: list[str] = []

    def flaky(kind: str, ident: int | None) -> int:
        attempts.append(kind)
        if len(attempts) <= 2:
            raise ConnectionError("injected: Redis unreachable")
        return publish_invalidation(kind, ident)

    def revoke() -> None:
        with django_capture_on_commit_callbacks(execute=True):
            revoke_key(key.api_key, actor="test")

    monkeypatch.setattr(invalidation, "_transport", flaky)

    async def scenario(runtime: FakeRuntime) -> None:
        assert await runtime.auth.authenticate(key.plaintext) is not None
        await sync_to_async(revoke)()
        assert attempts == ["api_key"] * 3  # failed twice, sent by the third attempt
        assert await until(lambda: key.api_key.pk not in cached_ids(runtime.auth))
        assert await runtime.auth.authenticate(key.plaintext) is None

    with_listener(db_loader, scenario)


def test_a_publish_that_keeps_failing_is_sent_from_the_background_when_redis_is_back(
    world: World, db_loader: Database, fast_checks: None, monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    key = world.issued
    down = {"on": True}
    attempts: list[str] = []

    def outage(kind: str, ident: int | None) -> int:
        attempts.append(kind)
        if down["on"]:
            raise ConnectionError("injected: Redis unreachable")
        return publish_invalidation(kind, ident)

    def revoke() -> None:
        with django_capture_on_commit_callbacks(execute=True):
            revoke_key(key.api_key, actor="test")

    monkeypatch.setattr(invalidation, "_transport", outage)
    monkeypatch.setattr(invalidation, "BACKGROUND_RETRY_S", 0.1)

    async def scenario(runtime: FakeRuntime) -> None:
        assert await runtime.auth.authenticate(key.plaintext) is not None
        await sync_to_async(revoke)()
        assert attempts == ["api_key"] * (1 + len(invalidation.RETRY_DELAYS_S))
        assert invalidation.retrier.pending() == [("api_key", key.api_key.pk)]
        assert key.api_key.pk in cached_ids(runtime.auth)  # nobody could tell the gateway
        down["on"] = False  # Redis is back: the background retry gets through
        assert await until(lambda: key.api_key.pk not in cached_ids(runtime.auth))
        # The listener may drop the key before the retry thread, back from its send, has taken
        # the message off its list: wait for that step too rather than read the list at once.
        assert await until(lambda: invalidation.retrier.pending() == [])

    with_listener(db_loader, scenario)


def _retried(retrier: invalidation._Retrier) -> None:
    """Wait for `retrier`'s background thread to end (it ends once nothing is pending)."""
    thread = retrier._thread
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_retry_thread_survives_an_overflow_while_it_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the thread sends a message, failed publishes overflow the pending list, which
    replaces the key messages with one "plan" message: the sent message is no longer in the
    list. The thread carries on (it used to die of the ValueError) and sends what is left."""
    monkeypatch.setattr(invalidation, "_MAX_PENDING", 3)
    monkeypatch.setattr(invalidation, "BACKGROUND_RETRY_S", 0.05)
    retrier = invalidation._Retrier()
    sent: list[tuple[str, int | None]] = []

    def transport(kind: str, ident: int | None) -> None:
        if not sent:  # the first send: two more failures arrive meanwhile and overflow
            retrier.add("api_key", 3)
            retrier.add("api_key", 4)
        sent.append((kind, ident))

    monkeypatch.setattr(invalidation, "_transport", transport)
    retrier._pending = [("api_key", 1)]
    retrier.add("api_key", 2)  # starts the thread
    _retried(retrier)
    assert retrier.pending() == []
    # The first round sends its snapshot; the second what the overflow left.
    assert sent == [("api_key", 1), ("api_key", 2), ("plan", None), ("api_key", 4)]


def test_a_retry_that_raises_is_logged_and_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(invalidation, "BACKGROUND_RETRY_S", 0.05)
    retrier = invalidation._Retrier()
    attempts: list[tuple[str, int | None]] = []

    def transport(kind: str, ident: int | None) -> None:
        attempts.append((kind, ident))
        if len(attempts) == 1:
            raise TypeError("injected: a bug in the transport")

    monkeypatch.setattr(invalidation, "_transport", transport)
    with caplog.at_level("WARNING", logger="tenants.invalidation"):
        retrier.add("api_key", 5)
        _retried(retrier)
    assert attempts == [("api_key", 5)] * 2 and retrier.pending() == []
    failed = [r for r in caplog.records if r.getMessage().startswith("retrying the api_key 5")]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert failed[0].exc_info[0] is TypeError


# -- item 6 (the pool's side): a deleted provider key leaves the pool at once ----------------

def _upstream(ident: int) -> Upstream:
    return Upstream(id=ident, public_id=f"pk_{ident}", base_url="http://upstream.test/v1",
                    secret="sk-test", rpm_capacity=None, tpm_capacity=None)


def test_a_provider_key_invalidation_drops_it_even_if_the_reload_fails(
    db_loader: Database,
) -> None:
    class Runtime(FakeRuntime):
        async def reload_pool(self) -> None:
            raise ConnectionError("injected: database unreachable")

    runtime = Runtime(AuthCache(60, db_loader.load))
    runtime.pool = ProviderPool([_upstream(1), _upstream(2)])
    runtime.pool.cool_down(2, 1e12)
    with pytest.raises(ConnectionError):
        asyncio.run(_apply(runtime, INVALIDATION_CHANNEL,  # type: ignore[arg-type]
                           json.dumps({"kind": "providers", "id": 1})))
    assert runtime.pool.get(1) is None and runtime.pool.get(2) is not None
    assert runtime.pool.in_cooldown(2, 0.0)  # what the pool knew of the others is kept


# -- item 6: every admin write goes through a service --------------------------------------------

# Django's own users and groups: no gateway caches them (a user's memberships and management
# tokens are the tenants app's, reached through the console and API services).
_NOT_TOLLGATE_DATA = {"auth"}


def test_every_admin_save_and_delete_is_routed_through_an_override(world: World) -> None:
    """A ModelAdmin that may save or delete, and does so with Django's own save_model,
    delete_model or delete_queryset (the bulk "delete selected"), writes the row directly:
    no audit event, no invalidation. Each one here overrides them (with a service call), and
    inlines that may add, change or delete are saved by their page's save_formset."""
    from django.contrib import admin
    from django.contrib.admin import ModelAdmin
    from django.test import RequestFactory

    world.operator.is_superuser = True
    request = RequestFactory().get("/admin/")
    request.user = world.operator
    unrouted = []
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label in _NOT_TOLLGATE_DATA:
            continue
        cls, name = type(model_admin), model._meta.label
        if model_admin.has_delete_permission(request):
            unrouted += [f"{name}.{m}" for m in ("delete_model", "delete_queryset")
                         if getattr(cls, m) is getattr(ModelAdmin, m)]
        editable = set(model_admin.get_fields(request)) - set(
            model_admin.get_readonly_fields(request))
        if (model_admin.has_add_permission(request)
                or (model_admin.has_change_permission(request) and editable)) and (
                cls.save_model is ModelAdmin.save_model):
            unrouted.append(f"{name}.save_model")
        for inline in model_admin.get_inline_instances(request):
            writes = (inline.has_add_permission(request, None)
                      or (inline.can_delete and inline.has_delete_permission(request))
                      or set(inline.get_fields(request)) - set(inline.get_readonly_fields(request)))
            if writes and cls.save_formset is ModelAdmin.save_formset:
                unrouted.append(f"{name} inline {inline.model._meta.label}")
    assert unrouted == []


def test_a_provider_key_disabled_or_given_a_new_secret_names_itself_in_its_message(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any,
) -> None:
    """So every pool drops it at once (test above), whether or not its reload works."""
    from gateway.providers import (
        create_provider_key,
        set_provider_secret,
        update_provider_key,
    )

    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr(invalidation, "_publish_now", lambda kind, ident: sent.append((kind, ident)))
    key = create_provider_key("to-disable", base_url="https://api.example.test/v1",
                              secret="sk-disable-me-0123456789")
    with django_capture_on_commit_callbacks(execute=True):
        key.enabled = False
        update_provider_key(key, ["enabled"], actor="test")
        set_provider_secret(key, "sk-another-secret-0123456789", actor="test")
    assert sent == [("providers", key.pk), ("providers", key.pk)]
