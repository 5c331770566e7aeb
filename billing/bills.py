"""Upstream bills: what the provider says we used, per UTC day, upstream key id and model.

Every adapter is a `BillSource`: `fetch(start, end)` returns the `BillLine`s of the UTC days in
[start, end). Reconciliation (billing/reconciliation.py) compares them with the ledger.

* `OpenAIUsageAPI(base_url, admin_key)`: OpenAI's organization usage API,
  `GET {base_url}/organization/usage/{completions,embeddings}?start_time=&end_time=
  &bucket_width=1d&group_by=api_key_id&group_by=model&limit=31[&api_key_ids=..][&page=..]`,
  following `has_more` / `next_page`. It needs an organization *admin* key, not a project key.
  The usage API gives tokens and requests but no cost (OpenAI's costs API cannot be grouped by
  API key), so `cost_micros` is None.
* `MockBill(base_url)`: the same API as served by gateway.mock_upstream (its `/v1` URL).
* `CsvBill(path_or_file)`: a CSV file with a header row naming at least the columns
  `day,api_key_id,model,input_tokens,output_tokens,requests` and optionally `cost_usd` and the
  token classes `input_cached_tokens,input_cache_write_tokens,output_reasoning_tokens`
  (other columns are ignored). `day` is YYYY-MM-DD (UTC); token and request counts are
  non-negative integers; `cost_usd` is a non-negative decimal number of US dollars (e.g.
  `0.012345`), converted to integer micro-dollars with Decimal (no floats), rounded half up
  below the micro-dollar; an empty `cost_usd` means "no cost given". A malformed line raises
  `BillFormatError` naming the file and the line number.

Token classes: `input_tokens` and `output_tokens` are totals; a line also says how much of them
the upstream priced apart when the bill reports it: `input_cached_tokens` (OpenAI's own field
name: prompt-cache reads), `input_cache_write_tokens` and `output_reasoning_tokens` (the mock's
extension, for Anthropic's cache writes and reasoning). A class the bill does not report (field
absent or null, CSV column absent or cell empty) is None on the line: reconciliation compares
only the classes a bill reports (OpenAI's usage API has no reasoning figure), and prices an
unreported class as 0 tokens (at its total's price).
"""
from __future__ import annotations

import csv
import io
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

from gateway.usage import Usage

MICROS_PER_USD = Decimal(1_000_000)
CSV_REQUIRED_COLUMNS = ("day", "api_key_id", "model", "input_tokens", "output_tokens", "requests")
# The bill's name of each token class (BillLine's field): the usage API's result fields and the
# CSV's optional columns.
CLASS_FIELDS = {"input_cached_tokens": "cached_input_tokens",
                "input_cache_write_tokens": "cache_write_tokens",
                "output_reasoning_tokens": "reasoning_tokens"}
CSV_COLUMNS = (*CSV_REQUIRED_COLUMNS, "cost_usd", *CLASS_FIELDS)
# OpenAI's maximum page size for daily buckets; the mock accepts 1..31 as well.
DAYS_PER_PAGE = 31
MAX_PAGES = 10_000


class BillError(Exception):
    """The bill could not be read (HTTP error, unexpected response, malformed file)."""


class BillFormatError(BillError):
    """A malformed CSV line (the message names the file and the line)."""


@dataclass(frozen=True)
class BillLine:
    day: date
    upstream_key_id: str
    model: str
    input_tokens: int
    output_tokens: int
    requests: int
    cost_micros: int | None = None
    # Parts of the totals (see the module docstring); None: the bill does not report the class.
    cached_input_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None

    def usage(self) -> Usage:
        """The line's usage by class (an unreported class as 0; classes larger than their
        totals are clamped into them, as for an upstream's figures)."""
        return Usage.of(self.input_tokens, self.output_tokens,
                        cached=self.cached_input_tokens or 0,
                        cache_write=self.cache_write_tokens or 0,
                        reasoning=self.reasoning_tokens or 0)


class BillSource(Protocol):
    """An upstream bill. `kind` is a ReconciliationRun.Source value."""

    kind: str
    # Whether the bill names keys as gateway.mock_upstream.api_key_id(secret) does, so that
    # reconciliation may derive the aliases of provider keys from their secrets.
    derives_key_ids: bool

    def describe(self) -> str:
        """Where the bill comes from, for the run's record (never a secret)."""
        ...

    def fetch(self, start: date, end: date, *,
              api_key_ids: Collection[str] | None = None) -> list[BillLine]:
        """The lines of the UTC days in [start, end). `api_key_ids`, if not None, says only
        those keys matter (a source may still return others); empty: no line is wanted."""
        ...


