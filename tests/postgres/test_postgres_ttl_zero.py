"""``idempotency_ttl=0`` on PostgreSQL (issue 24): the commit proves the row lock and keeps
nothing the next claim or publish would see, so the key runs again once the body ended, and
never twice at the same time; ``idempotency_publish_until="started"`` is taken (its marker
table: ``test_postgres_started.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_idempotent import DistributedIdempotencyGuard, PostgresBackend
from celery_idempotent.core.protocols import IdempotencyRecord

REC = "idempotency:{pub.job:key:j-1}"
LOCK = "idempotency:lock:{pub.job:key:j-1}"


def make_guard(backend: PostgresBackend, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def test_ttl_zero_runs_again_once_the_body_ended(pg_backend: PostgresBackend) -> None:
    guard = make_guard(pg_backend, ttl=0)
    calls: list[int] = []
    first = guard.run("k", lambda: calls.append(1) or len(calls))
    second = guard.run("k", lambda: calls.append(1) or len(calls))
    assert (first.value, first.replayed, second.value, second.replayed) == (1, False, 2, False)
    assert second.fencing_token > first.fencing_token
    assert pg_backend.get(guard.record_key("k")) is None


def test_ttl_zero_never_runs_twice_at_the_same_time(pg_backend: PostgresBackend) -> None:
    pg_backend.lock_timeout = 5.0
    guard = make_guard(pg_backend, ttl=0, retry_count=0)
    running = threading.Event()
    spans: list[tuple[float, float]] = []

    def slow() -> str:
        start = time.monotonic()
        running.set()
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        return "first"

    def quick() -> str:
        spans.append((time.monotonic(), time.monotonic()))
        return "second"

    holder = threading.Thread(target=lambda: guard.run("k", slow))
    holder.start()
    assert running.wait(5)
    duplicate = guard.run("k", quick)  # waits on the row lock, then runs: nothing kept
    holder.join()
    assert (duplicate.value, duplicate.replayed) == ("second", False)
    (_, first_end), (second_start, _) = sorted(spans)
    assert first_end <= second_start


def test_ttl_zero_frees_the_publish_side(pg_backend: PostgresBackend) -> None:
    first = pg_backend.check_publish(REC, LOCK, "t-1", "fp", 60)
    assert first.action == "publish"
    assert pg_backend.check_publish(REC, LOCK, "t-2", "fp", 60).action == "queued"
    claim = pg_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    record = IdempotencyRecord("v", "fp", time.time(), claim.lease.fencing_token, "t-1")
    assert pg_backend.commit(claim.lease, REC, record, 0)
    again = pg_backend.check_publish(REC, LOCK, "t-3", "fp", 60)
    assert (again.action, again.unchecked) == ("publish", False)  # free: marked and published


def test_publish_until_started_through_apply_async_on_postgres(
    postgres_url: str, pg_table: str
) -> None:
    """``idempotency_publish_until="started"`` is taken on PostgreSQL (issue 24; it was
    refused before the marker table): a queued call stops a publish, with its state and
    time left; the real-worker tests are ``test_postgres_started_workers.py``."""
    from celery import Celery

    from celery_idempotent import DuplicatePublishError, IdempotentTask
    from celery_idempotent.celery.task import reset_backends

    app = Celery("pgstarted", broker="memory://", set_as_current=False)
    app.conf.idempotency_url = f"{postgres_url}?table={pg_table}"

    @app.task(base=IdempotentTask, shared=False, idempotency_publish_until="started")
    def job(x: int) -> int:
        return x

    reset_backends()
    try:
        first = job.apply_async((1,))
        assert job.apply_async((1,)).id == first.id
        with pytest.raises(DuplicatePublishError) as caught:
            job.apply_async((1,), idempotency_on_duplicate_publish="raise")
        assert (caught.value.task_id, caught.value.state) == (first.id, "queued")
        assert caught.value.ttl_left is not None
        assert caught.value.ttl_left > 3000  # the default publish TTL, an hour
    finally:
        reset_backends()
        app.close()


def test_duplicate_publish_error_on_postgres(postgres_url: str, pg_table: str) -> None:
    """``DuplicatePublishError.state`` / ``.ttl_left`` through the PostgreSQL publish side:
    ``"queued"``, and the marker's time left."""
    from celery import Celery

    from celery_idempotent import DuplicatePublishError, IdempotentTask
    from celery_idempotent.celery.task import reset_backends

    app = Celery("pgdup", broker="memory://", set_as_current=False)
    app.conf.idempotency_url = f"{postgres_url}?table={pg_table}"

    @app.task(base=IdempotentTask, shared=False, idempotency_on_duplicate_publish="raise")
    def job(x: int) -> int:
        return x

    reset_backends()
    try:
        first = job.apply_async((1,))
        with pytest.raises(DuplicatePublishError) as caught:
            job.apply_async((1,))
        assert (caught.value.task_id, caught.value.state) == (first.id, "queued")
        assert caught.value.ttl_left is not None
        assert 3590 < caught.value.ttl_left <= 3600
    finally:
        reset_backends()
        app.close()
