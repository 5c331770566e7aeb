"""Encryption at rest for upstream provider secrets and webhook signing secrets (Fernet, with key
rotation).

TOLLGATE_ENCRYPTION_KEYS is a comma-separated list of Fernet keys (or a list of them). The first
one encrypts; all of them decrypt. To rotate: put a new key first, keep the old ones, run
`python manage.py reencrypt_secrets` (billing.encryption: provider keys and webhook secrets
both; gateway.providers.reencrypt_provider_secrets alone leaves the webhook secrets under the
old key), then drop the old keys.

Generate a key with:
    python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# Changing this label changes the derived key and makes every stored secret undecryptable.
_DERIVED_KEY_INFO = b"tollgate/provider-secrets/fernet/v1"


class SecretDecryptionError(Exception):
    """A ciphertext that none of the configured keys opens (wrong keys, or tampered data)."""


def _configured_keys() -> tuple[str, ...]:
    raw = getattr(settings, "TOLLGATE_ENCRYPTION_KEYS", "")
    items: Sequence[str] = raw.split(",") if isinstance(raw, str) else raw
    return tuple(item.strip() for item in items if item and item.strip())


def derive_fallback_key(secret_key: str) -> bytes:
    """A Fernet key derived from SECRET_KEY, for development and tests only."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_DERIVED_KEY_INFO)
    return base64.urlsafe_b64encode(hkdf.derive(secret_key.encode()))


@functools.lru_cache(maxsize=8)
def _multi_fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except ValueError as exc:
        # Fernet's own message never includes the key.
        raise ImproperlyConfigured(
            f"TOLLGATE_ENCRYPTION_KEYS holds an invalid Fernet key: {exc}"
        ) from exc


def _fernet() -> MultiFernet:
    keys = _configured_keys()
    if not keys:
        if getattr(settings, "TOLLGATE_ENV", "development") == "production":
            raise ImproperlyConfigured(
                "TOLLGATE_ENCRYPTION_KEYS must be set in production (comma-separated Fernet keys)"
            )
        # Outside production SECRET_KEY is generated once per data directory and kept there, so
        # a key derived from it is stable and `make up` needs no extra configuration. Production
        # refuses this: rotating SECRET_KEY would silently make every provider secret unreadable.
        keys = (derive_fallback_key(settings.SECRET_KEY).decode(),)
    return _multi_fernet(keys)


def encrypt_secret(plaintext: str) -> str:
    """Fernet ciphertext (ASCII) of `plaintext`, under the first configured key."""
    return _fernet().encrypt(plaintext.encode()).decode("ascii")


def decrypt_secret(token: str) -> str:
    """The plaintext of a ciphertext made by encrypt_secret under any configured key."""
    try:
        return _fernet().decrypt(token.encode("ascii")).decode()
    except (InvalidToken, UnicodeEncodeError) as exc:
        raise SecretDecryptionError(
            "no configured encryption key decrypts this secret"
        ) from exc


def reencrypt(token: str) -> str:
    """The same plaintext re-encrypted under the first configured key (for key rotation)."""
    try:
        return _fernet().rotate(token.encode("ascii")).decode("ascii")
    except (InvalidToken, UnicodeEncodeError) as exc:
        raise SecretDecryptionError(
            "no configured encryption key decrypts this secret"
        ) from exc
