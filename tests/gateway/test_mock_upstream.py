"""The mock upstream, served for real by uvicorn in a subprocess and driven by the openai SDK."""
from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.mock_upstream import MockUpstream, api_key_id, start_in_thread, start_subprocess
from gateway.mock_upstream.app import WORD_CYCLE, usage_page

WEATHER_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def mock() -> Iterator[MockUpstream]:
    server = start_subprocess()
    yield server
    server.stop()


def _key() -> str:
    # A fresh key per test keeps each test's bill rows apart on the shared server.
    return f"sk-test-{uuid.uuid4().hex}"


def client_for(mock: MockUpstream, key: str = "sk-test", **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=mock.base_url, api_key=key, max_retries=0, **kwargs)


@pytest.fixture
def client(mock: MockUpstream) -> openai.OpenAI:
    return client_for(mock)


def expected_text(n: int) -> str:
    return " ".join(WORD_CYCLE[i % len(WORD_CYCLE)] for i in range(n))


def usage_totals(mock: MockUpstream, key: str) -> dict[str, dict[str, dict[str, int]]]:
    """/mock/usage rows of one key, by kind then model."""
    raw = httpx.get(f"{mock.url}/mock/usage").json()
    kid = api_key_id(key)
    return {kind: {row["model"]: row for row in rows if row["api_key_id"] == kid} for kind, rows in raw.items()}


# --- chat completions --------------------------------------------------------------------------


def test_chat_non_streaming_counts_words(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hello there  friend"}]}],
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == "gpt-4o"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(16)
    assert choice.finish_reason == "stop"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 16, 21)


def test_tool_definitions_count_as_json_words(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], tools=WEATHER_TOOLS)  # type: ignore[arg-type]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 1 + len(json.dumps(WEATHER_TOOLS).split())
    # No "weather" in the question: a plain answer despite the tools.
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_cuts_with_finish_reason_length(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "tell me a long story"}]
    capped = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=5)
    assert capped.choices[0].finish_reason == "length"
    assert capped.choices[0].message.content == expected_text(5)
    assert capped.usage is not None and capped.usage.completion_tokens == 5

    capped_new = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_completion_tokens=3)
    assert capped_new.choices[0].finish_reason == "length"
    assert capped_new.usage is not None and capped_new.usage.completion_tokens == 3

    # A cap above the natural length changes nothing.
    roomy = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=100)
    assert roomy.choices[0].finish_reason == "stop"
    assert roomy.usage is not None and roomy.usage.completion_tokens == 16


def test_output_length_by_header_and_model_suffix(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    by_header = client.chat.completions.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Mock-Output-Tokens": "40"})
    assert by_header.usage is not None and by_header.usage.completion_tokens == 40
    assert by_header.choices[0].message.content == expected_text(40)

    by_model = client.chat.completions.create(model="gpt-4o@output_tokens=2", messages=messages, max_tokens=10)
    assert by_model.model == "gpt-4o"
    assert by_model.choices[0].message.content == expected_text(2)
    assert by_model.choices[0].finish_reason == "stop"


def test_stream_without_include_usage(mock: MockUpstream, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=6))
    assert all(chunk.usage is None and len(chunk.choices) == 1 for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(6)
    # role chunk + 6 word chunks + finish chunk
    assert len(chunks) == 8
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.model == "gpt-4.1" and c.object == "chat.completion.chunk" for c in chunks)

    # On the wire: no usage key at all, and the stream ends with [DONE].
    raw = httpx.post(f"{mock.base_url}/chat/completions", headers={"Authorization": "Bearer sk-test"},
                     json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n")
    assert '"usage"' not in raw.text


def test_stream_with_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "one two three four"}],
        stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (4, 16, 20)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert len(text.split()) == last.usage.completion_tokens


def test_tool_call_non_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o", tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "What is the Weather like in Paris?"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_tool_choice_none_and_forced(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "weather please"}]
    none = client.chat.completions.create(model="gpt-4o", tools=WEATHER_TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                          messages=messages)
    assert none.choices[0].message.tool_calls is None
    forced = client.chat.completions.create(
        model="gpt-4o", tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "hello"}])
    calls = forced.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_time"  # type: ignore[union-attr]


def test_tool_call_streaming(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="gpt-4o", tools=WEATHER_TOOLS, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "weather in Paris?"}]))
    name = ""
    arguments = ""
    ids = set()
    for chunk in chunks[:-1]:
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            if call.id:
                ids.add(call.id)
            if call.function and call.function.name:
                name += call.function.name
            if call.function and call.function.arguments:
                arguments += call.function.arguments
    assert name == "get_weather"
    assert len(ids) == 1 and next(iter(ids)).startswith("call_")
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


