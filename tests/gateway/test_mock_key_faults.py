"""The mock upstream's per-key fault injection (POST /mock/faults): one bearer key fails while
another serves, then heals; faults per model; resets; the per-key request counts."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.mock_upstream import MockUpstream, api_key_id, start_subprocess


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    server = start_subprocess()
    yield server
    server.stop()


def _key() -> str:
    return f"sk-fault-{uuid.uuid4().hex}"


def _client(mock: MockUpstream, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=mock.base_url, api_key=key, max_retries=0, timeout=5)


def _set(mock: MockUpstream, key: str, faults: dict, model: str | None = None) -> httpx.Response:
    body = {"key": key, "faults": faults} | ({"model": model} if model else {})
    return httpx.post(f"{mock.url}/mock/faults", json=body, timeout=5)


def _chat(client: openai.OpenAI, model: str = "gpt-4o") -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=model, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])


def test_one_key_fails_while_another_serves_then_heals(mock: MockUpstream) -> None:
    bad, good = _key(), _key()
    assert _set(mock, bad, {"status": 503}).status_code == 200
    with pytest.raises(openai.InternalServerError) as failed:
        _chat(_client(mock, bad))
    assert failed.value.status_code == 503
    assert _chat(_client(mock, good)).usage.completion_tokens == 2
    assert _set(mock, bad, {}).status_code == 200
    assert _chat(_client(mock, bad)).usage.completion_tokens == 2
    report = httpx.get(f"{mock.url}/mock/faults", timeout=5).json()
    assert report["requests"][api_key_id(bad)] == 2
    assert report["requests"][api_key_id(good)] == 1
    assert api_key_id(bad) not in {f["api_key_id"] for f in report["faults"]}


def test_faults_for_one_model_leave_the_others_alone(mock: MockUpstream) -> None:
    key = _key()
    _set(mock, key, {"status": 500}, model="gpt-4o-mini")
    with pytest.raises(openai.InternalServerError):
        _chat(_client(mock, key), "gpt-4o-mini")
    assert _chat(_client(mock, key), "gpt-4o").usage.completion_tokens == 2


def test_a_reset_drops_the_connection_without_an_answer(mock: MockUpstream) -> None:
    key = _key()
    _set(mock, key, {"reset": True})
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{mock.base_url}/chat/completions", timeout=5,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    # Nothing was produced: nothing billed.
    usage = httpx.get(f"{mock.url}/mock/usage", timeout=5).json()
    assert api_key_id(key) not in {row["api_key_id"] for row in usage["completions"]}


def test_a_hang_is_a_timeout_for_that_key_only(mock: MockUpstream) -> None:
    key = _key()
    _set(mock, key, {"hang": True})
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=mock.base_url, api_key=key, max_retries=0, timeout=0.5) \
            .chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert _chat(_client(mock, _key())).usage.completion_tokens == 2


@pytest.mark.parametrize("body", [
    {"key": "sk-x", "faults": {"status": 200}},
    {"key": "sk-x", "faults": {"nonsense": 1}},
    {"key": "", "faults": {}},
    {"key": "sk-x", "faults": []},
])
def test_bad_fault_settings_are_a_400(mock: MockUpstream, body: dict) -> None:
    assert httpx.post(f"{mock.url}/mock/faults", json=body, timeout=5).status_code == 400
