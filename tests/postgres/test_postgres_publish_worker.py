"""Duplicates stopped at publish on PostgreSQL, with a real worker and a Redis broker whose
queue the test counts: the same decisions and marker life as on Redis."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.result import AsyncResult, EagerResult

from celery_idempotent import DuplicatePublishError, IdempotencyMismatchError
from celery_idempotent.celery.task import reset_backends
from tests.support.workers import CeleryWorker

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(redis_url: str, postgres_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:8]
    table = f"pgp_{session}"
    values = {
        "PGP_BROKER_URL": redis_url,
        "PGP_QUEUE": f"pgp-{session}",
        "PGP_IDEMPOTENCY_URL": f"{postgres_url}?table={table}",
    }
    yield values
    from tests.postgres.conftest import drop_table

    drop_table(postgres_url, table)


@pytest.fixture(scope="module")
def pgp(env: dict[str, str]) -> Iterator[ModuleType]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    sys.modules.pop("pg_publish_app", None)
    try:
        import pg_publish_app

        reset_backends()
        yield pg_publish_app
    finally:
        reset_backends()
        sys.modules["pg_publish_app"].app.close()
        sys.path.remove(str(HERE))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def queued(env: dict[str, str]) -> int:
    client = redis.Redis.from_url(env["PGP_BROKER_URL"])
    try:
        return int(client.llen(env["PGP_QUEUE"]))
    finally:
        client.close()


def runs(env: dict[str, str], *parts: str) -> int:
    client = redis.Redis.from_url(env["PGP_BROKER_URL"])
    try:
        return int(client.get(f"{env['PGP_QUEUE']}:runs:" + ":".join(parts)) or 0)
    finally:
        client.close()


def test_publish_side_on_postgres_with_a_real_worker(env: dict[str, str], pgp: Any) -> None:
    order = uuid.uuid4().hex[:8]
    results = [pgp.charge.delay(order, 5) for _ in range(10)]
    assert queued(env) == 1  # ten publishes, one message (no worker yet)
    assert len({r.id for r in results}) == 1
    assert all(isinstance(r, AsyncResult) for r in results)
    with pytest.raises(IdempotencyMismatchError):
        pgp.charge.delay(order, 99)  # queued under another payload
    with pytest.raises(DuplicatePublishError) as caught:
        pgp.charge.apply_async((order, 5), idempotency_on_duplicate_publish="raise")
    assert (caught.value.task_id, caught.value.state) == (results[0].id, "queued")
    assert caught.value.ttl_left is not None
    assert caught.value.ttl_left > 0
    worker = CeleryWorker(
        "pg_publish_app", pool="prefork", queues=[env["PGP_QUEUE"]], env=env, pythonpath=[HERE]
    )
    worker.start()
    try:
        value = results[0].get(timeout=60)
        assert value == {"order": order, "amount": 5, "run": 1}
        assert runs(env, "charge", order) == 1
        again = pgp.charge.delay(order, 5)  # completed: answered at publish
        assert isinstance(again, EagerResult)
        assert again.get(timeout=0) == value
        assert queued(env) == 0
        with pytest.raises(IdempotencyMismatchError):
            pgp.charge.delay(order, 99)  # completed under another payload

        tag = uuid.uuid4().hex[:8]
        first = pgp.fails.delay(tag)
        with pytest.raises(ValueError, match="failed"):
            first.get(timeout=60)
        second = pgp.fails.delay(tag)  # the failure ended the marker: published again
        assert second.id != first.id
        with pytest.raises(ValueError, match="failed"):
            second.get(timeout=60)
        assert runs(env, "fails", tag) == 2
    finally:
        worker.stop()
