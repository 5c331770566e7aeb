from django.urls import path

from gateway import views

urlpatterns = [
    path("v1/chat/completions", views.ChatCompletionsView.as_view()),
    path("v1/completions", views.CompletionsView.as_view()),
    path("v1/embeddings", views.EmbeddingsView.as_view()),
    path("v1/models", views.ModelsView.as_view()),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
]
