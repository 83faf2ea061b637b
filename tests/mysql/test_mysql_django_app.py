"""celery_idempotent.contrib.django on MySQL / MariaDB: the migration creates the backend's two
tables (its own DDL), the django:// backend runs no DDL while the app is installed, a table
made at first use is adopted, and the admin page lists keys and forgets them.

Each test has a database of its own (``<database>_<hex>``: ``.ci/run`` grants its user that
pattern) and runs Django in subprocesses (``tests/postgres/django_app_project``'s
``manage.py``, whose settings switch to Django's MySQL engine for a ``mysql://`` URL).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from mysql_support import query

from celery_idempotent.backends.mysql.sql import ddl

PROJECT = Path(__file__).resolve().parents[1] / "postgres" / "django_app_project"
TABLE = "celery_idempotency"


@pytest.fixture
def app_db(mysql_url: str) -> Iterator[str]:
    """The URL of a new, empty database (dropped afterwards)."""
    parts = urlsplit(mysql_url)
    name = f"{parts.path.lstrip('/')}_{uuid.uuid4().hex[:10]}"
    query(mysql_url, f"CREATE DATABASE `{name}`")
    yield urlunsplit(parts._replace(path="/" + name, query=""))
    query(mysql_url, f"DROP DATABASE IF EXISTS `{name}`")


def run(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJ_DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "appproj.settings"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def manage(db_url: str, *args: str) -> str:
    done = run(db_url, "manage.py", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def tables(db_url: str) -> set[str]:
    return {row[0] for row in query(db_url, "SHOW TABLES LIKE 'celery_idempotency%%'")}


def columns(db_url: str, table: str) -> list[tuple[str, ...]]:
    return [
        tuple(str(v) for v in row)
        for row in query(
            db_url,
            "SELECT column_name, column_type, is_nullable, column_key, collation_name "
            "FROM information_schema.columns WHERE table_schema = DATABASE() "
            "AND table_name = %s ORDER BY ordinal_position",
            table,
        )
    ]


CHARGE_TWICE = """
from appproj.celery import charge
first = charge.apply(args=("o-1",)).get()
second = charge.apply(args=("o-1",)).get()
print(first, "|", second)
"""


def test_without_migrate_no_ddl_runs_and_the_error_names_the_command(app_db: str) -> None:
    done = run(app_db, "-c", CHARGE_TWICE)
    assert done.returncode != 0
    assert "manage.py migrate celery_idempotent" in done.stderr, done.stderr
    assert tables(app_db) == set()  # nothing was created at first use


def test_migrate_creates_the_backends_tables(app_db: str) -> None:
    manage(app_db, "migrate", "--noinput")
    assert tables(app_db) == {TABLE, f"{TABLE}_fencing", f"{TABLE}_markers"}
    # The very tables the backend's own DDL creates (compared column by column).
    for statement in ddl("reference_table").split(";\n"):
        if statement.strip():
            query(app_db, statement)
    assert columns(app_db, TABLE) == columns(app_db, "reference_table")
    assert columns(app_db, f"{TABLE}_fencing") == columns(app_db, "reference_table_fencing")
    assert columns(app_db, f"{TABLE}_markers") == columns(app_db, "reference_table_markers")
    indexes = {row[2] for row in query(app_db, f"SHOW INDEX FROM `{TABLE}`")}
    assert indexes == {"PRIMARY", f"{TABLE}_expires_at"}
    done = run(app_db, "-c", CHARGE_TWICE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "charged o-1 | charged o-1"
    rows = query(app_db, f"SELECT `key`, state, fencing_token FROM `{TABLE}`")
    assert len(rows) == 1
    assert rows[0][1] == "completed"
    assert rows[0][2] >= 1
    assert "order:o-1" in rows[0][0]
    # The model and the migration agree (a user's makemigrations finds nothing to do).
    manage(app_db, "makemigrations", "celery_idempotent", "--check", "--dry-run")
    # And the migration can be reversed.
    manage(app_db, "migrate", "celery_idempotent", "zero", "--noinput")
    assert tables(app_db) == {
        "reference_table",
        "reference_table_fencing",
        "reference_table_markers",
    } & tables(app_db)


def test_an_install_migrated_before_the_marker_table_gets_it(app_db: str) -> None:
    """0002 (issue 24) creates the marker table on an install whose 0001 ran before it
    existed; reversed, it drops only that table."""
    manage(app_db, "migrate", "celery_idempotent", "0001", "--noinput")
    query(app_db, f"DROP TABLE `{TABLE}_markers`")  # 0001 as it ran before the mode
    manage(app_db, "migrate", "--noinput")
    assert "[X] 0002_markers" in manage(app_db, "showmigrations", "celery_idempotent")
    assert f"{TABLE}_markers" in tables(app_db)
    manage(app_db, "migrate", "celery_idempotent", "0001", "--noinput")
    assert tables(app_db) == {TABLE, f"{TABLE}_fencing"}


def test_a_table_the_backend_created_at_first_use_is_adopted(app_db: str) -> None:
    from celery_idempotent import MySQLBackend
    from celery_idempotent.core.protocols import IdempotencyRecord

    backend = MySQLBackend(app_db)  # before the app: created at first use
    backend.set("idempotency:{t:key:kept}", IdempotencyRecord("v", None, 1.0), 600)
    backend.close()
    manage(app_db, "migrate", "--noinput")
    assert "[X] 0001_initial" in manage(app_db, "showmigrations", "celery_idempotent")
    assert query(app_db, f"SELECT `key` FROM `{TABLE}`") == [("idempotency:{t:key:kept}",)]


ADMIN = """
import threading
from django.contrib.auth.models import User
from django.test import Client
from appproj.celery import charge
from celery_idempotent.backends import sql_backend_from_url
from celery_idempotent.contrib.django.models import IdempotencyKey

