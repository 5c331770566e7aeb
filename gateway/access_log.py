"""One log line per /v1 request when asked for (TOLLGATE_ACCESS_LOG, on by default with
TOLLGATE_LOG_FORMAT=json): what was called, by whom (public ids only, from
gateway/request_context.py via the log format), how it ended and how long it took. Never a
secret, a prompt or an answer: only the fields below.

Off by default otherwise: a line per request costs CPU on every call (docs/benchmarks.md).
The line goes to the `tollgate.access` logger at INFO (settings.LOGGING keeps that logger at
INFO whatever LOG_LEVEL says: TOLLGATE_ACCESS_LOG is the switch).
"""
from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

log = logging.getLogger("tollgate.access")


class _Switch:
    """TOLLGATE_ACCESS_LOG, read once: each read of Django's settings object costs about a
    microsecond, and every call asks. Read again when a test changes the setting."""

    on: bool | None = None


def enabled() -> bool:
    on = _Switch.on
    if on is None:
        on = _Switch.on = bool(getattr(settings, "TOLLGATE_ACCESS_LOG", False))
    return on


@receiver(setting_changed)
def _reread(setting: str, **kwargs: Any) -> None:
    if setting == "TOLLGATE_ACCESS_LOG":
        _Switch.on = None


def log_request(*, endpoint: str, model: str, status: int, refusal: str, duration_ms: float,
                upstream_ms: float | None, input_tokens: int, output_tokens: int,
                cost_micros: int, stream: bool) -> None:
    """The request's line; the request id, tenant and key come from the request context.
    Call it only when `enabled()`: the caller skips building the arguments otherwise."""
    # The message is for the plain format; the json one writes the fields below as well.
    fields = {"endpoint": endpoint, "model": model, "status": status, "refusal": refusal,
              "duration_ms": round(duration_ms, 3),
              "upstream_ms": None if upstream_ms is None else round(upstream_ms, 3),
              "input_tokens": input_tokens, "output_tokens": output_tokens,
              "cost_micros": cost_micros, "stream": stream}
    log.info("%s %s %s %.1f ms%s%s", endpoint, status, model or "-", duration_ms,
             " stream" if stream else "", f" refused: {refusal}" if refusal else "",
             extra={"access": fields})
