"""Estimating Responses API and Messages API prompts: every shape is counted, never below the
words the upstream (the mock counts words) bills for its text, never absurdly high, and odd
shapes never raise. Then admission's estimate(): the output caps and the context refusal."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import signal
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gateway import tokens
from gateway.bodies import Endpoint, parse_body
from gateway.catalog import ModelInfo, hold_for
from gateway.errors import GatewayError
from gateway.prices import Price
from gateway.tokens import (
    ANTHROPIC_IMAGE_TOKENS,
    ANTHROPIC_TOOLS_OVERHEAD,
    BUILT_IN_TOOL_TOKENS,
    CL100K_BASE,
    HEURISTIC,
    O200K_BASE,
    PDF_PAGE_TEXT_TOKENS,
    TOKENS_PER_MESSAGE,
    TOOL_DEFINITION_OVERHEAD,
    TOOLS_OVERHEAD,
    UNSEEN_CONTENT_TOKENS,
    count_text,
    estimate_messages_prompt,
    estimate_responses_input,
    image_tokens,
)

TOKENIZERS = (O200K_BASE, CL100K_BASE, HEURISTIC)
TEN_WORDS = "Please tell me a short story about a brave cat."
assert len(TEN_WORDS.split()) == 10


def responses(body: dict[str, Any], tokenizer: str = O200K_BASE, model: str = "gpt-4o") -> int:
    return estimate_responses_input(body, model=model, tokenizer=tokenizer)


def messages(body: dict[str, Any], tokenizer: str = O200K_BASE) -> int:
    return estimate_messages_prompt(body, model="claude-sonnet-4-5", tokenizer=tokenizer)


def words(value: Any) -> int:
    """Every word of every string in `value`: more than the mock bills for its text."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, dict):
        return sum(words(v) for v in value.values())
    if isinstance(value, list):
        return sum(words(v) for v in value)
    return 0


# --- sensible sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_a_ten_word_message_is_estimated_at_ten_to_forty_tokens(tokenizer: str):
    shapes = [
        responses({"input": TEN_WORDS}, tokenizer),
        responses({"input": [{"role": "user", "content": TEN_WORDS}]}, tokenizer),
        responses({"input": [{"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": TEN_WORDS}]}]},
                  tokenizer),
        messages({"messages": [{"role": "user", "content": TEN_WORDS}]}, tokenizer),
        messages({"messages": [{"role": "user",
                                "content": [{"type": "text", "text": TEN_WORDS}]}]}, tokenizer),
    ]
    assert all(10 <= estimate <= 40 for estimate in shapes), shapes


RESPONSE_BODY: dict[str, Any] = {
    "instructions": "You are a careful assistant who answers in plain English.",
    "input": [
        {"role": "developer", "content": "Always cite the tool you used."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is the weather in Paris today, and tomorrow?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\", \"days\": 2}"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": "Sunny today at 21 C, rain tomorrow at 14 C."},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Today is sunny; tomorrow it rains.",
             "annotations": []}]},
        {"type": "reasoning", "id": "rs_1",
         "summary": [{"type": "summary_text", "text": "The user wants a two day forecast."}]},
        {"role": "user", "content": "Thanks! And in Lyon?"},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather forecast",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                               "days": {"type": "integer"}}}}],
}

