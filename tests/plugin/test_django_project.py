"""The testing plugin with pytest-django: the sample Django project (``django_project/``) runs
its own tests in a pytest process of its own, as its user would, on PostgreSQL.

Its tests cover ``while_running=True`` under ``db`` (the delivery threads use the test's own
connection, so they see its uncommitted rows) and ``transactional_db``, and
``idempotency_backend = "postgres"`` (Django's test database through ``django://default``,
with the app's migrations), including the clear error under ``db`` with ``while_running``.
Afterwards no test database is left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent / "django_project"

pytest.importorskip("pytest_django", reason="pip install pytest-django")

pytestmark = [pytest.mark.postgres]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    given = os.environ.get("POSTGRES_URL")
    if given:
        yield given
        return
    from celery_idempotent.servers.postgres_server import PostgresServer

    with PostgresServer() as server:
        yield server.url


def databases(url: str, name: str) -> list[str]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname = %s", (name,))
        return [row[0] for row in rows.fetchall()]


def test_the_django_project_passes_and_leaves_no_database(postgres_url: str) -> None:
    test_db = f"test_djproject_{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(DJ_DATABASE_URL=postgres_url, DJ_TEST_DATABASE=test_db)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-rA"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = run.stdout + run.stderr
    try:
        assert run.returncode == 0, out
        summary = out.strip().splitlines()[-1]
        assert re.search(r"\b5 passed\b", summary), summary
        assert not re.search(r"skipped|error|failed|warning", summary), summary
        for name in (
            "test_a_redelivery_while_the_charge_runs_under_db",
            "test_a_redelivery_while_the_charge_runs_under_transactional_db",
            "test_on_the_postgres_backend_under_db[postgres]",
            "test_on_the_postgres_backend_while_running[postgres]",
            "test_on_the_postgres_backend_while_running_needs_transactional_db[postgres]",
        ):
            assert f"PASSED tests/test_orders.py::{name}" in out, name
        assert databases(postgres_url, test_db) == []  # pytest-django could drop it
    finally:
        import psycopg

        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{test_db}" WITH (FORCE)')
