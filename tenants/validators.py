"""Field validators for the JSON columns, whose shape the database does not check."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError


def validate_model_list(value: Any) -> None:
    if not isinstance(value, list):
        raise ValidationError("Must be a list of model names.")
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ValidationError("Every model name must be a non-empty string.")
    if len(set(value)) != len(value):
        raise ValidationError("Model names must not repeat.")


def validate_alert_thresholds(value: Any) -> None:
    if not isinstance(value, list):
        raise ValidationError("Must be a list of percentages of quota remaining.")
    for item in value:
        # bool is an int subclass; True as a threshold is a typo, not 1 percent.
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 99:
            raise ValidationError("Every threshold must be an integer from 1 to 99.")
    if len(set(value)) != len(value):
        raise ValidationError("Thresholds must not repeat.")


def validate_model_limits(value: Any) -> None:
    if not isinstance(value, dict):
        raise ValidationError("Must be an object mapping model names to tokens per day.")
    for model, limit in value.items():
        if not isinstance(model, str) or not model.strip() or any(c.isspace() for c in model):
            raise ValidationError("Model names must be non-empty and contain no whitespace.")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValidationError(f"The limit for {model!r} must be an integer >= 0.")


def validate_time_zone(value: Any) -> None:
    """An IANA time zone name this Python knows (its tz database: DST rules included)."""
    from zoneinfo import available_timezones  # noqa: PLC0415 - read once, only when validating

    if not isinstance(value, str) or value not in _zones(available_timezones):
        raise ValidationError(f"{value!r} is not a time zone name (e.g. Europe/Paris, UTC).")


_ZONES: frozenset[str] | None = None


def _zones(load: Any) -> frozenset[str]:
    global _ZONES
    if _ZONES is None:
        _ZONES = frozenset(load())
    return _ZONES
