"""Run by test_postgres_hygiene.py in a process of its own (Django's settings are global):
bodies on ``django://default`` that end the guard's transaction, each through another door.
Prints one JSON object: for each way, what the guard raised and whether a record was stored.

argv: database URL, table name.
"""

from __future__ import annotations

import json
import sys
from urllib.parse import urlsplit

import django
from django.conf import settings

url, table = sys.argv[1], sys.argv[2]
parts = urlsplit(url)
settings.configure(
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parts.path.lstrip("/") or "postgres",
            "USER": parts.username or "postgres",
            "HOST": parts.hostname or "127.0.0.1",
            "PORT": str(parts.port or 5432),
        }
    },
    USE_TZ=True,
)
django.setup()

from django.db import connection, transaction  # noqa: E402

from celery_idempotent import DistributedIdempotencyGuard  # noqa: E402
from celery_idempotent.backends.postgres import DjangoBackend  # noqa: E402

backend = DjangoBackend("default", table=table)
guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend, retry_base_delay=0.01)


def raw_sql() -> str:
    with connection.cursor() as cur:
        cur.execute("COMMIT; BEGIN")
    return "raw"


def driver_commit() -> str:
    connection.connection.commit()  # the psycopg connection under Django's wrapper
    return "driver"


def django_commit() -> str:
    transaction.commit()  # Django refuses it inside atomic()
    return "django"


def autocommit_on() -> str:
    transaction.set_autocommit(True)  # refused as well
    return "autocommit"


out = {}
for name, body in [
    ("raw_sql", raw_sql),
    ("driver_commit", driver_commit),
    ("django_commit", django_commit),
    ("autocommit_on", autocommit_on),
]:
    try:
        guard.execute(name, body)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    out[name] = {"raised": raised, "stored": backend.get(guard.record_key(name)) is not None}
out["after"] = guard.execute("after", lambda: "fine")
print(json.dumps(out))
