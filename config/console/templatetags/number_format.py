"""Number formatting for the console pages (no django.contrib.humanize here)."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def thousands(value: object) -> str:
    """1234567 -> "1,234,567"; anything not an integer is shown as it is."""
    try:
        return f"{int(value):,}"  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return "" if value is None else str(value)
