"""Public identifiers: what URLs, the CLI, logs and audit events use instead of database ids.

A type prefix makes a pasted identifier self-describing (`ten_`, `prj_`, `key_`), and the random
part keeps ids unguessable and free of information about how many tenants or keys exist.
"""

from __future__ import annotations

import secrets
import string

BASE62 = string.digits + string.ascii_letters
PUBLIC_ID_RANDOM_LENGTH = 16
PUBLIC_ID_MAX_LENGTH = 32


def random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(length))


def new_tenant_id() -> str:
    return "ten_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def new_project_id() -> str:
    return "prj_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def new_api_key_id() -> str:
    return "key_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def new_management_token_id() -> str:
    return "tok_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)


def new_invitation_id() -> str:
    return "inv_" + random_base62(PUBLIC_ID_RANDOM_LENGTH)
