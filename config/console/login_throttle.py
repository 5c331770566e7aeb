"""Login throttling: failed console logins are counted per username and per client address in
Redis (Django's cache), and once either count reaches LOGIN_FAILURE_LIMIT in the window, further
attempts are refused without checking the password until the window passes."""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.cache import cache


def _keys(username: str, address: str) -> list[str]:
    # Hashed so that usernames typed into the form never sit in Redis in clear.
    name = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    return [f"login-fail:user:{name}", f"login-fail:addr:{address}"]


def login_blocked(username: str, address: str) -> bool:
    counts = cache.get_many(_keys(username, address))
    return any(int(count) >= settings.LOGIN_FAILURE_LIMIT for count in counts.values())


def record_login_failure(username: str, address: str) -> None:
    window = settings.LOGIN_FAILURE_WINDOW_SECONDS
    for key in _keys(username, address):
        # add() starts the window on the first failure; incr() never extends it.
        if not cache.add(key, 1, timeout=window):
            try:
                cache.incr(key)
            except ValueError:  # expired between add() and incr()
                cache.add(key, 1, timeout=window)


def clear_login_failures(username: str, address: str) -> None:
    cache.delete_many(_keys(username, address)[:1])  # the address keeps its count: one
    # success must not reset a guesser's budget across many usernames