# --- legacy completions, embeddings, models ----------------------------------------------------


def test_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="say something nice", max_tokens=4)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected_text(4)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 4)

    several = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=["a b", "c"], max_tokens=2)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.usage is not None and (several.usage.prompt_tokens, several.usage.completion_tokens) == (3, 4)

    tokens = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=[1, 2, 3, 4, 5], max_tokens=1)
    assert tokens.usage is not None and tokens.usage.prompt_tokens == 5


def test_completions_streaming(client: openai.OpenAI) -> None:
    plain = list(client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", stream=True))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].text for c in plain) == expected_text(16)
    assert plain[-1].choices[0].finish_reason == "stop"

    counted = list(client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi you", stream=True,
                                             max_tokens=3, stream_options={"include_usage": True}))
    assert counted[-1].choices == []
    assert counted[-1].usage is not None
    assert (counted[-1].usage.prompt_tokens, counted[-1].usage.completion_tokens) == (2, 3)
    assert counted[-2].choices[0].finish_reason == "length"


def test_embeddings_default_sdk_call_uses_base64(client: openai.OpenAI) -> None:
    # What the SDK sends by default, checked on the wire rather than assumed.
    raw = client.embeddings.with_raw_response.create(model="text-embedding-3-small", input="a b")
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    assert isinstance(encoded, str)
    assert len(base64.b64decode(encoded)) == 8 * 4
    assert raw.parse().data[0].embedding == list(struct.unpack("<8f", base64.b64decode(encoded)))

    default = client.embeddings.create(model="text-embedding-3-small", input=["a b", "c", "a b"])
    explicit = client.embeddings.create(model="text-embedding-3-small", input=["a b", "c", "a b"],
                                        encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    vectors = [d.embedding for d in default.data]
    assert all(len(v) == 8 for v in vectors)
    assert vectors == [d.embedding for d in explicit.data]
    assert vectors[0] == vectors[2] != vectors[1]
    assert list(struct.unpack("<8f", base64.b64decode(encoded))) == vectors[0]
    assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-5) for v in vectors)
    assert default.usage.prompt_tokens == default.usage.total_tokens == 5

    sized = client.embeddings.create(model="text-embedding-3-small", input=[[1, 2, 3]], dimensions=32)
    assert len(sized.data[0].embedding) == 32
    assert sized.usage.prompt_tokens == 3


def test_models_list(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-3.5-turbo", "text-embedding-3-small"} <= ids
    assert client.models.retrieve("any-model-name").id == "any-model-name"


# --- auth and bad requests ---------------------------------------------------------------------


def test_missing_or_bad_auth_is_401(mock: MockUpstream) -> None:
    bad = client_for(mock, default_headers={"Authorization": "Basic abc"})
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"

    missing = httpx.post(f"{mock.base_url}/chat/completions",
                         json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 401
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{mock.base_url}/models").status_code == 401


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "gpt-4o", "messages": [', None),
    (b'["not", "an", "object"]', None),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "gpt-4o"}', "messages"),
    (b'{"model": "gpt-4o", "messages": []}', "messages"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    (b'{"model": "gpt-4o@bogus=1", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "gpt-4o@status=200", "messages": [{"role": "user", "content": "hi"}]}', "model"),
])
def test_bad_requests_are_400_in_openai_shape(mock: MockUpstream, body: bytes, param: str | None) -> None:
    reply = httpx.post(f"{mock.base_url}/chat/completions", content=body,
                       headers={"Authorization": "Bearer sk-test", "Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_bad_request_through_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="text-embedding-3-small", input=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"X-Mock-Typo": "1"})


# --- fault injection ---------------------------------------------------------------------------


def test_status_500_injection(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as by_model:
        client.chat.completions.create(model="gpt-4o@status=500", messages=[{"role": "user", "content": "hi"}])
    assert by_model.value.status_code == 500
    assert by_model.value.type == "server_error"
    with pytest.raises(openai.InternalServerError):
        client.embeddings.create(model="text-embedding-3-small", input="hi", extra_headers={"X-Mock-Status": "503"})


def test_status_429_with_retry_after(client: openai.OpenAI) -> None:
    with pytest.raises(openai.RateLimitError) as by_model:
        client.chat.completions.create(model="gpt-4o@status=429@retry_after=2",
                                       messages=[{"role": "user", "content": "hi"}], stream=True)
    assert by_model.value.response.headers["retry-after"] == "2"
    assert by_model.value.code == "rate_limit_exceeded"

    with pytest.raises(openai.RateLimitError) as by_header:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"X-Mock-Status": "429", "X-Mock-Retry-After": "7"})
    assert by_header.value.response.headers["retry-after"] == "7"


def test_cut_mid_stream_breaks_the_sdk_iteration(mock: MockUpstream) -> None:
    key = _key()
    client = client_for(mock, key)
    received: list[str] = []
    stream = client.chat.completions.create(
        model="gpt-4o@cut=3", messages=[{"role": "user", "content": "one two"}],
        stream=True, stream_options={"include_usage": True})
    with pytest.raises(openai.APIConnectionError) as caught:
        for chunk in stream:
            assert chunk.usage is None
            received.append(chunk.choices[0].delta.content or "")
    # The SDK wraps the transport's complaint about the unterminated chunked body.
    assert type(caught.value.__cause__).__name__ == "RemoteProtocolError"
    assert "".join(received) == expected_text(3)
    # Cut streams are billed for what was sent.
    row = usage_totals(mock, key)["completions"]["gpt-4o"]
    assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (2, 3, 1)

    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"X-Mock-Cut-After": "0"})


