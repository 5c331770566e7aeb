"""Numbered pages for the console's listings (keys, projects): a bounded page size, a total
order from the selector, and bad input answered plainly rather than guessed at.

Django's Paginator.get_page() turns "?page=abc" into page 1 and "?page=999" into the last page:
a person following an old link then reads a page other than the one asked for without being
told. Here a page that is not a whole number from 1 is a 400 with a message (and no rows), and
a page past the end is an empty page that says how many there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from django.db.models import QuerySet
from django.http import QueryDict

PAGE_SIZES: Final = (25, 50, 100)
DEFAULT_PAGE_SIZE: Final = 50
# More digits than any real page number; keeps int() and OFFSET small.
_MAX_PAGE_DIGITS: Final = 7


@dataclass(frozen=True)
class NumberedPage:
    rows: list[Any]
    number: int
    count: int  # rows over every page
    size: int
    error: str = ""  # why the page number was refused (the answer is then a 400)
    note: str = ""  # why the page is empty though there are rows

    @property
    def num_pages(self) -> int:
        return max(1, -(-self.count // self.size))

    @property
    def has_previous(self) -> bool:
        return 1 < self.number <= self.num_pages + 1

    @property
    def previous_number(self) -> int:
        return min(self.number - 1, self.num_pages)

    @property
    def has_next(self) -> bool:
        return self.number < self.num_pages

    @property
    def first_index(self) -> int:
        return (self.number - 1) * self.size + 1 if self.rows else 0

    @property
    def last_index(self) -> int:
        return self.first_index + len(self.rows) - 1 if self.rows else 0


def page_number(raw: str | None) -> int | None:
    """The page asked for (1 when absent), or None when it is not a whole number from 1."""
    if raw is None or raw == "":
        return 1
    if not (raw.isascii() and raw.isdigit()) or len(raw) > _MAX_PAGE_DIGITS or int(raw) < 1:
        return None
    return int(raw)


def numbered_page(items: QuerySet[Any], raw_page: str | None, size: int) -> NumberedPage:
    """One page of `items` (already in a total order): one COUNT and one slice of `size`."""
    number = page_number(raw_page)
    if number is None:
        return NumberedPage([], 1, 0, size,
                            error="The page must be a whole number from 1.")
    count = items.count()
    start = (number - 1) * size
    if count and start >= count:
        pages = -(-count // size)
        return NumberedPage([], number, count, size,
                            note=f"Page {number} is past the last page ({pages}).")
    rows = list(items[start:start + size]) if count else []
    return NumberedPage(rows, number, count, size)


def query_without_page(query: QueryDict) -> str:
    """The listing's query string (its filters) without `page`, to build page links on."""
    kept = query.copy()
    kept.pop("page", None)
    return kept.urlencode()
