"""Integrations with frameworks (``celery_idempotent.contrib.django``)."""
