"""Worker start on PostgreSQL and Django: no false ERROR from a Redis-only check, and the start
log of a misconfigured Django project (a real worker): one line per problem."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_idempotent.celery import worker_start
from celery_idempotent.celery.worker_start import check_app_at_worker_start
from celery_idempotent.settings import clear_cache
from tests.support.check_apps import app_with_one_task

PROJECT = Path(__file__).resolve().parent / "django_app_project"


def make(conf: dict[str, Any], **task_opts: Any) -> Celery:
    return app_with_one_task("pgchk", conf, **task_opts)


def log_of(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "celery_idempotent"]


def test_each_check_runs_only_on_the_backends_it_applies_to(
    caplog: pytest.LogCaptureFixture, postgres_url: str
) -> None:
    # Issue 25: the eviction check handed the PostgreSQL URL to redis.Redis.from_url.
    assert worker_start.check_eviction.backends == {"redis"}  # type: ignore[attr-defined]
    assert worker_start.check_postgres.backends == {"postgres"}  # type: ignore[attr-defined]
    app = make({"idempotency_url": postgres_url}, acks_late=True, reject_on_worker_lost=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_idempotent"):
            errors = check_app_at_worker_start(app)
    finally:
        clear_cache(app)
        app.close()
    assert errors == []
    assert [level for level, _ in log_of(caplog)] == ["INFO"], log_of(caplog)
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.worker
def test_the_start_log_of_a_misconfigured_django_project_has_one_line_per_problem(
    postgres_url: str,
) -> None:
    env = {
        **os.environ,
        "DJ_DATABASE_URL": postgres_url,
        "DJANGO_SETTINGS_MODULE": "appproj.misconfigured",
        "PYTHONPATH": str(PROJECT),
    }
    cmd = [sys.executable, "-m", "celery", "-A", "appproj.celery", "worker", "-P", "solo"]
    cmd += [
        "-l",
        "INFO",
        "--without-mingle",
        "--without-gossip",
        "-n",
        f"mis-{uuid.uuid4().hex[:6]}@%h",
    ]
    proc = subprocess.Popen(
        cmd, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    deadline = time.monotonic() + 90
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if " ready." in line or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ours = [line for line in lines if "celery-idempotent:" in line]
    print("\n".join(ours))  # the evidence the issue asks for (pytest -s shows it)
    assert any(" ready." in line for line in lines), "\n".join(lines)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    problems = [line for line in ours if "ERROR" in line or "WARNING" in line]
    expected = [
        ("ERROR", "setting CELERY_IDEMPOTENCY_TLL", "did you mean CELERY_IDEMPOTENCY_TTL?"),
        ("ERROR", "setting CELERY_IDEMPOTENT_URL", "did you mean CELERY_IDEMPOTENCY_URL?"),
        ("WARNING", "acks_late without task_reject_on_worker_lost", "appproj.celery.charge"),
        ("ERROR", "django://replica: no database alias 'replica'", "its aliases: default"),
    ]
    assert len(problems) == len(expected), "\n".join(ours)
    for line, (level, what, detail) in zip(problems, expected):
        assert level in line, line
        assert what in line, line
        assert detail in line, line
