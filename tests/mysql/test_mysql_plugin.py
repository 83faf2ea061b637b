"""The testing plugin (``celery_idempotent.testing``) with ``idempotency_backend = "mysql"``:
its helpers deliver a task twice against the MySQL backend and see the body run once."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_idempotent import IdempotentTask, LockAcquisitionError


@pytest.fixture
def idempotency_backend() -> str:
    return "mysql"


@pytest.fixture
def idempotency_mysql_url(mysql_url: str, my_table: str) -> str:
    return f"{mysql_url}{'&' if '?' in mysql_url else '?'}table={my_table}"


def test_the_plugins_helpers_on_mysql(celery_app: Any, idempotency: Any) -> None:
    name = uuid.uuid4().hex[:8]

    @celery_app.task(name=f"plug.{name}.double", base=IdempotentTask, shared=False)
    def double(x: int) -> int:
        return x * 2

    @celery_app.task(
        name=f"plug.{name}.impatient",
        base=IdempotentTask,
        idempotency_on_locked="raise",
        idempotency_retry_count=0,
        shared=False,
    )
    def impatient(x: int) -> int:
        return x

    assert idempotency.backend_url.startswith("mysql://")
    twice = idempotency.redeliver(double, (21,))
    assert (twice.results, twice.executions) == ((42, 42), 1)
    stored = idempotency.stored(double, (21,))
    assert stored is not None
    assert stored.result == 42
    assert stored.fencing_token is not None
    # A duplicate while the body runs: it waits on the row lock and replays.
    assert idempotency.deliver_twice(double, (5,), while_running=True).executions == 1
    with pytest.raises(LockAcquisitionError):
        idempotency.redeliver(impatient, (1,), while_running=True)
    assert not idempotency.is_locked(impatient, (1,))
