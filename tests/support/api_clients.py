"""Management API clients."""
from __future__ import annotations

from rest_framework.test import APIClient


def bearer(plaintext: str) -> APIClient:
    """An API client that sends a management token (its plaintext) as a bearer token."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client