MESSAGES_BODY: dict[str, Any] = {
    "system": [{"type": "text", "text": "You are a careful assistant who answers briefly."}],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris today, and tomorrow?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the weather tool for Paris.",
             "signature": "c2ln"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Sunny today at 21 C, rain tomorrow."}]},
            {"type": "text", "text": "Thanks! And in Lyon?"}]},
    ],
    "tools": [{"name": "get_weather", "description": "Weather forecast",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
}


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_a_whole_conversation_bounds_its_words_without_running_away(tokenizer: str):
    for estimate, body, fixed in (
            (responses(RESPONSE_BODY, tokenizer), RESPONSE_BODY, TOOLS_OVERHEAD),
            (messages(MESSAGES_BODY, tokenizer), MESSAGES_BODY, ANTHROPIC_TOOLS_OVERHEAD)):
        # Every string's words (the mock bills fewer: only texts, calls and the tools' JSON).
        assert estimate >= words(body)
        # Not absurd: the text, the fixed overheads, and at most 4 tokens a word besides.
        assert estimate <= fixed + 4 * words(body) + 60


# --- each shape adds what it should -------------------------------------------------------------

def _user(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": parts}]}


def test_instructions_and_a_string_input_count_like_two_messages():
    text, instructions = "Hello there world", "Be brief"
    assert responses({"input": text, "instructions": instructions}) == (
        3 + 2 * TOKENS_PER_MESSAGE + count_text(text, O200K_BASE)
        + count_text(instructions, O200K_BASE))


@pytest.mark.parametrize(("model", "detail"), [("gpt-4o", None), ("gpt-4o", "low"),
                                               ("gpt-4o-mini", "high"), ("gpt-4.1-nano", "auto")])
def test_an_openai_image_part_holds_the_most_that_image_can_cost(model: str, detail: str | None):
    text = [{"type": "input_text", "text": "What is this?"}]
    image = {"type": "input_image", "image_url": "https://x.test/a.png"}
    if detail:
        image["detail"] = detail
    base = responses(_user(text), model=model)
    assert responses(_user([*text, image]), model=model) == base + image_tokens(model, detail)


def _pdf(pages: int) -> bytes:
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages))
    objects = [b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n",
               f"2 0 obj << /Type /Pages /Kids [{kids}] /Count {pages} >> endobj\n".encode()]
    objects += [f"{3 + i} 0 obj << /Type /Page /Parent 2 0 R >> endobj\n".encode()
                for i in range(pages)]
    return b"".join(objects) + b"trailer << /Root 1 0 R >>\n%%EOF\n"


def _pdf_with_object_stream(pages: int) -> bytes:
    # PDF 1.5: the page objects live compressed inside an object stream.
    inner = b" ".join([b"<< /Type /Pages /Count 3 >>"]
                      + [b"<< /Type /Page /Parent 2 0 R >>"] * pages)
    packed = zlib.compress(inner)
    return (b"%PDF-1.5\n5 0 obj << /Type /ObjStm /N 4 /First 12 /Filter /FlateDecode /Length "
            + str(len(packed)).encode() + b" >>\nstream\n" + packed
            + b"\nendstream\nendobj\n%%EOF\n")


def _file_part(data: bytes, media: str = "application/pdf") -> dict[str, Any]:
    return {"type": "input_file", "filename": "f.pdf",
            "file_data": f"data:{media};base64,{base64.b64encode(data).decode()}"}


def test_an_openai_pdf_is_held_per_page_for_its_text_and_its_image():
    base = responses(_user([]))
    per_page = PDF_PAGE_TEXT_TOKENS + image_tokens("gpt-4o", "high")
    file_name = count_text("f.pdf", O200K_BASE)
    assert responses(_user([_file_part(_pdf(2))])) == base + 2 * per_page + file_name
    assert responses(_user([_file_part(_pdf_with_object_stream(3))])) == (
        base + 3 * per_page + file_name)


def test_a_pdf_whose_pages_cannot_be_found_is_held_by_its_size():
    opaque = b"%PDF-1.7\n" + bytes(range(256)) * 8
    assert responses(_user([_file_part(opaque)])) == (
        responses(_user([])) + len(opaque) + count_text("f.pdf", O200K_BASE))


@contextlib.contextmanager
def _fails_if_it_hangs(seconds: int) -> Iterator[None]:
    """Fail the test when the block runs longer than `seconds` (SIGALRM interrupts even a regex
    scan). Not a timing assertion: the fixed scans take milliseconds, the quadratic one they
    replace took hours on such bodies; the bound only keeps a regression from hanging the run."""
    def hung(signum: int, frame: Any) -> None:
        raise AssertionError(f"still running after {seconds} s: the scan is not linear")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


_OBJSTM_NO_STREAM = b"/Type/ObjStm "