def _unix(day: date) -> int:
    return int(datetime.combine(day, time(), tzinfo=UTC).timestamp())


def _count(value: Any, what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BillError(f"unexpected {what} in the usage response: {value!r}")
    return value


def _classes(result: dict[str, Any]) -> dict[str, int | None]:
    """A usage result's token classes: None for a field it does not have (or null)."""
    return {name: None if result.get(field) is None else _count(result.get(field), field)
            for field, name in CLASS_FIELDS.items()}


class OpenAIUsageAPI:
    """OpenAI's organization usage API (completions and embeddings), by API key, model, day."""

    kind = "openai_api"
    derives_key_ids = False
    ENDPOINTS = ("completions", "embeddings")

    def __init__(self, base_url: str, admin_key: str, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not admin_key:
            raise BillError("the usage API needs an admin key")
        self.base_url = base_url.strip().rstrip("/")
        self._admin_key = admin_key
        self._timeout = timeout
        self._transport = transport

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def describe(self) -> str:
        return f"{self.base_url}/organization/usage"

    def fetch(self, start: date, end: date, *,
              api_key_ids: Collection[str] | None = None) -> list[BillLine]:
        if end <= start or (api_key_ids is not None and not api_key_ids):
            return []  # (an empty api_key_ids filter would mean "every key" to the API)
        lines: list[BillLine] = []
        headers = {"Authorization": f"Bearer {self._admin_key}"}
        with httpx.Client(timeout=self._timeout, headers=headers,
                          transport=self._transport) as client:
            for endpoint in self.ENDPOINTS:
                lines.extend(self._fetch_endpoint(client, endpoint, start, end, api_key_ids))
        return lines

    def _fetch_endpoint(self, client: httpx.Client, endpoint: str, start: date, end: date,
                        api_key_ids: Collection[str] | None) -> Iterable[BillLine]:
        url = f"{self.base_url}/organization/usage/{endpoint}"
        params: list[tuple[str, str | int]] = [
            ("start_time", _unix(start)), ("end_time", _unix(end)), ("bucket_width", "1d"),
            ("group_by", "api_key_id"), ("group_by", "model"), ("limit", DAYS_PER_PAGE)]
        params.extend(("api_key_ids", key_id) for key_id in sorted(api_key_ids or ()))
        page: str | None = None
        seen: set[str] = set()
        for _ in range(MAX_PAGES):
            try:
                response = client.get(url, params=params + ([("page", page)] if page else []))
            except httpx.HTTPError as exc:
                raise BillError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
            if response.status_code != 200:
                raise BillError(f"GET {url} answered {response.status_code}: "
                                f"{response.text[:300]}")
            try:
                body = response.json()
                buckets = body["data"]
                has_more = bool(body.get("has_more"))
                next_page = body.get("next_page")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise BillError(f"GET {url}: not a usage page: {response.text[:300]}") from exc
            yield from self._lines(buckets, start, end)
            if not has_more:
                return
            if not isinstance(next_page, str) or not next_page or next_page in seen:
                raise BillError(f"GET {url}: has_more without a new next_page ({next_page!r})")
            seen.add(next_page)
            page = next_page
        raise BillError(f"GET {url}: more than {MAX_PAGES} pages")

    @staticmethod
    def _lines(buckets: Any, start: date, end: date) -> Iterable[BillLine]:
        if not isinstance(buckets, list):
            raise BillError(f"unexpected usage data: {buckets!r:.200}")
        for bucket in buckets:
            try:
                day = datetime.fromtimestamp(int(bucket["start_time"]), UTC).date()
                results = bucket["results"]
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise BillError(f"unexpected usage bucket: {bucket!r:.200}") from exc
            if not start <= day < end:
                continue
            for result in results:
                if not isinstance(result, dict):
                    raise BillError(f"unexpected usage result: {result!r:.200}")
                yield BillLine(
                    day=day,
                    upstream_key_id=str(result.get("api_key_id") or ""),
                    model=str(result.get("model") or ""),
                    input_tokens=_count(result.get("input_tokens"), "input_tokens"),
                    output_tokens=_count(result.get("output_tokens"), "output_tokens"),
                    requests=_count(result.get("num_model_requests"), "num_model_requests"),
                    cost_micros=None,
                    **_classes(result),
                )


class MockBill(OpenAIUsageAPI):
    """The mock upstream's bill endpoint (same shape as OpenAI's); `base_url` is its /v1 URL.
    The mock accepts any bearer key; it names keys gateway.mock_upstream.api_key_id(secret)."""

    kind = "mock"
    derives_key_ids = True

    def __init__(self, base_url: str, admin_key: str = "reconciliation", **options: Any) -> None:
        super().__init__(base_url, admin_key, **options)


def usd_to_micros(text: str) -> int:
    """'0.012345' -> 12345 micro-dollars, exactly (Decimal), rounded half up below 1e-6."""
    try:
        amount = Decimal(text.strip())
    except InvalidOperation:
        raise ValueError(f"not a decimal number: {text!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"not a non-negative amount: {text!r}")
    return int((amount * MICROS_PER_USD).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _non_negative_int(text: str | None, column: str) -> int:
    value = (text or "").strip()
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"{column} must be a non-negative integer, got {text!r}")
    return int(value)


class CsvBill:
    """A bill imported from CSV (columns in the module docstring). The file is read once, on
    the first fetch; lines outside [start, end) are skipped."""

    kind = "csv"
    derives_key_ids = True

    def __init__(self, path_or_file: str | Path | IO[str] | IO[bytes], *,
                 name: str | None = None) -> None:
        self._source = path_or_file
        if isinstance(path_or_file, (str, Path)):
            self.name = name or str(path_or_file)
        else:
            self.name = name or str(getattr(path_or_file, "name", "") or "<csv>")
        self._lines: list[BillLine] | None = None

    def __repr__(self) -> str:
        return f"CsvBill({self.name!r})"

    def describe(self) -> str:
        return self.name

    def fetch(self, start: date, end: date, *,
              api_key_ids: Collection[str] | None = None) -> list[BillLine]:
        if self._lines is None:
            self._lines = self._read()
        return [line for line in self._lines if start <= line.day < end
                and (api_key_ids is None or line.upstream_key_id in api_key_ids)]

    def _read(self) -> list[BillLine]:
        source = self._source
        if isinstance(source, (str, Path)):
            try:
                with open(source, encoding="utf-8-sig", newline="") as handle:
                    return self.parse(handle)
            except OSError as exc:
                raise BillError(f"{self.name}: cannot read: {exc.strerror or exc}") from exc
        text = source.read()
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig")
        return self.parse(io.StringIO(text.removeprefix("\ufeff"), newline=""))

    def parse(self, handle: IO[str]) -> list[BillLine]:
        reader = csv.reader(handle)
        try:
            header = [column.strip().lower() for column in next(reader)]
        except StopIteration:
            raise BillFormatError(f"{self.name}, line 1: empty file (expected a header row "
                                  f"{','.join(CSV_COLUMNS)})") from None
        except csv.Error as exc:
            raise BillFormatError(f"{self.name}, line {reader.line_num}: {exc}") from exc
        missing = [column for column in CSV_REQUIRED_COLUMNS if column not in header]
        if missing:
            raise BillFormatError(f"{self.name}, line 1: missing column(s) {', '.join(missing)} "
                                  f"(expected {','.join(CSV_COLUMNS)})")
        index = {column: header.index(column) for column in CSV_COLUMNS if column in header}
        lines: list[BillLine] = []
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return lines
            except csv.Error as exc:
                raise BillFormatError(f"{self.name}, line {reader.line_num}: {exc}") from exc
            if not any(cell.strip() for cell in cells):
                continue  # blank line
            if len(cells) != len(header):
                raise BillFormatError(f"{self.name}, line {reader.line_num}: {len(cells)} fields,"
                                      f" the header has {len(header)}")
            try:
                lines.append(self._line(cells, index))
            except ValueError as exc:
                raise BillFormatError(f"{self.name}, line {reader.line_num}: {exc}") from exc

    @staticmethod
    def _line(cells: list[str], index: dict[str, int]) -> BillLine:
        def cell(column: str) -> str:
            return cells[index[column]].strip()

        try:
            if len(cell("day")) != len("YYYY-MM-DD"):
                raise ValueError
            day = date.fromisoformat(cell("day"))
        except ValueError:
            raise ValueError(f"day must be YYYY-MM-DD, got {cell('day')!r}") from None
        model = cell("model")
        if not model:
            raise ValueError("model is empty")
        cost = cell("cost_usd") if "cost_usd" in index else ""
        classes = {name: _non_negative_int(cell(column), column)
                   if column in index and cell(column) else None
                   for column, name in CLASS_FIELDS.items()}
        return BillLine(
            day=day,
            upstream_key_id=cell("api_key_id"),
            model=model,
            input_tokens=_non_negative_int(cell("input_tokens"), "input_tokens"),
            output_tokens=_non_negative_int(cell("output_tokens"), "output_tokens"),
            requests=_non_negative_int(cell("requests"), "requests"),
            cost_micros=usd_to_micros(cost) if cost else None,
            **classes,
        )
