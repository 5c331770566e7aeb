"""Whether this process traces requests, and its tracer: OpenTelemetry spans are off unless the
standard OTEL_* variables ask for them (config/telemetry.py reads them at startup and calls
`enable`). While off, the hot path pays one attribute read per span it would have made.

Spans of a /v1 call: `gateway.request` (the whole call, the request id as `tollgate.request_id`),
and within it `quota.reserve`, `upstream.call` and `quota.settle` (or `quota.release`).
"""
from __future__ import annotations

from typing import Any

_tracer: Any = None


def enable(tracer_provider: Any) -> None:
    """Trace from now on with a tracer of `tracer_provider` (an SDK TracerProvider)."""
    global _tracer
    _tracer = tracer_provider.get_tracer("tollgate.gateway")


def disable() -> None:
    global _tracer
    _tracer = None


def tracer() -> Any:
    """The tracer, or None when tracing is off (the caller then makes no span at all)."""
    return _tracer
