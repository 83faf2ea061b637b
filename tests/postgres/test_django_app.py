"""celery_idempotent.contrib.django: the migrations create the backend's table, and with the app
installed the django:// backend runs no DDL.

Each test has a database of its own and runs Django in subprocesses (``manage.py`` of
``django_app_project/``), as a user's project runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from celery_idempotent.backends.postgres.sql import ddl

PROJECT = Path(__file__).resolve().parent / "django_app_project"
TABLE = "celery_idempotency"

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def app_db(postgres_url: str) -> Iterator[str]:
    """The URL of a new, empty database (dropped afterwards)."""
    name = f"djapp_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(postgres_url)
    yield urlunsplit(parts._replace(path="/" + name))
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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


CHARGE_TWICE = """
from appproj.celery import charge
first = charge.apply(args=("o-1",)).get()
second = charge.apply(args=("o-1",)).get()
print(first, "|", second)
"""


def relations(db_url: str) -> set[str]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND relname LIKE 'celery_idempotency%%'"
        ).fetchall()
    return {row[0] for row in rows}


def columns(db_url: str, table: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return [
            tuple(row)
            for row in conn.execute(
                "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
                "WHERE table_name = %s ORDER BY ordinal_position",
                (table,),
            ).fetchall()
        ]


def test_without_migrate_no_ddl_runs_and_the_error_names_the_command(app_db: str) -> None:
    done = run(app_db, "-c", CHARGE_TWICE)
    assert done.returncode != 0
    assert "manage.py migrate celery_idempotent" in done.stderr, done.stderr
    assert relations(app_db) == set()  # nothing was created at first use


def test_migrate_creates_the_backends_table_index_and_sequence(app_db: str) -> None:
    manage(app_db, "migrate", "--noinput")
    marker_relations = {f"{TABLE}_markers", f"{TABLE}_markers_pkey", f"{TABLE}_markers_expires_at"}
    assert relations(app_db) == {
        TABLE,
        f"{TABLE}_pkey",
        f"{TABLE}_expires_at",
        f"{TABLE}_fencing",
        *marker_relations,
    }
    # The very table the backend's own DDL creates (compared column by column).
    with psycopg.connect(app_db, autocommit=True) as conn:
        for statement in ddl("reference_table").split(";\n"):
            if statement.strip():
                conn.execute(statement)
    assert columns(app_db, TABLE) == columns(app_db, "reference_table")
    assert columns(app_db, f"{TABLE}_markers") == columns(app_db, "reference_table_markers")
    done = run(app_db, "-c", CHARGE_TWICE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "charged o-1 | charged o-1"
    with psycopg.connect(app_db, autocommit=True) as conn:
        rows = conn.execute(f"SELECT key, state, fencing_token FROM {TABLE}").fetchall()
    assert len(rows) == 1
    assert rows[0][1] == "completed"
    assert rows[0][2] >= 1
    assert "order:o-1" in rows[0][0]
    # The model and the migration agree (a user's makemigrations finds nothing to do).
    manage(app_db, "makemigrations", "celery_idempotent", "--check", "--dry-run")
    # And the migration can be reversed.
    manage(app_db, "migrate", "celery_idempotent", "zero", "--noinput")
    assert relations(app_db) == set()


def test_an_install_migrated_before_the_marker_table_gets_it(app_db: str) -> None:
    """0002 (issue 24) creates the marker table of ``idempotency_publish_until="started"``
    on an install whose 0001 ran before it existed; reversed, it drops only that table."""
    manage(app_db, "migrate", "celery_idempotent", "0001", "--noinput")
    with psycopg.connect(app_db, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{TABLE}_markers"')  # 0001 as it ran before the mode
    assert f"{TABLE}_markers" not in relations(app_db)
    manage(app_db, "migrate", "--noinput")
    assert "[X] 0002_markers" in manage(app_db, "showmigrations", "celery_idempotent")
    assert f"{TABLE}_markers" in relations(app_db)
    manage(app_db, "migrate", "celery_idempotent", "0001", "--noinput")
    assert f"{TABLE}_markers" not in relations(app_db)
    assert TABLE in relations(app_db)


def test_a_table_the_backend_created_at_first_use_is_adopted(app_db: str) -> None:
    from celery_idempotent import PostgresBackend
    from celery_idempotent.core.protocols import IdempotencyRecord

    backend = PostgresBackend(app_db)  # before the app: created at first use
    backend.set("idempotency:{t:key:kept}", IdempotencyRecord("v", None, 1.0), 600)
    backend.close()
    manage(app_db, "migrate", "--noinput")
    assert "[X] 0001_initial" in manage(app_db, "showmigrations", "celery_idempotent")
    with psycopg.connect(app_db, autocommit=True) as conn:
        kept = conn.execute(f"SELECT key FROM {TABLE}").fetchall()
    assert kept == [("idempotency:{t:key:kept}",)]


PUBLISH_32 = """
from django.db import connection, transaction
from appproj.celery import app, charge
from celery_idempotent import DuplicatePublishError

ids = {charge.delay("o-32").id for _ in range(32)}
with app.connection_for_write() as conn:
    waiting = conn.default_channel.queue_declare("celery", passive=True).message_count
print("ids", len(ids), "messages", waiting)
try:
    charge.apply_async(("o-32",), idempotency_on_duplicate_publish="raise")
except DuplicatePublishError as exc:
    print("raised", exc.task_id in ids)
with transaction.atomic():
    with connection.cursor() as cur:
        cur.execute("SET LOCAL lock_timeout = '7s'")
    charge.delay("o-33")
    with connection.cursor() as cur:
        cur.execute("SHOW lock_timeout")
        print("lock_timeout", cur.fetchone()[0])
"""


def test_django_stops_duplicates_at_publish(app_db: str) -> None:
    # Issue 25: on django:// all 32 duplicate messages were published.
    manage(app_db, "migrate", "--noinput")
    done = run(app_db, "-c", PUBLISH_32)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines == ["ids 1 messages 1", "raised True", "lock_timeout 7s"], done.stdout
    with psycopg.connect(app_db, autocommit=True) as conn:
        rows = conn.execute(f"SELECT key, state FROM {TABLE} ORDER BY key").fetchall()
    assert [state for _, state in rows] == ["queued", "queued"]
