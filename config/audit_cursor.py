"""The opaque cursor of an audit listing (the console's audit page, the API's audit-events
list): where the previous page ended (tenants.selectors.AuditPosition), signed so that a cursor
that was altered or made up is refused as such (BadCursor: a 400 saying so) rather than read.

It holds a time and a count of events of that same instant, never a database id (ids do not
leave the server); the signature's salt ties it to audit listings.
"""

from __future__ import annotations

from datetime import datetime

from django.core import signing

from tenants.selectors import AuditPosition

_SALT = "tollgate.audit-cursor"
MAX_CURSOR_LENGTH = 200


class BadCursor(ValueError):
    """The cursor was not made by this server for an audit listing."""


def encode(position: AuditPosition) -> str:
    return signing.dumps([position.created_at.isoformat(), position.skip], salt=_SALT,
                         compress=False)


def decode(raw: str) -> AuditPosition:
    if len(raw) > MAX_CURSOR_LENGTH:
        raise BadCursor("This cursor is not one this listing gave.")
    try:
        moment, skip = signing.loads(raw, salt=_SALT)
        position = AuditPosition(datetime.fromisoformat(moment), int(skip))
    except (signing.BadSignature, ValueError, TypeError) as exc:
        raise BadCursor("This cursor is not one this listing gave.") from exc
    if position.created_at.tzinfo is None or position.skip < 0:
        raise BadCursor("This cursor is not one this listing gave.")
    return position
