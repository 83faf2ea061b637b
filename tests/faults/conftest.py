"""Fixtures and the figures summary of the fault suite (``tests/faults``).

The suite runs with plain ``pytest`` (it is under ``testpaths``); run it alone with
``.venv/bin/python -m pytest tests/faults -v``. Each fault test records its figures (deliveries,
kills, restarts, double executions...) with :func:`tests.faults.faultlib.record_figures`; they
are printed at the end of the run and, when ``CELERY_IDEMPOTENT_FAULT_FIGURES`` names a file,
written there as JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from tests.faults.faultlib import FIGURES

FIGURES_ENV = "CELERY_IDEMPOTENT_FAULT_FIGURES"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("celery-idempotent fault suite: figures")
    for name, figures in FIGURES.items():
        text = ", ".join(f"{k}={v}" for k, v in figures.items())
        terminalreporter.write_line(f"{name}: {text}")
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(FIGURES, fh, indent=2, sort_keys=True)


@pytest.fixture
def short_client_options() -> dict[str, Any]:
    """Client options for a Redis behind a fault: fail in well under a lease, not in 5 s."""
    return {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}


@pytest.fixture
def guard(redis_client: redis.Redis, key_prefix: str) -> DistributedIdempotencyGuard:
    """A guard on the test Redis that tries once (no retries): a fault shows at once."""
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client),
        lock_provider=RedisLockProvider(redis_client),
        key_prefix=key_prefix,
        retry_count=0,
    )
