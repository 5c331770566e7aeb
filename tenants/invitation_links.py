"""The one rule for an invitation's accept link, wherever it is issued (console, API, CLI)."""

from __future__ import annotations

from django.conf import settings
from django.urls import reverse


def invitation_link(base_url: str, secret: str) -> str:
    """The accept link under `base_url` (scheme://host of the console). In production it is
    always https: the link carries the invitation's secret, and the console is served over TLS
    there (Secure cookies, HSTS), even when a TLS proxy in front does not say so to Django
    (no SECURE_PROXY_SSL_HEADER) and the request looks like plain http."""
    scheme, separator, rest = base_url.partition("://")
    if settings.TOLLGATE_ENV == "production" and separator and scheme != "https":
        base_url = "https://" + rest
    return base_url.rstrip("/") + reverse("console-invite-accept", args=[secret])
