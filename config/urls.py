"""Every route of the project, composed here: the gateway's /v1 and health checks, /metrics, the
management API (config/api/urls.py) with its schema and docs, the console
(config/console/urls.py) and Django admin."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from config.metrics_view import metrics_view

urlpatterns = [
    path("", include("gateway.urls")),
    path("metrics", metrics_view, name="metrics"),
    path("api/", include("config.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("console/", include("config.console.urls")),
    path("", RedirectView.as_view(url="/console/", permanent=False)),
    path("admin/", admin.site.urls),
]