@pytest.mark.parametrize("size", [104 * 1024, 2 * 1024 * 1024])
def test_many_object_stream_headers_without_a_stream_are_scanned_in_linear_time(size: int):
    # The body that took 4.7 s at 104 KB (quadratic: each header's lazy scan ran to the end).
    pdf = b"%PDF-1.5\n" + _OBJSTM_NO_STREAM * (size // len(_OBJSTM_NO_STREAM))
    with _fails_if_it_hangs(20):
        assert tokens._pdf_pages(pdf) == 0
        assert list(tokens._object_stream_starts(pdf)) == []
        # Through the estimate, as a client's base64 file: held by its size (no page found).
        assert responses(_user([_file_part(pdf)])) == (
            responses(_user([])) + len(pdf) + count_text("f.pdf", O200K_BASE))


def test_the_stream_keyword_is_looked_for_only_near_its_dictionary():
    far = b"%PDF-1.5\n<< /Type /ObjStm /N 1" + b" " * tokens._PDF_STREAM_WINDOW + b">>\nstream\n"
    near = b"%PDF-1.5\n<< /Type /ObjStm /N 1 >>\nstream\n"
    assert list(tokens._object_stream_starts(far)) == []
    assert list(tokens._object_stream_starts(near)) == [len(near)]


def test_at_most_so_many_object_streams_are_examined():
    header = b"<< /Type /ObjStm >>\nstream\n"
    pdf = b"%PDF-1.5\n" + header * (tokens._PDF_MAX_OBJECT_STREAMS + 500)
    with _fails_if_it_hangs(20):
        assert len(list(tokens._object_stream_starts(pdf))) == tokens._PDF_MAX_OBJECT_STREAMS


def test_inflating_object_streams_is_bounded_in_and_out(monkeypatch: pytest.MonkeyPatch):
    # A zip bomb: 64 MB of "/Type /Page" from about 200 KB, behind one object stream header.
    page = b"<< /Type /Page >>"
    bomb = zlib.compress(page * (64 * 1024 * 1024 // len(page)), 9)
    pdf = b"%PDF-1.5\n<< /Type /ObjStm >>\nstream\n" + bomb
    with _fails_if_it_hangs(20):
        pages = tokens._pdf_pages(pdf)
    # Only the first _PDF_MAX_INFLATED bytes are inflated (and counted).
    assert pages == tokens._PDF_MAX_INFLATED // len(page)
    inflated, read = tokens._inflate(memoryview(bomb), 1000)
    assert len(inflated) == 1000 and 0 < read < len(bomb)
    # Empty deflate blocks consume input without output: the compressed bytes read are bounded
    # too, across all object streams together.
    budget = 256 * 1024
    monkeypatch.setattr(tokens, "_PDF_MAX_DEFLATED", budget)
    empty_blocks = b"\x78\x01" + b"\x00\x00\x00\xff\xff" * 40_000  # 200 KB, no output
    header = b"<< /Type /ObjStm >>\nstream\n"
    reads: list[int] = []
    real_inflate = tokens._inflate

    def counting(data: memoryview, max_out: int) -> tuple[bytes, int]:
        result = real_inflate(data, max_out)
        reads.append(result[1])
        return result

    monkeypatch.setattr(tokens, "_inflate", counting)
    # Ten object streams of 200 KB of empty blocks each (2 MB in all): reading stops once the
    # budget is spent, long before the tenth.
    empty = b"%PDF-1.5\n" + (header + empty_blocks) * 10
    with _fails_if_it_hangs(20):
        assert tokens._pdf_pages(empty) == 0
    assert len(reads) < 10
    assert budget <= sum(reads) <= budget + 2 * tokens._PDF_INFLATE_CHUNK


def test_data_that_is_not_zlib_is_charged_what_was_read():
    inflated, read = tokens._inflate(memoryview(b"not zlib at all" * 10_000), 1000)
    assert inflated == b"" and read == tokens._PDF_INFLATE_CHUNK


def test_an_inline_text_file_is_counted_as_text_and_a_file_url_at_the_allowance():
    # A file by id is refused by parse_body; should one reach the estimate, it gets the
    # allowance of an unseen file too.
    text = "one two three four five six seven " * 20
    inline = responses(_user([_file_part(text.encode(), "text/plain")]))
    assert inline == responses(_user([])) + count_text(text, O200K_BASE) + count_text(
        "f.pdf", O200K_BASE)
    for part in ({"type": "input_file", "file_id": "file-abc"},
                 {"type": "input_file", "file_url": "https://x.test/report.pdf"}):
        assert responses(_user([part])) == responses(_user([])) + UNSEEN_CONTENT_TOKENS


def test_function_calls_and_their_outputs_count_every_word():
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup",
            "arguments": json.dumps({"query": "the tallest mountain in the alps"})}
    output = {"type": "function_call_output", "call_id": "call_1",
              "output": [{"type": "input_text", "text": "Mont Blanc, 4,806 metres high"}]}
    for item in (call, output):
        added = responses({"input": [item]}) - responses({"input": []})
        assert added >= words(item) and added <= 4 * words(item) + 10


def test_function_tools_count_their_json_and_built_in_tools_their_allowance():
    function = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    base = responses({"input": "hi"})
    with_function = responses({"input": "hi", "tools": [function]})
    assert with_function == base + TOOLS_OVERHEAD + TOOL_DEFINITION_OVERHEAD + count_text(
        json.dumps(function, separators=(",", ":"), sort_keys=True), O200K_BASE)
    # Built-in tools without a per-call fee (those with one are refused by parse_body).
    for tool in ({"type": "computer_use_preview", "display_width": 1024,
                  "display_height": 768, "environment": "browser"},
                 {"type": "local_shell"}, {"type": "apply_patch"},
                 {"type": "mcp", "server_label": "docs"}):
        added = responses({"input": "hi", "tools": [function, tool]}) - with_function
        assert added == BUILT_IN_TOOL_TOKENS + count_text(
            json.dumps(tool, separators=(",", ":"), sort_keys=True), O200K_BASE), tool


def test_a_structured_output_schema_is_counted():
    schema = {"type": "json_schema", "name": "answer",
              "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    assert responses({"input": "hi", "text": {"format": schema}}) > responses(
        {"input": "hi"}) + 10


def test_references_and_encrypted_reasoning_are_held_at_their_rules():
    assert responses({"input": [{"type": "item_reference", "id": "msg_1"}]}) == (
        responses({"input": []}) + TOKENS_PER_MESSAGE + UNSEEN_CONTENT_TOKENS)
    secret = "QUJD" * 250  # 1,000 characters of ciphertext
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": secret}
    assert responses({"input": [reasoning]}) == (
        responses({"input": []}) + TOKENS_PER_MESSAGE + 500)


def test_anthropic_images_and_documents():
    text = {"type": "text", "text": "Summarise these."}

    def with_blocks(*blocks: dict[str, Any]) -> int:
        return messages({"messages": [{"role": "user", "content": [text, *blocks]}]})

    base = with_blocks()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(b"\x89PNG" * 5000).decode()}}
    assert with_blocks(image, image) == base + 2 * ANTHROPIC_IMAGE_TOKENS
    assert with_blocks({"type": "image", "source": {"type": "url", "url": "https://x.test/a"}}) == (
        base + ANTHROPIC_IMAGE_TOKENS)
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": base64.b64encode(_pdf(4)).decode()}}
    assert with_blocks(pdf) == base + 4 * (PDF_PAGE_TEXT_TOKENS + ANTHROPIC_IMAGE_TOKENS)
    plain = "A plain text document of some length. " * 10
    document = {"type": "document", "title": "Notes",
                "source": {"type": "text", "media_type": "text/plain", "data": plain}}
    assert with_blocks(document) == base + count_text(plain, O200K_BASE) + count_text(
        "Notes", O200K_BASE)
    nested = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": plain}]}}
    assert with_blocks(nested) == base + count_text(plain, O200K_BASE)
    for source in ({"type": "url", "url": "https://x.test/a.pdf"},
                   {"type": "file", "file_id": "file_1"}):
        assert with_blocks({"type": "document", "source": source}) == (
            base + UNSEEN_CONTENT_TOKENS)


