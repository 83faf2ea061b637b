"""Worker start on MySQL: no ERROR from a check of another backend, and a MySQL that does not
answer is one ERROR naming it (``check_mysql``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_idempotent.celery import worker_start
from celery_idempotent.celery.worker_start import check_app_at_worker_start
from celery_idempotent.settings import clear_cache
from tests.support.check_apps import app_with_one_task


def make(conf: dict[str, Any]) -> Celery:
    return app_with_one_task("mychk", conf, acks_late=True, reject_on_worker_lost=True)


def start_log(caplog: pytest.LogCaptureFixture, app: Celery) -> tuple[list[Any], list[Any]]:
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_idempotent"):
            errors = check_app_at_worker_start(app)
    finally:
        clear_cache(app)
        app.close()
    logged = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "celery_idempotent"
    ]
    return errors, logged


def test_a_reachable_mysql_starts_clean(caplog: pytest.LogCaptureFixture, mysql_url: str) -> None:
    assert worker_start.check_mysql.backends == {"mysql"}  # type: ignore[attr-defined]
    errors, logged = start_log(caplog, make({"idempotency_url": mysql_url}))
    assert errors == []
    assert [level for level, _ in logged] == ["INFO"], logged


def test_an_unreachable_mysql_is_one_error(caplog: pytest.LogCaptureFixture) -> None:
    errors, _ = start_log(caplog, make({"idempotency_url": "mysql://app:secret@127.0.0.1:1/shop"}))
    assert len(errors) == 1, errors
    assert "the idempotency MySQL at mysql://app:***@127.0.0.1:1/shop is unreachable" in str(
        errors[0]
    )
    assert "secret" not in str(errors[0])
    assert "mychk.charge" in str(errors[0])
