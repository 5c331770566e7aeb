"""The Prometheus /metrics endpoint: billing.metrics renders the figures, this view guards them
with TOLLGATE_METRICS_TOKEN. Routed in config/urls.py."""
from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from billing import metrics


def _authorized(request: HttpRequest) -> bool:
    token = getattr(settings, "TOLLGATE_METRICS_TOKEN", "") or ""
    if not token:
        return False  # unset: /metrics is closed
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format; needs `Authorization: Bearer <TOLLGATE_METRICS_TOKEN>`."""
    if not _authorized(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(metrics.render(), content_type=metrics.CONTENT_TYPE)
