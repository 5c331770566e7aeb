"""Turn the domain errors of tenants.services into DRF errors (400 with field messages)."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework.exceptions import ValidationError


def service_error(exc: DjangoValidationError) -> ValidationError:
    """A service's ValidationError as a DRF 400: per field where the service named one."""
    if hasattr(exc, "error_dict"):
        return ValidationError(exc.message_dict)
    return ValidationError({"non_field_errors": exc.messages})
