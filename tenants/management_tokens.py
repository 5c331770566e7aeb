"""Management API token material: generation and parsing. Nothing here touches the database.

Plaintext format: `tgm_<12-char lookup prefix>_<40-char secret>`. The scheme differs from /v1
keys (`tgk_`) so that neither kind is ever accepted in the other's place, and so that a leaked
token is recognisable by secret scanners. Digests use the same pepper as API keys.
"""

from __future__ import annotations

import re

from tenants.api_key_format import LAST4_LENGTH, PREFIX_LENGTH, SECRET_LENGTH, digest_key
from tenants.ids import random_base62

TOKEN_SCHEME = "tgm"

_TOKEN_RE = re.compile(
    rf"{TOKEN_SCHEME}_(?P<prefix>[0-9A-Za-z]{{{PREFIX_LENGTH}}})_[0-9A-Za-z]{{{SECRET_LENGTH}}}"
)


def generate_token() -> tuple[str, str, str, str]:
    """A new token as (plaintext, prefix, digest, last4); only the last three may be stored."""
    prefix = random_base62(PREFIX_LENGTH)
    plaintext = f"{TOKEN_SCHEME}_{prefix}_{random_base62(SECRET_LENGTH)}"
    return plaintext, prefix, digest_key(plaintext), plaintext[-LAST4_LENGTH:]


def parse_token(plaintext: object) -> str | None:
    """The lookup prefix of a well-formed token, None for anything else (never raises)."""
    if not isinstance(plaintext, str):
        return None
    match = _TOKEN_RE.fullmatch(plaintext)
    return match.group("prefix") if match else None


def masked_token(prefix: str, last4: str) -> str:
    return f"{TOKEN_SCHEME}_{prefix}_…{last4}"