def test_anthropic_tools_thinking_and_results_count_their_words():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    custom = {"name": "lookup", "description": "Search the docs",
              "input_schema": {"type": "object"}}
    with_custom = messages({**body, "tools": [custom]})
    assert with_custom == messages(body) + ANTHROPIC_TOOLS_OVERHEAD + TOOL_DEFINITION_OVERHEAD + (
        count_text(json.dumps(custom, separators=(",", ":"), sort_keys=True), O200K_BASE))
    for tool in ({"type": "web_fetch_20250910", "name": "web_fetch"},
                 {"type": "bash_20250124", "name": "bash"},
                 {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}):
        added = messages({**body, "tools": [custom, tool]}) - with_custom
        assert BUILT_IN_TOOL_TOKENS < added <= BUILT_IN_TOOL_TOKENS + 30, tool
    for block in ({"type": "tool_use", "id": "toolu_1", "name": "lookup",
                   "input": {"query": "the tallest mountain in the alps"}},
                  {"type": "tool_result", "tool_use_id": "toolu_1",
                   "content": "Mont Blanc at 4,806 metres"},
                  {"type": "thinking", "thinking": "The user asks about Alpine peaks.",
                   "signature": "c2ln"}):
        added = messages({"messages": [{"role": "user", "content": [block]}]}) - messages(
            {"messages": [{"role": "user", "content": []}]})
        assert words(block) - 2 <= added <= 4 * words(block) + 10, block
    server = {"type": "url", "url": "https://mcp.test/sse", "name": "docs"}
    assert messages({**body, "mcp_servers": [server]}) == messages(body) + (
        BUILT_IN_TOOL_TOKENS + count_text(json.dumps(server, separators=(",", ":"),
                                                     sort_keys=True), O200K_BASE))
    redacted = {"type": "redacted_thinking", "data": "QUJD" * 100}
    assert messages({"messages": [{"role": "assistant", "content": [redacted]}]}) == (
        messages({"messages": [{"role": "assistant", "content": []}]}) + 200)


