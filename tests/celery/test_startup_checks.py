"""The misconfiguration checks: misspelt setting names, deliveries a killed worker loses, each
check only on the backends it applies to, an unknown django:// alias and an unreachable backend
(ERRORs at worker start), and the same setting and delivery checks at a process's first publish.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_idempotent.celery import checks
from celery_idempotent.celery.worker_start import check_app_at_worker_start
from celery_idempotent.settings import clear_cache
from tests.support.check_apps import app_with_one_task


def make(
    conf: dict[str, Any] | None = None, namespace: str | None = None, **task_opts: Any
) -> Celery:
    return app_with_one_task("chk", conf, namespace, **task_opts)


def ours(app: Celery) -> None:
    clear_cache(app)
    app.close()


def log_of(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "celery_idempotent"]


@pytest.mark.parametrize(
    ("conf", "namespace", "wrong", "right"),
    [
        ({"idempotent_url": "redis://x"}, None, "idempotent_url", "idempotency_url"),
        ({"idempotency_tll": 5}, None, "idempotency_tll", "idempotency_ttl"),
        (
            {"CELERY_IDEMPOTENT_URL": "redis://x"},
            "CELERY",
            "CELERY_IDEMPOTENT_URL",
            "CELERY_IDEMPOTENCY_URL",
        ),
        (
            {"CELERY_IDEMPOTENCY_TLL": 5},
            "CELERY",
            "CELERY_IDEMPOTENCY_TLL",
            "CELERY_IDEMPOTENCY_TTL",
        ),
        ({"IDEMPOTENCY_TTL": 5}, "CELERY", "IDEMPOTENCY_TTL", "CELERY_IDEMPOTENCY_TTL"),
        ({"idempotncy_lock_ttl": 5}, None, "idempotncy_lock_ttl", "idempotency_lock_ttl"),
    ],
)
def test_a_misspelt_setting_is_an_error_naming_the_closest_real_one(
    caplog: pytest.LogCaptureFixture,
    conf: dict[str, Any],
    namespace: str | None,
    wrong: str,
    right: str,
) -> None:
    app = make(
        {"idempotency_url": "memory://", **conf}
        if namespace is None
        else {f"{namespace}_IDEMPOTENCY_URL": "memory://", **conf},
        namespace,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    try:
        with caplog.at_level(logging.INFO, logger="celery_idempotent"):
            errors = check_app_at_worker_start(app)
    finally:
        ours(app)
    mine = [e for e in errors if wrong in e]
    assert len(mine) == 1, errors
    assert f"did you mean {right}?" in mine[0] or f"spelled {right}" in mine[0]
    assert ("ERROR", f"celery-idempotent: {mine[0]}") in log_of(caplog)


def test_correct_names_raise_nothing(caplog: pytest.LogCaptureFixture) -> None:
    conf = {
        "CELERY_IDEMPOTENCY_URL": "memory://",
        "CELERY_IDEMPOTENCY_TTL": 60,
        "CELERY_TASK_ACKS_LATE": True,
        "CELERY_TASK_REJECT_ON_WORKER_LOST": True,
    }
    app = make(conf, "CELERY")
    try:
        with caplog.at_level(logging.INFO, logger="celery_idempotent"):
            errors = check_app_at_worker_start(app)
    finally:
        ours(app)
    assert errors == []
    assert [level for level, _ in log_of(caplog)] == ["INFO"]


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        ({}, "acknowledges their message before the body runs"),
        ({"acks_late": True}, "has acks_late without task_reject_on_worker_lost"),
    ],
)
def test_a_delivery_a_killed_worker_loses_is_a_warning_naming_the_task(
    caplog: pytest.LogCaptureFixture, opts: dict[str, Any], expected: str
) -> None:
    app = make({"idempotency_url": "memory://"}, **opts)
    try:
        with caplog.at_level(logging.INFO, logger="celery_idempotent"):
            check_app_at_worker_start(app)
    finally:
        ours(app)
    warnings = [m for level, m in log_of(caplog) if level == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "task chk.charge " in warnings[0]
    assert expected in warnings[0]
    assert "task_acks_late = True and task_reject_on_worker_lost = True" in warnings[0]


def test_an_unreachable_backend_is_an_error_at_start(caplog: pytest.LogCaptureFixture) -> None:
    for url, says in (
        (
            "postgresql://postgres@127.0.0.1:1/none",
            "the idempotency PostgreSQL at postgresql://postgres@127.0.0.1:1/none is unreachable",
        ),
        ("redis://127.0.0.1:1/0", "the idempotency Redis at redis://127.0.0.1:1/0 is unreachable"),
    ):
        caplog.clear()
        app = make({"idempotency_url": url}, acks_late=True, reject_on_worker_lost=True)
        try:
            with caplog.at_level(logging.INFO, logger="celery_idempotent"):
                errors = check_app_at_worker_start(app)
        finally:
            ours(app)
        assert len(errors) == 1, errors
        assert says in errors[0]
        assert ("ERROR", f"celery-idempotent: {errors[0]}") in log_of(caplog)
        assert not any(r.exc_info for r in caplog.records)  # one line, no traceback


def test_the_first_publish_of_a_process_reports_settings_and_deliveries_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make({"idempotency_url": "memory://", "idempotency_tll": 5})
    try:
        with caplog.at_level(logging.INFO, logger="celery_idempotent"):
            app.tasks["chk.charge"].delay(1)
            app.tasks["chk.charge"].delay(2)
    finally:
        ours(app)
    found = log_of(caplog)
    errors = [m for level, m in found if level == "ERROR"]
    warnings = [m for level, m in found if level == "WARNING"]
    assert len(errors) == 1, found
    assert "idempotency_tll" in errors[0]
    assert "did you mean idempotency_ttl?" in errors[0]
    assert len(warnings) == 1, found
    assert "task chk.charge acknowledges their message" in warnings[0]


def test_the_closest_name_is_found_for_common_slips() -> None:
    assert checks._closest("idempotent_url") == "idempotency_url"
    assert checks._closest("idempotency_tll") == "idempotency_ttl"
    assert checks._closest("idempotence_key_prefix") == "idempotency_key_prefix"
    assert checks._closest("idempotency_zzzzzzzzzzz") is None
