from django.urls import path

from billing import views

urlpatterns = [
    path("metrics", views.metrics_view, name="metrics"),
]
