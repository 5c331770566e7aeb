"""The process-wide quota engine, built lazily from settings (management commands, Celery)."""
from __future__ import annotations

from quotas.client import make_redis
from quotas.engine import EngineSettings, QuotaEngine

_engine: QuotaEngine | None = None


def get_engine() -> QuotaEngine:
    global _engine
    if _engine is None:
        _engine = QuotaEngine(make_redis(), EngineSettings.from_django())
    return _engine