def test_first_byte_delay(client: openai.OpenAI) -> None:
    started = time.perf_counter()
    client.chat.completions.create(model="gpt-4o@first_byte_ms=300", messages=[{"role": "user", "content": "hi"}])
    assert time.perf_counter() - started >= 0.3

    started = time.perf_counter()
    stream = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_headers={"X-Mock-First-Byte-Ms": "250"})
    next(iter(stream))
    assert time.perf_counter() - started >= 0.25
    stream.close()


def test_chunk_delay(client: openai.OpenAI) -> None:
    started = time.perf_counter()
    chunks = list(client.chat.completions.create(
        model="gpt-4o@chunk_ms=40", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4))
    # role, 4 words, finish: five gaps of 40 ms.
    assert len(chunks) == 6
    assert time.perf_counter() - started >= 5 * 0.04


def test_client_leaving_a_slow_stream_is_billed_for_what_it_got(mock: MockUpstream) -> None:
    key = _key()
    client = client_for(mock, key)
    stream = client.chat.completions.create(
        model="gpt-4o@chunk_ms=1000", messages=[{"role": "user", "content": "hi"}], stream=True)
    iterator = iter(stream)
    next(iterator)  # role
    next(iterator)
    # Two words in; the server now waits 1 s before the third (a loaded machine may stall this
    # process for a few hundred ms before the close: it must still come first).
    next(iterator)
    stream.close()
    deadline = time.monotonic() + 5
    while not usage_totals(mock, key)["completions"] and time.monotonic() < deadline:
        time.sleep(0.02)
    row = usage_totals(mock, key)["completions"]["gpt-4o"]
    assert (row["completion_tokens"], row["requests"]) == (2, 1)


def test_hang_times_out_the_client(mock: MockUpstream) -> None:
    client = client_for(mock, timeout=0.5)
    started = time.perf_counter()
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="gpt-4o@hang", messages=[{"role": "user", "content": "hi"}])
    assert time.perf_counter() - started >= 0.5
    with pytest.raises(openai.APITimeoutError):
        client.models.list(extra_headers={"X-Mock-Hang": "1"})


# --- the bill ----------------------------------------------------------------------------------