def test_a_string_system_counts_like_a_message():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert messages({**body, "system": "Be brief and kind"}) == (
        messages(body) + TOKENS_PER_MESSAGE + count_text("Be brief and kind", O200K_BASE))


# --- odd shapes never raise --------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["type", "role", "content", "text", "source", "data",
                                       "output", "summary", "file_data", "detail", "input",
                                       "arguments", "name", "x"]), children, max_size=5),
    max_leaves=20)
TYPES = st.sampled_from([
    "message", "function_call", "function_call_output", "reasoning", "item_reference",
    "input_text", "input_image", "input_file", "output_text", "refusal", "text", "image",
    "document", "tool_use", "tool_result", "thinking", "redacted_thinking", "base64", "content",
    "url", "file", "web_search", "mcp", "mystery_item"])
ITEM = st.builds(lambda kind, rest: {**rest, "type": kind}, TYPES,
                 st.dictionaries(st.sampled_from(["role", "content", "text", "source", "output",
                                                  "summary", "file_data", "data", "input",
                                                  "encrypted_content", "detail"]),
                                 JSON | st.lists(st.builds(lambda k, r: {**r, "type": k}, TYPES,
                                                           st.dictionaries(st.text(max_size=5),
                                                                           JSON, max_size=3)),
                                                 max_size=3), max_size=4))


@hypothesis_settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["input", "instructions", "tools", "text", "prompt",
                                        "messages", "system"]),
                       JSON | st.lists(ITEM, max_size=4), max_size=4))
def test_any_shape_is_estimated_without_raising(body: dict[str, Any]):
    for tokenizer in (O200K_BASE, HEURISTIC):
        assert responses(body, tokenizer) >= 3
        assert messages(body, tokenizer) >= 3


def test_unknown_items_and_blocks_are_counted_by_their_json():
    item = {"type": "local_shell_call", "id": "ls_1", "action": {"command": ["ls", "-la"]}}
    assert responses({"input": [item]}) == responses({"input": []}) + TOKENS_PER_MESSAGE + (
        count_text(json.dumps(item, separators=(",", ":"), sort_keys=True), O200K_BASE))
    block = {"type": "search_result", "title": "Alps", "content": [{"type": "text",
                                                                    "text": "Mont Blanc"}]}
    assert messages({"messages": [{"role": "user", "content": [block]}]}) == messages(
        {"messages": [{"role": "user", "content": []}]}) + count_text(
        json.dumps(block, separators=(",", ":"), sort_keys=True), O200K_BASE)


# --- admission.estimate() ----------------------------------------------------------------------

INFO = ModelInfo(name="gpt-4o", tokenizer=O200K_BASE, kind="chat", context_window=1_000,
                 default_output_tokens=200, max_output_tokens=500)
PRICE = Price(1, 2)


