"""The Celery app and its beat schedule (in code, so every deployment runs the same jobs).

    celery -A config worker --beat -l info        # one process: worker and scheduler (make up)
    celery -A config worker -l info               # production: workers ...
    celery -A config beat -l info                 # ... and exactly one scheduler

Every task is idempotent and safe when two workers run it at once (see each task).
"""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["quotas", "billing"])
