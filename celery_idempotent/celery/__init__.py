"""The Celery adapter: IdempotentTask and what it delegates to."""
