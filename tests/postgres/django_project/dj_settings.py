"""Settings of the minimal Django project of the PostgreSQL and MySQL tests (database from the
env: ``DJ_DATABASE_URL``, ``postgresql://`` or ``mysql://``)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_db = urlsplit(os.environ["DJ_DATABASE_URL"])

SECRET_KEY = "tests-only"
USE_TZ = True
INSTALLED_APPS = ["shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/") or "postgres",
        "USER": _db.username or "postgres",
        "PASSWORD": _db.password or "",
        "HOST": _db.hostname or "127.0.0.1",
        "PORT": str(_db.port or 5432),
    }
}
if _db.scheme == "mysql":  # tests/mysql runs the same project on MariaDB / MySQL
    import pymysql

    pymysql.install_as_MySQLdb()  # Django's MySQL engine on PyMySQL (no client headers)
    DATABASES["default"].update(
        ENGINE="django.db.backends.mysql",
        NAME=_db.path.lstrip("/"),
        USER=_db.username or "root",
        PORT=str(_db.port or 3306),
        OPTIONS={"charset": "utf8mb4"},
    )
# Celery reads its settings from here, through the CELERY_ namespace.
CELERY_BROKER_URL = os.environ["DJ_BROKER_URL"]
CELERY_RESULT_BACKEND = os.environ["DJ_BROKER_URL"]
CELERY_IDEMPOTENCY_URL = f"django://default?table={os.environ['DJ_TABLE']}"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = os.environ["DJ_QUEUE"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
