"""A Django project as the recipe sets it up: the app installed, ``django://default``."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_db = urlsplit(os.environ["DJ_DATABASE_URL"])

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_idempotent.contrib.django",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "appproj.urls"
STATIC_URL = "/static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
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
CELERY_BROKER_URL = "memory://"
CELERY_IDEMPOTENCY_URL = "django://default"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
