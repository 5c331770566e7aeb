from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("", include("gateway.urls")),
    path("", include("billing.urls")),
    path("api/", include("tenants.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("console/", include("config.console.urls")),
    path("", RedirectView.as_view(url="/console/", permanent=False)),
    path("admin/", admin.site.urls),
]
