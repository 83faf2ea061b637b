"""The project's settings (the database from the environment here, for the test suite)."""

import os
from urllib.parse import urlsplit

_db = urlsplit(os.environ.get("DJ_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop"))

SECRET_KEY = "tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "celery_idempotent.contrib.django",
    "orders",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/") or "shop",
        "USER": _db.username or "postgres",
        "PASSWORD": _db.password or "",
        "HOST": _db.hostname or "127.0.0.1",
        "PORT": str(_db.port or 5432),
        "TEST": {"NAME": os.environ.get("DJ_TEST_DATABASE", "test_shop")},
    }
}

# --8<-- [start:celery]
CELERY_BROKER_URL = "redis://localhost:6379/0"
CELERY_RESULT_BACKEND = "redis://localhost:6379/1"
# Keys and results in PostgreSQL, in the body's transaction (the app's migrations create
# the table: INSTALLED_APPS above lists celery_idempotent.contrib.django).
CELERY_IDEMPOTENCY_URL = "django://default"
CELERY_IDEMPOTENCY_TTL = 7 * 24 * 3600  # remember results a week
# A killed worker's message comes back, and the guard runs its body once:
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# --8<-- [end:celery]
