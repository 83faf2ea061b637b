"""Idempotent tasks on pytest-celery setups: worker, broker and Redis in their own containers.

Each test runs on both setups (``celery_broker``: Redis broker, RabbitMQ broker; the Redis
backend holds Celery's results and, in its database 1, the idempotency keys). Executions are
counted from the worker's ``docker logs`` (``worker_tasks.py``), which outlive kills, restarts
and partitions.

The fault tests (``docker_faults``: kill, restart, partitions; about 4 minutes) are deselected
by default: ``pytest -m docker_faults tests/containers`` runs them, as ``.ci/run`` does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tests.containers.conftest import (
    LOCK_TTL,
    assert_never_overlapping,
    body_marks,
    partition,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(240)]

RECORD = "cidem.containers.record"


def _token() -> str:
    return uuid.uuid4().hex[:12]


def _send(setup: Any, token: str, seconds: float = 0.0, *, task_id: str | None = None) -> Any:
    # send_task publishes a plain message, as any producer (or a broker's redelivery) would:
    # the worker side alone has to make the duplicates run once.
    return setup.app.send_task(
        RECORD, args=(token, seconds), task_id=task_id, queue=setup.worker.worker_queue
    )


def _ends(setup: Any, token: str) -> int:
    return sum(1 for mark in body_marks(setup.worker.logs(), token=token) if mark[0] == "end")


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def test_duplicates_and_redeliveries_run_once(celery_setup: Any) -> None:
    token = _token()
    first = _send(celery_setup, token, 1.0)
    # The same message again (a redelivery: same task id) and three duplicates (new ids),
    # while the first body runs and after it ended.
    again = _send(celery_setup, token, 1.0, task_id=first.id)
    duplicates = [_send(celery_setup, token, 1.0) for _ in range(2)]
    values = {result.get(timeout=60) for result in [first, again, *duplicates]}
    late = _send(celery_setup, token, 1.0).get(timeout=60)

    assert len(values) == 1, values
    assert late in values, (values, late)
    assert values.pop().startswith(f"done {token} by ")
    marks = body_marks(celery_setup.worker.logs(), token=token)
    assert [mark[0] for mark in marks] == ["start", "end"], marks

    # Other keys are not held up by this one: a fresh token runs at once.
    other = _token()
    assert _send(celery_setup, other).get(timeout=30).startswith(f"done {other}")
    assert _ends(celery_setup, other) == 1


@pytest.mark.docker_faults
def test_a_killed_worker_s_message_is_redelivered_and_runs_once(celery_setup: Any) -> None:
    token = _token()
    worker = celery_setup.worker
    result = _send(celery_setup, token, 30.0)
    _wait_for(lambda: body_marks(worker.logs(), token=token), 60, "the body to start")
    killed_at = time.time()
    worker.kill()  # docker kill: SIGKILL to the container's main process, pool and all
    assert worker.container.status != "running"
    # The unacked message comes back (RabbitMQ: at once, the connection died; Redis: once the
    # visibility timeout passed); the lease of the killed body expires within lock_ttl.
    worker.restart()  # docker restart: the same container, file system and logs, started again
    _wait_for(lambda: "ready." in worker.logs().split("BODY start")[-1], 60, "the worker again")
    # The redelivery finds the first body's marker file: it ran once already, so it is quick.
    value = result.get(timeout=120)
    assert value.startswith(f"done {token} by ")
    marks = body_marks(worker.logs(), token=token)
    starts = [mark for mark in marks if mark[0] == "start"]
    ends = [mark for mark in marks if mark[0] == "end"]
    assert len(starts) == 2, marks
    assert len(ends) == 1, marks
    # The second run began after the kill, and only once the killed body's lease had run out.
    assert starts[1][3] > killed_at, marks
    # A duplicate now replays the redelivery's result.
    assert _send(celery_setup, token, 30.0).get(timeout=60) == value
    assert _ends(celery_setup, token) == 1
    assert LOCK_TTL < 30.0


@pytest.mark.docker_faults
def test_a_redis_restart_mid_run_never_reruns_a_committed_key(celery_setup: Any) -> None:
    """AOF on, fsync always: what was committed before the restart is still there after it."""
    committed = [_token() for _ in range(4)]
    for result in [_send(celery_setup, token) for token in committed]:
        assert result.get(timeout=60).startswith("done ")
    values = {token: _send(celery_setup, token).get(timeout=60) for token in committed}

    running = [_token() for _ in range(2)]
    in_flight = [_send(celery_setup, token, 3.0) for token in running]
    _wait_for(
        lambda: len(body_marks(celery_setup.worker.logs(), token=running[0])) > 0,
        60,
        "a body to start",
    )
    celery_setup.backend.restart()  # docker restart of the Redis that holds the keys
    assert celery_setup.backend.container.status == "running"

    # Every committed key replays its value after the restart; none ran again.
    for token in committed:
        assert _send(celery_setup, token).get(timeout=120) == values[token]
        assert _ends(celery_setup, token) == 1
    # The bodies that ran across the restart ended (their commit was resent until Redis came
    # back, or refused if their lease had expired meanwhile); a key is never run by two bodies
    # at once, and a duplicate sent afterwards replays or runs it, never alongside another.
    for result in in_flight:
        try:
            result.get(timeout=120, propagate=False)
        except Exception as exc:
            raise AssertionError(f"{result.id}: no outcome after the restart: {exc!r}") from exc
    for token in running:
        after = _send(celery_setup, token, 3.0).get(timeout=120)
        assert after.startswith(f"done {token} by "), after
        marks = body_marks(celery_setup.worker.logs(), token=token)
        assert_never_overlapping(marks)
        assert 1 <= _ends(celery_setup, token) <= 2, marks
        # ... and once it is committed, it replays.
        assert _send(celery_setup, token, 3.0).get(timeout=60) == after
        assert body_marks(celery_setup.worker.logs(), token=token) == marks


@pytest.mark.docker_faults
def test_a_partition_shorter_than_the_lease_keeps_it(celery_setup: Any, store_network: Any) -> None:
    """Cut for about a third of ``lock_ttl``: one renewal may fail, the next one gets through
    (docs/concepts/leases.md: two renewals can fail in a row before the lease runs out)."""
    token = _token()
    first = _send(celery_setup, token, 4.0)
    _wait_for(lambda: body_marks(celery_setup.worker.logs(), token=token), 60, "the body")
    with partition(store_network, celery_setup.worker.container):
        time.sleep(LOCK_TTL / 3)
    duplicate = _send(celery_setup, token, 4.0)
    value = first.get(timeout=60)
    assert value.startswith(f"done {token} by ")
    assert duplicate.get(timeout=60) == value  # waited for the lease, then replayed
    marks = body_marks(celery_setup.worker.logs(), token=token)
    assert [mark[0] for mark in marks] == ["start", "end"], marks


@pytest.mark.docker_faults
def test_a_partition_longer_than_the_lease_loses_it_and_nothing_else(
    celery_setup: Any, store_network: Any
) -> None:
    """Cut for twice ``lock_ttl`` while the body runs: the lease runs out, the body's commit is
    refused (``LockLostError``, as the docs say), the key is free again, and the call is run
    by the next delivery: after the stale body ended, never alongside it; nothing is lost."""
    token = _token()
    first = _send(celery_setup, token, 2.0)
    worker = celery_setup.worker
    _wait_for(lambda: body_marks(worker.logs(), token=token), 60, "the body")
    with partition(store_network, worker.container):
        time.sleep(2 * LOCK_TTL)
        # While cut off, a duplicate arrives; it cannot claim the key until the store is back.
        duplicate = _send(celery_setup, token, 2.0)
    outcome = first.get(timeout=60, propagate=False)
    assert first.state == "FAILURE", (first.state, outcome)
    assert type(outcome).__name__ == "LockLostError", repr(outcome)
    value = duplicate.get(timeout=60)
    assert value.startswith(f"done {token} by ")
    marks = body_marks(worker.logs(), token=token)
    assert [mark[0] for mark in marks] == ["start", "end", "start", "end"], marks
    assert_never_overlapping(marks)
    assert _send(celery_setup, token, 2.0).get(timeout=60) == value
    assert body_marks(worker.logs(), token=token) == marks