@pytest.fixture
def ctx(db: None) -> Any:
    from gateway.auth import load_key_context
    from tenants.api_key_format import parse_key
    from tenants.services import create_project, create_tenant, issue_key

    tenant = create_tenant(f"est-{uuid.uuid4().hex[:10]}", plan_name="free", actor="test")
    issued = issue_key(create_project(tenant, "app", actor="test"), actor="test")
    context = load_key_context(parse_key(issued.plaintext))
    assert context is not None
    return context


def _parse(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return parse_body(endpoint, json.dumps({"model": "gpt-4o", **body}).encode())


def test_the_responses_output_cap_is_max_output_tokens_else_the_model_default(ctx: Any):
    from gateway.admission import estimate

    factor: Decimal = ctx.limits.safety_factor
    capped = estimate(_parse(Endpoint.RESPONSES, {"input": TEN_WORDS, "max_output_tokens": 50}),
                      INFO, ctx, PRICE)
    assert capped.prompt_tokens == responses({"input": TEN_WORDS})
    assert capped.output_cap == 50
    assert capped.amount == hold_for(capped.prompt_tokens, 50, factor)
    default = estimate(_parse(Endpoint.RESPONSES, {"input": TEN_WORDS}), INFO, ctx, PRICE)
    assert default.output_cap == INFO.default_output_tokens


def test_the_messages_output_cap_is_max_tokens_and_thinking_adds_nothing(ctx: Any):
    from gateway.admission import estimate

    body = {"max_tokens": 400, "messages": [{"role": "user", "content": TEN_WORDS}]}
    plain = estimate(_parse(Endpoint.MESSAGES, body), INFO, ctx, PRICE)
    # A model whose maximum output leaves room for the smallest thinking budget (1,024) and an
    # answer: a cap below that would be refused (admission.least_output).
    roomy = dataclasses.replace(INFO, context_window=4_000, max_output_tokens=1_200)
    thinking = estimate(_parse(Endpoint.MESSAGES, {
        **body, "max_tokens": 1424, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        roomy, ctx, PRICE)
    assert plain.prompt_tokens == messages({"messages": body["messages"]})
    assert plain.output_cap == 400
    assert plain.amount == hold_for(plain.prompt_tokens, 400, ctx.limits.safety_factor)
    # max_tokens 1424 with a 1024 budget: the model's maximum output (1200) caps it, nothing
    # more.
    assert thinking.output_cap == roomy.max_output_tokens
    assert thinking.amount == hold_for(thinking.prompt_tokens, roomy.max_output_tokens,
                                       ctx.limits.safety_factor)


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    (Endpoint.RESPONSES, {"input": "word " * 1200}, "input"),
    (Endpoint.MESSAGES, {"max_tokens": 10, "messages": [{"role": "user",
                                                         "content": "word " * 1200}]},
     "messages"),
])
def test_a_prompt_filling_the_context_is_refused_naming_its_field(
        ctx: Any, endpoint: Endpoint, body: dict[str, Any], param: str):
    from gateway.admission import estimate

    with pytest.raises(GatewayError) as caught:
        estimate(_parse(endpoint, body), INFO, ctx, PRICE)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400, param, "context_length_exceeded")


class _CountingPool(ThreadPoolExecutor):
    """The estimation pool, counting the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="test-estimate")
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize(("endpoint", "body"), [
    (Endpoint.RESPONSES, {"input": [{"role": "user", "content": "lorem ipsum " * 20_000}]}),
    (Endpoint.MESSAGES, {"max_tokens": 10,
                         "messages": [{"role": "user", "content": "lorem ipsum " * 20_000}]}),
])
def test_a_large_body_is_counted_off_the_event_loop(
        ctx: Any, monkeypatch: pytest.MonkeyPatch, settings: Any, endpoint: Endpoint,
        body: dict[str, Any]):
    from gateway.admission import estimate, estimated

    settings.GATEWAY_ESTIMATE_THREAD_BYTES = 64 * 1024
    pool = _CountingPool()
    monkeypatch.setattr(tokens, "_pool", pool)
    info = ModelInfo(name="gpt-4o", tokenizer=O200K_BASE, kind="chat", context_window=128_000,
                     default_output_tokens=200, max_output_tokens=500)
    parsed = _parse(endpoint, body)
    try:
        off = asyncio.run(estimated(parsed, info, ctx, PRICE))
    finally:
        pool.shutdown()
    assert pool.jobs == 1
    assert off == estimate(parsed, info, ctx, PRICE)