charge.apply(args=("o-1",)).get()
charge.apply(args=("o-2",)).get()
keys = sorted(IdempotencyKey.objects.values_list("pk", flat=True))
User.objects.create_superuser("admin", "a@example.com", "pw")
client = Client(HTTP_HOST="localhost")
assert client.login(username="admin", password="pw")
url = "/admin/celery_idempotent/idempotencykey/"
page = client.get(url)
text = page.content.decode()
print("list", page.status_code, text.count("order:o-1") > 0, text.count("order:o-2") > 0,
      "running" in text)

# A delivery holds o-1's row (its lock, in a transaction of another thread): the page shows
# it running, and "forget" keeps it.
backend = sql_backend_from_url("django://default")
print("backend", type(backend).__name__)
held, leave = threading.Event(), threading.Event()
def hold():
    lease = backend.acquire(keys[0].replace("{", "lock:{", 1), 30)
    held.set()
    leave.wait(30)
    backend.release(lease)
holder = threading.Thread(target=hold)
holder.start()
held.wait(30)
page = client.get(url)
print("held", page.content.decode().count("running"))
done = client.post(url, {"action": "forget", "_selected_action": keys, "post": "yes"},
                   follow=True)
shown = done.content.decode()
print("forget", done.status_code, "Forgot 1 key(s)." in shown,
      "Kept 1 key(s) that a running delivery holds" in shown)
leave.set()
holder.join()
print("left", sorted(IdempotencyKey.objects.values_list("pk", flat=True)) == keys[:1])
"""


def test_the_admin_lists_keys_and_forgets_all_but_a_running_one(app_db: str) -> None:
    manage(app_db, "migrate", "--noinput")
    done = run(app_db, "-c", "import django; django.setup()\n" + ADMIN)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "list 200 True True False", lines
    assert lines[1] == "backend DjangoMySQLBackend", lines
    assert lines[2] == "held 1", lines
    assert lines[3] == "forget 200 True True", lines
    assert lines[4] == "left True", lines
