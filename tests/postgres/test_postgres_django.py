"""The minimal Django project's worker tests (``tests/support/sql_django.py``) on PostgreSQL:
``django.db.backends.postgresql`` (psycopg 3); other engines are refused, naming the engine."""

from __future__ import annotations

import pytest

from tests.support.sql_django import (  # noqa: F401 - collected here against PostgreSQL
    django_setup,
    test_a_body_that_raises_leaves_neither_rows_nor_record,
    test_another_engine_is_refused_with_the_engine_named,
    test_orm_writes_commit_with_the_record_and_a_kill_leaves_no_partial_rows,
)

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]
