"""The app's configuration (``INSTALLED_APPS = [..., "celery_idempotent.contrib.django"]``)."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryIdempotentConfig(AppConfig):
    """The idempotency table's migrations and admin; label ``celery_idempotent``."""

    name = "celery_idempotent.contrib.django"
    label = "celery_idempotent"
    verbose_name = "Celery idempotency"
