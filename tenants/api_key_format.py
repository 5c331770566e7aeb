"""API key material: generation, digests and parsing. Nothing here touches the database.

Plaintext format: `tgk_<12-char lookup prefix>_<40-char secret>`, both parts base62. The prefix
is stored in clear so a key can be found with one indexed lookup; the whole plaintext is stored
only as an HMAC-SHA256 digest keyed with `settings.TOLLGATE_KEY_PEPPER`, so a copy of the
database alone is not enough to test guesses offline.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from tenants.ids import random_base62

KEY_SCHEME = "tgk"
PREFIX_LENGTH = 12
SECRET_LENGTH = 40
LAST4_LENGTH = 4
DIGEST_LENGTH = 64  # hex SHA-256

_KEY_RE = re.compile(
    rf"{KEY_SCHEME}_(?P<prefix>[0-9A-Za-z]{{{PREFIX_LENGTH}}})_[0-9A-Za-z]{{{SECRET_LENGTH}}}"
)


def _pepper() -> bytes:
    # Read on every call rather than at import so that a changed pepper takes effect at once
    # (and tests can swap it).
    pepper = getattr(settings, "TOLLGATE_KEY_PEPPER", "")
    if not pepper:
        raise ImproperlyConfigured("TOLLGATE_KEY_PEPPER must be set to hash API keys")
    return pepper.encode()


def digest_key(plaintext: str) -> str:
    return hmac.new(_pepper(), plaintext.encode(), hashlib.sha256).hexdigest()


def digests_match(plaintext: str, digest: str) -> bool:
    return hmac.compare_digest(digest_key(plaintext), digest)


def generate_key() -> tuple[str, str, str, str]:
    """A new key as (plaintext, prefix, digest, last4); only the last three may be stored."""
    prefix = random_base62(PREFIX_LENGTH)
    plaintext = f"{KEY_SCHEME}_{prefix}_{random_base62(SECRET_LENGTH)}"
    return plaintext, prefix, digest_key(plaintext), plaintext[-LAST4_LENGTH:]


def parse_key(plaintext: object) -> str | None:
    """The lookup prefix of a well-formed key, None for anything else (never raises).

    Strictness here means garbage from the Authorization header never reaches the database.
    """
    if not isinstance(plaintext, str):
        return None
    match = _KEY_RE.fullmatch(plaintext)
    return match.group("prefix") if match else None


def masked(prefix: str, last4: str) -> str:
    return f"{KEY_SCHEME}_{prefix}_…{last4}"


def mask_plaintext(plaintext: str) -> str:
    prefix = parse_key(plaintext)
    if prefix is None:
        raise ValueError("Not a well-formed Tollgate API key")
    return masked(prefix, plaintext[-LAST4_LENGTH:])
