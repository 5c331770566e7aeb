"""Offline tiktoken loading and the token estimates that become holds."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given
from hypothesis import strategies as st
import tiktoken.load
import tiktoken_ext.openai_public as openai_public

from gateway import tokens
from gateway.tokens import (
    BPE_FILES,
    CL100K_BASE,
    HEURISTIC,
    O200K_BASE,
    EncodingCacheError,
    count_stream_text,
    count_text,
    ensure_encodings_cached,
    estimate_chat_prompt,
    estimate_completion_prompt,
    estimate_embedding_input,
    image_tokens,
)

REPO = Path(__file__).resolve().parents[2]

# The example conversation of OpenAI's cookbook "How to count tokens with tiktoken", for which
# the cookbook reports 129 prompt tokens on gpt-3.5-turbo/gpt-4 and 124 on gpt-4o/gpt-4o-mini.
COOKBOOK_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities "
        "for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
        "deliverable.",
    },
]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g. San Francisco, CA",
                },
                "unit": {
                    "type": "string",
                    "description": "The unit of temperature to return",
                    "enum": ["celsius", "fahrenheit"],
                },
            },
            "required": ["location"],
        },
    },
}

SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. Tokenization is the process of "
    "splitting text into units that a language model reads, one at a time.",
    "chinese": "人工智能正在改变我们的生活方式和工作方式。今天天气很好，我们去公园散步吧。",
    "japanese": "今日はとても良い天気ですね。東京タワーに行きましょう。",
    "code": "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # circle\n",
    "json": '{"id":12345,"values":[1.5,2.25,3.125],"ok":true,"name":"x"}',
    "numbers": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
}


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tiktoken tried to download a BPE file")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


# --- offline loading ---------------------------------------------------------------------------


def test_bpe_urls_and_hashes_are_the_ones_tiktoken_asks_for(monkeypatch: pytest.MonkeyPatch):
    asked: dict[str, tuple[str, str | None]] = {}

    def record(blobpath: str, expected_hash: str | None = None) -> dict[bytes, int]:
        asked[blobpath.rsplit("/", 1)[-1].removesuffix(".tiktoken")] = (blobpath, expected_hash)
        return {}

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", record)
    openai_public.cl100k_base()
    openai_public.o200k_base()

    assert asked == {name: (bpe.url, bpe.sha256) for name, bpe in BPE_FILES.items()}


def test_ensure_cached_fills_a_fresh_cache_that_tiktoken_loads_without_network(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    _no_network(monkeypatch)

    assert ensure_encodings_cached() == cache

    for bpe in BPE_FILES.values():
        path = cache / hashlib.sha1(bpe.url.encode()).hexdigest()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == bpe.sha256
    # Build the encodings the way tiktoken's registry does, bypassing its process-wide cache:
    # the BPE files can only come from our cache directory, since downloading raises.
    o200k = tiktoken.Encoding(**openai_public.o200k_base())
    cl100k = tiktoken.Encoding(**openai_public.cl100k_base())
    assert o200k.encode("hello world") == [24912, 2375]
    assert cl100k.encode("hello world") == [15339, 1917]


def test_cache_defaults_to_the_data_dir_and_is_exported_to_tiktoken(
    monkeypatch: pytest.MonkeyPatch, settings: Any, tmp_path: Path
):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    settings.DATA_DIR = tmp_path

    assert ensure_encodings_cached() == tmp_path / "tiktoken"
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path / "tiktoken")
    assert len(list((tmp_path / "tiktoken").iterdir())) == len(BPE_FILES)


def test_a_corrupt_cache_file_is_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    bpe = BPE_FILES[CL100K_BASE]
    (tmp_path / bpe.cache_name).write_bytes(b"truncated")

    ensure_encodings_cached()

    assert hashlib.sha256((tmp_path / bpe.cache_name).read_bytes()).hexdigest() == bpe.sha256


def test_a_packaged_file_with_the_wrong_hash_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    wrong = tokens.BpeFile(O200K_BASE, BPE_FILES[O200K_BASE].url, "0" * 64)
    monkeypatch.setitem(tokens.BPE_FILES, O200K_BASE, wrong)

    with pytest.raises(EncodingCacheError, match="sha256"):
        ensure_encodings_cached()
    assert not (tmp_path / wrong.cache_name).exists()


def test_an_empty_cache_dir_setting_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(EncodingCacheError, match="empty"):
        ensure_encodings_cached()


def test_a_new_process_counts_tokens_with_the_network_disabled(tmp_path: Path):
    # The real path of a gateway process: nothing cached, TIKTOKEN_CACHE_DIR unset, no network.
    script = (
        "import socket\n"
        "def refuse(*a, **k): raise OSError('network disabled in this test')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "import django; django.setup()\n"
        "from gateway.tokens import count_text\n"
        "print(count_text('hello world', 'o200k_base'), count_text('hello world', 'cl100k_base'))\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"}
    }
    env.update(
        TOLLGATE_DATA_DIR=str(tmp_path / "data"),
        DJANGO_SETTINGS_MODULE="config.settings",
        TMPDIR=str(tmp_path / "tmp"),  # tiktoken's own default cache would live under here
    )
    (tmp_path / "tmp").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "2"]
    assert len(list((tmp_path / "data" / "tiktoken").iterdir())) == len(BPE_FILES)
    assert not list((tmp_path / "tmp").iterdir())


def test_encodings_are_loaded_once_per_process():
    assert tokens.get_encoding(O200K_BASE) is tokens.get_encoding(O200K_BASE)
    with pytest.raises(ValueError, match="unknown tiktoken encoding"):
        tokens.get_encoding("p50k_base")


# --- counting ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "encoding", "expected"),
    [
        ("hello world", O200K_BASE, 2),
        ("hello world", CL100K_BASE, 2),
        ("你好，世界", O200K_BASE, 3),
        ("你好，世界", CL100K_BASE, 6),
        ("", O200K_BASE, 0),
        ("", HEURISTIC, 0),
    ],
)
def test_count_text(text: str, encoding: str, expected: int):
    assert count_text(text, encoding) == expected


def test_special_token_text_is_counted_not_rejected():
    # tiktoken.encode() raises on "<|endoftext|>"; a prompt may contain it as plain text.
    assert count_text("<|endoftext|>", CL100K_BASE) > 1
    assert count_stream_text("a <|endofprompt|> b", O200K_BASE) > 3


def test_count_stream_text_is_the_completion_token_count():
    text = "Sure! Here is a haiku:\nAn old silent pond\nA frog jumps into the pond"
    assert count_stream_text(text, O200K_BASE) == len(
        tiktoken.get_encoding(O200K_BASE).encode(text)
    )


@pytest.mark.parametrize(
    ("tokenizer", "model", "expected"),
    [(O200K_BASE, "gpt-4o", 124), (CL100K_BASE, "gpt-3.5-turbo", 129)],
)
def test_cookbook_conversation(tokenizer: str, model: str, expected: int):
    assert (
        estimate_chat_prompt(COOKBOOK_MESSAGES, model=model, tools=None, functions=None,
                             tokenizer=tokenizer)
        == expected
    )


def test_chat_rule_per_message_name_and_priming():
    enc = tiktoken.get_encoding(O200K_BASE)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "ada", "content": "Hi there"},
    ]
    by_hand = (
        3 + len(enc.encode("system")) + len(enc.encode("Be brief."))
        + 3 + len(enc.encode("user")) + len(enc.encode("ada")) + 1 + len(enc.encode("Hi there"))
        + 3
    )
    assert estimate_chat_prompt(messages, model="gpt-4o", tokenizer=O200K_BASE) == by_hand


def test_text_parts_count_like_string_content():
    as_string = [{"role": "user", "content": "Describe a sunset over the sea."}]
    as_parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe a sunset"},
                {"type": "text", "text": " over the sea."},
            ],
        }
    ]
    plain = estimate_chat_prompt(as_string, model="gpt-4o", tokenizer=O200K_BASE)
    parts = estimate_chat_prompt(as_parts, model="gpt-4o", tokenizer=O200K_BASE)
    # Two parts tokenize at most one token apart from the joined string.
    assert plain <= parts <= plain + 1


@pytest.mark.parametrize(
    ("model", "detail", "expected"),
    [
        ("gpt-4o", "low", 85),
        ("gpt-4o", "high", 85 + 8 * 170),
        ("gpt-4o", None, 85 + 8 * 170),  # auto may pick high
        ("gpt-4o-2024-08-06", "auto", 1445),
        ("gpt-4o-mini", "high", 2833 + 8 * 5667),
        ("gpt-4o-mini-2024-07-18", "low", 2833),
        ("gpt-4.1-mini", "high", 2489),
        ("some-local-vlm", "high", 1445),
    ],
)
def test_image_tokens_hold_the_most_an_image_can_cost(
    model: str, detail: str | None, expected: int
):
    assert image_tokens(model, detail) == expected


def test_image_parts_add_their_fixed_estimate():
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]
    with_images = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                    "detail": "low"}},
            ],
        }
    ]
    base = estimate_chat_prompt(text_only, model="gpt-4o", tokenizer=O200K_BASE)
    assert estimate_chat_prompt(with_images, model="gpt-4o", tokenizer=O200K_BASE) == (
        base + 1445 + 85
    )


def _cookbook_tools_count(tools: list[dict[str, Any]], encoding: tiktoken.Encoding) -> int:
    """The cookbook's num_tokens_for_tools for gpt-4o (func_init 7, prop_init 3, prop_key 3,
    enum_init -3, enum_item 3, func_end 12), without the messages."""
    total = 0
    for tool in tools:
        function = tool["function"]
        total += 7
        description = function["description"].removesuffix(".")
        total += len(encoding.encode(f"{function['name']}:{description}"))
        properties = function["parameters"]["properties"]
        if properties:
            total += 3
            for key, prop in properties.items():
                total += 3
                if "enum" in prop:
                    total += -3
                    for item in prop["enum"]:
                        total += 3 + len(encoding.encode(item))
                prop_description = prop["description"].removesuffix(".")
                total += len(encoding.encode(f"{key}:{prop['type']}:{prop_description}"))
    return total + 12


def test_tool_definitions_count_their_json_and_bound_the_cookbook_figure():
    encoding = tiktoken.get_encoding(O200K_BASE)
    messages = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What's the weather like in San Francisco?"},
    ]
    without = estimate_chat_prompt(messages, model="gpt-4o", tokenizer=O200K_BASE)
    with_tools = estimate_chat_prompt(
        messages, model="gpt-4o", tools=[WEATHER_TOOL], tokenizer=O200K_BASE
    )
    definition_json = json.dumps(WEATHER_TOOL, separators=(",", ":"), sort_keys=True)

    assert with_tools - without == (
        tokens.TOOL_DEFINITION_OVERHEAD + len(encoding.encode(definition_json))
        + tokens.TOOLS_OVERHEAD
    )
    assert with_tools - without >= _cookbook_tools_count([WEATHER_TOOL], encoding)


def test_legacy_functions_are_counted_like_tools():
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    function = WEATHER_TOOL["function"]
    without = estimate_chat_prompt(messages, model="gpt-4", tokenizer=CL100K_BASE)
    with_functions = estimate_chat_prompt(
        messages, model="gpt-4", functions=[function], tokenizer=CL100K_BASE
    )
    assert with_functions > without + count_text(function["description"], CL100K_BASE)


def test_assistant_tool_calls_count_name_and_arguments():
    encoding = tiktoken.get_encoding(O200K_BASE)
    arguments = json.dumps({"location": "Paris, France", "unit": "celsius"})
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_current_weather", "arguments": arguments},
            }
        ],
    }
    empty_message = {"role": "assistant", "content": None}
    difference = estimate_chat_prompt(
        [call_message], model="gpt-4o", tokenizer=O200K_BASE
    ) - estimate_chat_prompt([empty_message], model="gpt-4o", tokenizer=O200K_BASE)

    assert difference == (
        tokens.TOOL_CALL_OVERHEAD
        + len(encoding.encode("get_current_weather"))
        + len(encoding.encode(arguments))
    )


def test_tool_result_messages_count_their_call_id_and_content():
    message = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}
    enc = tiktoken.get_encoding(O200K_BASE)
    expected = 3 + sum(len(enc.encode(v)) for v in message.values()) + 3
    assert estimate_chat_prompt([message], model="gpt-4o", tokenizer=O200K_BASE) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hello world", 2),
        (["hello world", "你好，世界"], 2 + 6),
        ([15339, 1917, 0, 42], 4),
        ([[15339, 1917], [1, 2, 3]], 5),
        ([], 0),
    ],
)
def test_completion_prompts_and_embedding_inputs(value: Any, expected: int):
    assert estimate_completion_prompt(value, CL100K_BASE) == expected
    assert estimate_embedding_input(value, CL100K_BASE) == expected


def test_inputs_of_the_wrong_shape_are_refused():
    with pytest.raises(TypeError):
        estimate_embedding_input({"text": "x"}, CL100K_BASE)  # type: ignore[arg-type]


# --- the heuristic tokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_heuristic_over_estimates_o200k(name: str):
    text = SAMPLES[name]
    assert count_text(text, HEURISTIC) >= count_text(text, O200K_BASE)


@pytest.mark.parametrize("name", ["english", "code", "json", "numbers"])
def test_heuristic_over_estimates_cl100k(name: str):
    text = SAMPLES[name]
    assert count_text(text, HEURISTIC) >= count_text(text, CL100K_BASE)


@pytest.mark.parametrize("name", ["chinese", "japanese"])
def test_heuristic_short_of_cl100k_on_cjk_by_less_than_the_safety_factor(name: str):
    # cl100k spends slightly more than one token per CJK character; the heuristic charges one.
    text = SAMPLES[name]
    assert count_text(text, HEURISTIC) * 1.25 >= count_text(text, CL100K_BASE)


def test_heuristic_is_not_wildly_high_for_english():
    text = SAMPLES["english"] * 10
    assert count_text(text, HEURISTIC) <= 2 * count_text(text, O200K_BASE)


def test_heuristic_chat_estimate_bounds_the_real_count():
    heuristic = estimate_chat_prompt(COOKBOOK_MESSAGES, model="my-llama", tokenizer=HEURISTIC)
    assert heuristic >= 129


@given(st.text(alphabet=st.characters(max_codepoint=127)))
def test_the_ascii_fast_path_splits_like_the_unicode_pattern(text: str):
    assert tokens._ASCII_HEURISTIC_PIECES.findall(text) == tokens._HEURISTIC_PIECES.findall(text)
    assert tokens._heuristic_count(text) == sum(
        tokens._heuristic_piece(piece) for piece in tokens._HEURISTIC_PIECES.findall(text)
    )
