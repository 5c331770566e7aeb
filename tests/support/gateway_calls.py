"""What an end-to-end call through the gateway left behind: the tenant's usage stream in the
quota store and what the mock upstream billed; and model names no other test uses."""
from __future__ import annotations

import json
import uuid
from typing import Any

import httpx

from gateway.mock_upstream import MockUpstream, api_key_id
from quotas.engine import QuotaEngine
from quotas.keys import usage_stream_key

SHARED_PROVIDER_SECRET = "sk-mock-upstream"  # the gateway conftest's shared provider key


def unique_model(prefix: str) -> str:
    """A model name no other test uses, so the mock's bill for it is this test's alone."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def usage_events(engine: QuotaEngine, tag: str) -> list[dict[str, Any]]:
    """The tenant's usage stream (one entry per ended hold), with `event` parsed."""
    entries = []
    for _, fields in engine.client.xrange(usage_stream_key(tag)):
        entry = dict(fields)
        entry["event"] = json.loads(entry["event"]) if entry.get("event") else {}
        entries.append(entry)
    return entries


def billed(mock: MockUpstream, model: str, secret: str = SHARED_PROVIDER_SECRET) -> dict[str, int]:
    """What the mock billed for `model` (its base name) under one provider secret."""
    rows = [row for row in httpx.get(f"{mock.url}/mock/usage", timeout=5).json()["completions"]
            if row["model"] == model and row["api_key_id"] == api_key_id(secret)]
    assert len(rows) <= 1
    return rows[0] if rows else {"prompt_tokens": 0, "completion_tokens": 0,
                                 "total_tokens": 0, "requests": 0}