def _bill(mock: MockUpstream, kind: str, query: str) -> dict[str, Any]:
    reply = httpx.get(f"{mock.base_url}/organization/usage/{kind}?{query}",
                      headers={"Authorization": "Bearer admin-key"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_bill_matches_the_usage_the_responses_reported(mock: MockUpstream) -> None:
    keys = [_key(), _key()]
    expected: dict[tuple[str, str], list[int]] = {}  # (key id, model) -> [input, output, requests]
    expected_embeddings: dict[tuple[str, str], list[int]] = {}

    def add(key: str, model: str, prompt: int, completion: int) -> None:
        acc = expected.setdefault((api_key_id(key), model), [0, 0, 0])
        acc[0] += prompt
        acc[1] += completion
        acc[2] += 1

    for i, key in enumerate(keys):
        client = client_for(mock, key)
        for model in ("gpt-4o", "gpt-4o-mini"):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "count " * (i + 3)}], max_tokens=7 + i)
            assert reply.usage is not None
            add(key, model, reply.usage.prompt_tokens, reply.usage.completion_tokens)
            chunks = list(client.chat.completions.create(
                model=f"{model}@output_tokens={5 + i}", messages=[{"role": "user", "content": "stream it"}],
                stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            assert usage is not None
            add(key, model, usage.prompt_tokens, usage.completion_tokens)
        legacy = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="legacy prompt here")
        assert legacy.usage is not None
        add(key, "gpt-3.5-turbo-instruct", legacy.usage.prompt_tokens, legacy.usage.completion_tokens)
        embedded = client.embeddings.create(model="text-embedding-3-small", input=["one two", "three"])
        acc = expected_embeddings.setdefault((api_key_id(key), "text-embedding-3-small"), [0, 0])
        acc[0] += embedded.usage.prompt_tokens
        acc[1] += 1
        # Failures are not billed.
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="gpt-4o@status=500", messages=[{"role": "user", "content": "x"}])

    now = int(time.time())
    ids = "&".join(f"api_key_ids={api_key_id(k)}" for k in keys)
    page = _bill(mock, "completions",
                 f"start_time={now - 3 * 86400}&end_time={now + 1}&bucket_width=1d"
                 f"&group_by=api_key_id&group_by=model&{ids}")
    assert page["object"] == "page" and page["has_more"] is False and page["next_page"] is None
    assert len(page["data"]) == 4
    today = page["data"][-1]
    assert today["object"] == "bucket"
    assert today["start_time"] <= now < today["end_time"] == today["start_time"] + 86400
    assert all(bucket["results"] == [] for bucket in page["data"][:-1])
    got = {(r["api_key_id"], r["model"]): [r["input_tokens"], r["output_tokens"], r["num_model_requests"]]
           for r in today["results"]}
    assert all(r["object"] == "organization.usage.completions.result" for r in today["results"])
    assert got == expected

    embedding_page = _bill(mock, "embeddings", f"start_time={now - 60}&group_by=api_key_id&group_by=model&{ids}")
    got_embeddings = {(r["api_key_id"], r["model"]): [r["input_tokens"], r["num_model_requests"]]
                      for r in embedding_page["data"][-1]["results"]}
    assert got_embeddings == expected_embeddings

    # Not grouped by model: one row per key, models summed and reported as null.
    by_key = _bill(mock, "completions", f"start_time={now - 60}&group_by=api_key_id&{ids}")
    for row in by_key["data"][-1]["results"]:
        assert row["model"] is None
        sums = [sum(v[j] for (kid, _), v in expected.items() if kid == row["api_key_id"]) for j in range(3)]
        assert [row["input_tokens"], row["output_tokens"], row["num_model_requests"]] == sums

    totals = usage_totals(mock, keys[0])["completions"]
    assert {m: [r["prompt_tokens"], r["completion_tokens"], r["requests"]] for m, r in totals.items()} == {
        model: v for (kid, model), v in expected.items() if kid == api_key_id(keys[0])}


def test_bill_pagination_and_validation(mock: MockUpstream) -> None:
    now = int(time.time())
    first = _bill(mock, "completions", f"start_time={now - 9 * 86400}&end_time={now}&limit=7")
    assert len(first["data"]) == 7 and first["has_more"] is True
    second = _bill(mock, "completions", f"start_time={now - 9 * 86400}&end_time={now}&limit=7"
                                        f"&page={first['next_page']}")
    assert second["has_more"] is False
    assert second["data"][0]["start_time"] == first["data"][-1]["end_time"]
    assert second["data"][-1]["end_time"] > now - 1
    for bad in ("bucket_width=1d", f"start_time={now}&bucket_width=1h", f"start_time={now}&group_by=colour"):
        reply = httpx.get(f"{mock.base_url}/organization/usage/completions?{bad}",
                          headers={"Authorization": "Bearer admin-key"})
        assert reply.status_code == 400
    assert httpx.get(f"{mock.base_url}/organization/usage/completions?start_time={now}").status_code == 401


def test_api_key_id_is_a_sha256_prefix() -> None:
    assert api_key_id("sk-test") == "key_" + hashlib.sha256(b"sk-test").hexdigest()[:12]


def test_reset_clears_usage() -> None:
    # A private server: resetting the shared one would disturb other tests' rows.
    with start_in_thread() as server:
        client = client_for(server, "sk-reset")
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert usage_totals(server, "sk-reset")["completions"]["gpt-4o"]["requests"] == 1
        assert httpx.post(f"{server.url}/mock/reset").status_code == 200
        assert usage_totals(server, "sk-reset") == {"completions": {}, "embeddings": {}}


def test_usage_page_buckets_are_utc_days() -> None:
    day = 20_000 * 86400
    page = usage_page("embeddings", f"start_time={day + 3600}&end_time={day + 86400 + 1}&group_by=model",
                      now=float(day + 2 * 86400))
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [
        (day, day + 86400), (day + 86400, day + 2 * 86400)]
    assert page["has_more"] is False
