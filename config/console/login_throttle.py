"""Login throttling for the console and Django admin.

Every password attempt takes a slot from two budgets in Redis (Django's cache) before the
password is checked: one per username, one per client address. Taking the slot is one atomic
INCR, so concurrent guesses cannot all read "under the limit" and all be checked (the
check-then-act race of counting failures afterwards). Once either budget is spent, attempts are
refused without checking the password until the window (started by the first attempt) passes. A
successful login gives its slot back and clears the username's budget; the address keeps its
count, so one success does not reset a guesser's budget across many usernames.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse

from gateway.client_address import rate_limit_key, request_client_address

THROTTLED_MESSAGE = "Too many failed logins. Wait a few minutes before trying again."
_LOGGED_IN = "_tollgate_logged_in"


def _note_login(sender: object, request: HttpRequest | None, **kwargs: object) -> None:
    # "Did this attempt log someone in" must come from the login itself: request.user is
    # already authenticated for a signed-in user posting to the admin's login form, and taking
    # that for a success would clear the guessed username's budget on every wrong password.
    if request is not None:
        setattr(request, _LOGGED_IN, True)


user_logged_in.connect(_note_login, dispatch_uid="tollgate-login-throttle")


def _keys(username: str, address: str) -> tuple[str, str]:
    # Hashed so that usernames typed into the form never sit in Redis in clear.
    name = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    return f"login-fail:user:{name}", f"login-fail:addr:{address}"


def _take(key: str) -> int:
    """This attempt's number in the key's window (atomic INCR; add() starts the window)."""
    window = settings.LOGIN_FAILURE_WINDOW_SECONDS
    cache.add(key, 0, timeout=window)
    try:
        return int(cache.incr(key))
    except ValueError:  # expired between add() and incr(): this attempt starts a new window
        cache.add(key, 1, timeout=window)
        return 1


def take_login_attempt(username: str, address: str) -> bool:
    """Counts the attempt against both budgets; False when either is already spent (the
    password must then not be checked)."""
    numbers = [_take(key) for key in _keys(username, address)]
    return all(number <= settings.LOGIN_FAILURE_LIMIT for number in numbers)


def login_succeeded(username: str, address: str) -> None:
    user_key, address_key = _keys(username, address)
    cache.delete(user_key)
    try:
        cache.decr(address_key)  # a success is not a failure against the address
    except ValueError:  # the window ended meanwhile
        pass


def throttled_login(request: HttpRequest, attempt: Callable[[], HttpResponse],
                    refuse: Callable[[], HttpResponse]) -> HttpResponse:
    """Runs a login view's POST (`attempt`) only if the attempt gets a slot, else `refuse()`
    (a 429 page). A success is an attempt during which Django logged a user in."""
    if request.method != "POST":
        return attempt()
    username = request.POST.get("username", "")
    # An IPv6 client is counted by its /64, which it may rotate through at will.
    address = rate_limit_key(request_client_address(request))
    if not take_login_attempt(username, address):
        return refuse()
    response = attempt()
    if getattr(request, _LOGGED_IN, False):
        login_succeeded(username, address)
    return response
