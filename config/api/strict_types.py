"""JSON bodies must have the types the schema states.

DRF coerces generously: a CharField takes 42 as "42", an IntegerField takes "42" and 42.0, a
BooleanField takes "true", 1 and "on". The OpenAPI schema says `string`, `integer`, `boolean`, so
a client (or a generated one) reading it and the server would disagree about what is valid. For
a JSON body, StrictJSONTypes refuses a value of another JSON type (or a string longer than the
schema's maxLength before DRF trims its spaces) with a 400 naming the field, before DRF's own
validation. Form and query data (all text) are left to DRF's parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.http import QueryDict
from rest_framework import serializers
from rest_framework.fields import empty

# The JSON types a field takes, by DRF field class (the first match in this order wins).
_EXPECTED: tuple[tuple[type[serializers.Field], tuple[type, ...], str], ...] = (
    (serializers.BooleanField, (bool,), "true or false"),
    (serializers.IntegerField, (int,), "a whole number"),
    (serializers.CharField, (str,), "a string"),
    (serializers.ChoiceField, (str,), "a string"),
    (serializers.DateTimeField, (str,), "a string"),
    (serializers.DateField, (str,), "a string"),
    (serializers.RelatedField, (str,), "a string"),
    (serializers.ListField, (list,), "a list"),
    (serializers.DictField, (dict,), "an object"),
)


def _type_error(field: serializers.Field, value: Any) -> str | list[Any] | dict[str, Any] | None:
    """Why `value` is not of `field`'s JSON type (with the offending items of a list or object),
    or None when it is."""
    if value is None:
        return None if field.allow_null else "May not be null."
    for kind, accepted, what in _EXPECTED:
        if not isinstance(field, kind):
            continue
        # bool is an int in Python, but not a JSON number.
        if not isinstance(value, accepted) or (accepted == (int,) and isinstance(value, bool)):
            return f"Must be {what}."
        # The schema's maxLength is of the value as sent; DRF measures it after trimming spaces.
        max_length = getattr(field, "max_length", None)
        if isinstance(field, serializers.CharField) and max_length and len(value) > max_length:
            return f"At most {max_length} characters."
        if isinstance(field, serializers.ListField):
            items = {str(i): e for i, item in enumerate(value)
                     if (e := _type_error(field.child, item)) is not None}
            return items or None
        if isinstance(field, serializers.DictField):
            items = {str(k): e for k, item in value.items()
                     if (e := _type_error(field.child, item)) is not None}
            return items or None
        return None
    return None


class StrictJSONTypes(serializers.Serializer):
    """Mixed into an input serializer: JSON values of the wrong type are a 400."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping) and not isinstance(data, QueryDict):
            errors = {}
            for name, field in self.fields.items():
                if field.read_only or data.get(name, empty) is empty:
                    continue
                error = _type_error(field, data[name])
                if error is not None:
                    errors[name] = error if isinstance(error, dict) else [error]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)
