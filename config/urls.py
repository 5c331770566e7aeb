from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("gateway.urls")),
    path("", include("billing.urls")),
    path("admin/", admin.site.urls),
]
