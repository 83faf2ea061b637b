"""The Celery app: ``celery -A example_project worker`` finds ``app`` here."""

from __future__ import annotations

from celery import Celery

app = Celery("example_project", include=["example_project.tasks"])
app.config_from_object("example_project.settings")

# Counters of deliveries, replays and contention, kept in Redis for the demo's report.
import example_project.metrics  # noqa: E402, F401
