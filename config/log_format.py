"""The two log formats (settings.TOLLGATE_LOG_FORMAT, wired in settings.LOGGING): `plain` for a
terminal and `json` for a log pipeline, one JSON object per line.

A JSON line has `time` (ISO 8601 UTC, milliseconds), `level`, `logger`, `message`; inside a
request, its public ids from gateway/request_context.py (`request_id`, `tenant`, `api_key`,
those known so far); on an access line (gateway/access_log.py) the request's fields; `exception`
(the traceback) and `stack` when the record has them. No other `extra` field is written: a
caller's extras could carry anything, and a log line only what is listed here.

Never a secret or a prompt: the log calls pass public ids, never a body, a header or a key (see
README, "Logs"). As a second line of defence, both formats mask what still looks like a secret
in the message and the traceback before it is written: Tollgate API keys and management tokens
(their public lookup prefix is kept), bearer credentials, `sk-...` provider keys, `whsec_...`
webhook signing secrets and the password of a URL. A mask costs one regular-expression pass
over the line.

The context is read when the record is formatted, which logging's StreamHandler does in the
calling task (asyncio copies the context into every task a request starts): a handler that
formats on another thread (QueueHandler) would need a filter to capture it first.

No Django import here: uvicorn's supervisor process may load these classes (its --log-config)
before any settings exist.
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from gateway import request_context
from tenants.api_key_format import KEY_SCHEME, PREFIX_LENGTH
from tenants.management_tokens import TOKEN_SCHEME

# What a secret looks like; group `keep` is what stays of it (a key's public lookup prefix, the
# word Bearer, `sk-`, `whsec_`, the `://` of a URL). A webhook secret is base64 in either
# alphabet (billing.webhooks.signing_key), padding included.
_SECRET = re.compile(
    rf"(?P<keep>\b(?:{KEY_SCHEME}|{TOKEN_SCHEME})_[0-9A-Za-z]{{{PREFIX_LENGTH}}}_)[0-9A-Za-z]+"
    r"|(?P<keep2>\b[Bb]earer\s+)[^\s\"',;]+"
    r"|(?P<keep3>\bsk-)[0-9A-Za-z_\-]{8,}"
    r"|(?P<keep4>://)[^\s/@:]*:[^\s/@]*(?P<at>@)"
    r"|(?P<keep5>\bwhsec_)[0-9A-Za-z+/_\-]{8,}=*"
)
MASK = "[redacted]"


def _masked(found: re.Match[str]) -> str:
    return (found.group("keep") or found.group("keep2") or found.group("keep3")
            or found.group("keep4") or found.group("keep5")) + MASK + (found.group("at") or "")


_KEY_MARK, _TOKEN_MARK = f"{KEY_SCHEME}_", f"{TOKEN_SCHEME}_"


def scrub(text: str) -> str:
    """`text` with anything that looks like a secret masked (see the module's docstring)."""
    # Substring tests first: a few times cheaper than the expression on a line with none.
    if (_KEY_MARK in text or _TOKEN_MARK in text or "earer" in text or "sk-" in text
            or "://" in text or "whsec_" in text):
        return _SECRET.sub(_masked, text)
    return text


# The last second formatted, and its text: lines come many to a second.
_second: tuple[int, str] = (-1, "")


def utc_time(created: float, msecs: float) -> str:
    """A record's time as ISO 8601 UTC with milliseconds: 2026-03-01T12:34:56.789Z."""
    global _second
    whole = int(created)
    second, text = _second
    if second != whole:
        # A race between threads formats the same second twice: harmless.
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second = (whole, text)
    return f"{text}.{int(msecs):03d}Z"


# One encoder for every line (json.dumps with an argument makes a new one per call).
# default=str: an argument that is not JSON (a Decimal, a datetime) is written as text.
_encode = json.JSONEncoder(default=str).encode


class PlainFormatter(logging.Formatter):
    """`time level logger [request_id tenant api_key] message`: the ids in brackets only inside
    a request (those known so far), so a request's lines can be found with grep."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(tollgate_ids)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        ids = request_context.current()
        record.tollgate_ids = f" [{' '.join(ids.values())}]" if ids else ""
        return scrub(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module's docstring for its fields)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": utc_time(record.created, record.msecs),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
        }
        line.update(request_context.current())
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            line.update(access)
        if record.exc_info:
            # Cached on the record like logging.Formatter does, for the other handlers.
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = scrub(record.exc_text)
        if record.stack_info:
            line["stack"] = scrub(self.formatStack(record.stack_info))
        return _encode(line)
