"""A small shop: the sample project whose tests use celery-idempotent's pytest plugin."""
