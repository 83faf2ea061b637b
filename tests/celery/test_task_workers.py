"""IdempotentTask in real workers: two ``celery worker`` processes, prefork with three
children each, on a Redis broker and result backend (the shared set of this module).

Every test works under its own ``tag`` (the first argument), so that keys and side-effect
counters never meet; bodies count their runs in Redis (``INCR``) from whatever process runs
them.
"""

from __future__ import annotations

import json
import time
import uuid
from types import ModuleType
from typing import Any

import pytest
from celery import chain, chord

from celery_idempotent import (
    IdempotencyError,
    IdempotencyMismatchError,
    IdempotencyRecord,
    LockAcquisitionError,
    LockLostError,
    RecordDecodeError,
    RedisIdempotencyStore,
)
from celery_idempotent.backends.redis.keyspace import decode_record
from tests.celery.cidem_helpers import (
    count,
    key_of,
    redis_names,
    settled,
    signal_count,
    signal_data,
)
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis]

TIMEOUT = 30


# --------------------------------------------------------------------------- 1. duplicates


def test_same_arguments_under_ten_task_ids_run_once(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    results = [cidem.work.apply_async((tag, 7, 0.3)) for _ in range(10)]
    values = [r.get(timeout=TIMEOUT) for r in results]

    assert len({r.id for r in results}) == 10
    assert count(cidem, "work", tag) == 1
    assert values == [values[0]] * 10
    assert values[0]["x"] == 7
    key = key_of(cidem.work, tag, 7, 0.3)
    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "replayed", key) == 9


def test_one_task_id_published_ten_times_runs_once(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task_id = str(uuid.uuid4())
    results = [cidem.work_by_id.apply_async((tag, 7, 0.3), task_id=task_id) for _ in range(10)]
    key = f"{cidem.work_by_id.name}:id:{task_id}"
    wait_for(lambda: settled(cidem, key, 10), TIMEOUT, what="10 deliveries settled")
    values = [r.get(timeout=TIMEOUT) for r in results]

    assert count(cidem, "work_by_id", tag) == 1
    assert values == [values[0]] * 10
    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "replayed", key) == 9
    # another task id with the same arguments is another key: it runs
    other = cidem.work_by_id.apply_async((tag, 7, 0.0)).get(timeout=TIMEOUT)
    assert other["token"] != values[0]["token"]
    assert count(cidem, "work_by_id", tag) == 2


# --------------------------------------------------------------------------- 3. self.retry()


def test_retry_inside_an_idempotent_task_commits_once_and_is_not_blocked(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    started = time.monotonic()
    value = cidem.flaky.apply_async((tag, 2)).get(timeout=TIMEOUT)
    elapsed = time.monotonic() - started

    assert value["attempts"] == 3
    assert value["retries"] == 2
    assert count(cidem, "flaky", tag) == 3
    key = key_of(cidem.flaky, tag, 2)
    wait_for(lambda: signal_count(cidem, "committed", key) == 1, what="commit")
    # the lock was released before each retry was published: no attempt ever found it held,
    # and the retries ran promptly, not after lock_ttl (10 s)
    assert signal_count(cidem, "contended", key) == 0
    assert elapsed < 5
    times = [float(t) for t in cidem.client().lrange(cidem.ckey("flaky-times", tag), 0, -1)]
    assert max(b - a for a, b in zip(times, times[1:])) < 3
    # the key is committed: a duplicate replays, the body does not run again
    assert cidem.flaky.apply_async((tag, 2)).get(timeout=TIMEOUT) == value
    assert count(cidem, "flaky", tag) == 3
    assert signal_count(cidem, "committed", key) == 1


def test_autoretry_for_commits_once_and_keeps_the_bound_argument_key(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    """``autoretry_for`` wraps ``run``; the key still comes from the task's own signature."""
    started = time.monotonic()
    value = cidem.auto.apply_async((tag, 1)).get(timeout=TIMEOUT)

    assert time.monotonic() - started < 5
    assert value["attempts"] == 2
    assert value["retries"] == 1
    assert cidem.auto.apply_async(kwargs={"tag": tag, "x": 1}).get(timeout=TIMEOUT) == value
    assert cidem.auto.apply_async((tag, 1, 1)).get(timeout=TIMEOUT) == value
    assert count(cidem, "auto", tag) == 2
    key = key_of(cidem.auto, tag, 1)
    assert signal_count(cidem, "contended", key) == 0
    assert signal_count(cidem, "committed", key) == 1


# --------------------------------------------------------------------------- 4. on_locked


def _start_long(cidem: ModuleType, task: Any, tag: str, duration: float) -> Any:
    first = task.apply_async((tag, duration))
    name = task.name.rsplit(".", 1)[1]
    wait_for(lambda: count(cidem, name, tag) == 1, TIMEOUT, what=f"{name} started")
    return first


@pytest.mark.slow
def test_on_locked_retry_outlasts_max_retries_and_gets_the_stored_result(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.long_retry
    assert task.max_retries == 1
    first = _start_long(cidem, task, tag, 3.0)
    duplicate = task.apply_async((tag, 3.0))

    value = duplicate.get(timeout=TIMEOUT)

    assert value == first.get(timeout=TIMEOUT)
    assert count(cidem, "long_retry", tag) == 1
    key = key_of(task, tag, 3.0)
    # it was re-queued more often than max_retries allows Task.retry()
    assert signal_count(cidem, "contended", key) > task.max_retries + 1
    # re-queued with a growing countdown, not in a hot loop
    assert signal_count(cidem, "contended", key) < 20
    assert duplicate.state == "SUCCESS"


def test_on_locked_raise_fails_the_duplicate_with_lock_acquisition_error(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.long_raise
    first = _start_long(cidem, task, tag, 2.0)
    duplicate = task.apply_async((tag, 2.0))

    with pytest.raises(LockAcquisitionError) as caught:
        duplicate.get(timeout=TIMEOUT)

    key = key_of(task, tag, 2.0)
    assert type(caught.value) is LockAcquisitionError
    assert caught.value.key == key
    assert caught.value.attempts == 1  # idempotency_retry_count=0
    assert duplicate.state == "FAILURE"
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert count(cidem, "long_raise", tag) == 1


def test_on_locked_ignore_ignores_the_duplicate(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.long_ignore
    first = _start_long(cidem, task, tag, 1.5)
    duplicate = task.apply_async((tag, 1.5))
    key = key_of(task, tag, 1.5)
    wait_for(lambda: signal_count(cidem, "contended", key) == 1, TIMEOUT, what="contention")

    first.get(timeout=TIMEOUT)
    time.sleep(0.5)

    assert duplicate.state == "PENDING"  # Ignore: no state is stored, nothing is re-queued
    assert count(cidem, "long_ignore", tag) == 1
    assert signal_count(cidem, "contended", key) == 1


# --------------------------------------------------------------------------- 5. canvas


def test_chain_of_idempotent_steps_replays_into_the_next_step(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    add = cidem.add

    def flow(second: int) -> Any:
        return chain(add.s(1, 2, tag=tag), add.s(second, tag=tag)).apply_async()

    first = flow(10)
    assert first.get(timeout=TIMEOUT) == 13
    again = flow(10)
    assert again.get(timeout=TIMEOUT) == 13
    assert again.parent.get(timeout=TIMEOUT) == 3
    # a replayed first step feeds a new second step
    assert flow(20).get(timeout=TIMEOUT) == 23

    assert count(cidem, "add", tag, 1, 2) == 1
    assert count(cidem, "add", tag, 3, 10) == 1
    assert count(cidem, "add", tag, 3, 20) == 1
    assert signal_count(cidem, "replayed", key_of(add, 1, 2, tag)) == 2


def test_chord_over_idempotent_parts_with_duplicates_completes(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    add, total = cidem.add, cidem.total

    def run() -> Any:
        parts = [add.s(1, 1, tag=tag), add.s(1, 1, tag=tag), add.s(2, 2, tag=tag)]
        parts.append(add.s(1, 1, tag=tag))
        return chord(parts)(total.s(tag=tag))

    assert run().get(timeout=TIMEOUT) == 10
    assert run().get(timeout=TIMEOUT) == 10

    assert count(cidem, "add", tag, 1, 1) == 1
    assert count(cidem, "add", tag, 2, 2) == 1
    assert count(cidem, "total", tag) == 1


@pytest.mark.slow
def test_chord_whose_duplicate_parts_are_requeued_on_contention_completes(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    """Parts that find the key held are re-queued (Retry with a new message of the same id);
    the chord still counts each part once and calls back with the replayed values."""
    parts = [cidem.long_retry.s(tag, 1.5) for _ in range(3)]
    result = chord(parts)(cidem.collect.s(tag=tag))

    tokens = result.get(timeout=TIMEOUT)

    assert len(tokens) == 3
    assert len(set(tokens)) == 1
    assert count(cidem, "long_retry", tag) == 1
    assert count(cidem, "collect", tag) == 1
    assert signal_count(cidem, "contended", key_of(cidem.long_retry, tag, 1.5)) >= 2


def test_direct_recursive_call_in_a_worker_runs_plainly(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    result = cidem.fact.apply_async((tag, 4))
    assert result.get(timeout=TIMEOUT) == 24
    assert count(cidem, "fact", tag) == 4
    key = f"{cidem.fact.name}:id:{result.id}"
    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "contended", key) == 0


# --------------------------------------------------------------------------- 6. explicit keys


def test_explicit_key_reused_with_other_arguments_is_refused(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    explicit = f"payment-{tag}"
    headers = {"idempotency_key": explicit}
    first = cidem.charge.apply_async((tag, 1, 10), headers=headers).get(timeout=TIMEOUT)
    assert cidem.charge.apply_async((tag, 1, 10), headers=headers).get(timeout=TIMEOUT) == first

    refused = cidem.charge.apply_async((tag, 1, 20), headers=headers)
    with pytest.raises(IdempotencyMismatchError) as caught:
        refused.get(timeout=TIMEOUT)

    error = caught.value
    assert type(error) is IdempotencyMismatchError
    assert isinstance(error, IdempotencyError)
    assert error.key == f"{cidem.charge.name}:key:{explicit}"
    assert error.stored_fingerprint
    assert error.fingerprint
    assert error.stored_fingerprint != error.fingerprint
    assert refused.state == "FAILURE"
    assert count(cidem, "charge", tag) == 1


def test_explicit_keys_are_namespaced_by_task_name(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    headers = {"idempotency_key": f"order-{tag}"}
    charged = cidem.charge.apply_async((tag, 1, 10), headers=headers).get(timeout=TIMEOUT)
    refunded = cidem.refund.apply_async((tag, 1, 10), headers=headers).get(timeout=TIMEOUT)

    assert charged["charged"] == 10
    assert refunded["refunded"] == 10
    assert count(cidem, "charge", tag) == 1
    assert count(cidem, "refund", tag) == 1


def test_explicit_key_survives_a_requeue_on_contention(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    """A duplicate re-queued because the key is held keeps its explicit key (and headers)."""
    headers = {"idempotency_key": f"slow-{tag}"}
    first = cidem.long_retry.apply_async((tag, 1.5), headers=headers)
    wait_for(lambda: count(cidem, "long_retry", tag) == 1, TIMEOUT, what="first started")
    duplicate = cidem.long_retry.apply_async((tag, 1.5), headers=headers)

    assert duplicate.get(timeout=TIMEOUT) == first.get(timeout=TIMEOUT)
    assert count(cidem, "long_retry", tag) == 1
    key = f"{cidem.long_retry.name}:key:slow-{tag}"
    assert signal_count(cidem, "contended", key) >= 1
    assert signal_count(cidem, "replayed", key) == 1


def test_requeue_keeps_custom_headers_and_drops_dead_letter_headers(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    """A re-queued duplicate carries the caller's headers on (the explicit key first), counts
    its re-queues, and drops RabbitMQ's x-death headers as Celery's own retry does (RabbitMQ
    would take the re-published message for a dead-letter cycle)."""
    explicit = f"held-{tag}"
    first = cidem.held.apply_async((tag, 1.0, True), headers={"idempotency_key": explicit})
    wait_for(lambda: count(cidem, "held", tag) == 1, TIMEOUT, what="first started")
    headers = {
        "idempotency_key": explicit,
        "tenant": "acme",
        "x-death": [{"count": 1, "queue": "q", "reason": "rejected"}],
        "x-first-death-queue": "q",
    }
    duplicate = cidem.held.apply_async((tag, 0.0, False), headers=headers)

    assert duplicate.get(timeout=TIMEOUT) == 2  # ran once the failed first run let go
    with pytest.raises(RuntimeError):
        first.get(timeout=TIMEOUT)
    ran_with = json.loads(cidem.client().get(cidem.ckey("held-headers", tag, 2)))
    assert ran_with["idempotency_key"] == explicit
    assert ran_with["tenant"] == "acme"
    assert ran_with["idempotency_requeues"] >= 1
    assert "x-death" not in ran_with
    assert "x-first-death-queue" not in ran_with


def test_retry_keeps_the_explicit_key(cidem: ModuleType, workers: WorkerGroup, tag: str) -> None:
    headers = {"idempotency_key": f"flaky-{tag}"}
    value = cidem.flaky.apply_async((tag, 1), headers=headers).get(timeout=TIMEOUT)
    assert value["attempts"] == 2
    # committed under the explicit key (the retry kept it): the same key replays
    again = cidem.flaky.apply_async((tag, 1), headers=headers).get(timeout=TIMEOUT)
    assert again == value
    assert count(cidem, "flaky", tag) == 2
    assert signal_count(cidem, "committed", f"{cidem.flaky.name}:key:flaky-{tag}") == 1


# --------------------------------------------------------------------------- 7. fingerprint


def test_bound_arguments_with_defaults_are_one_key(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.with_defaults
    calls = [
        task.apply_async((tag, 1)),
        task.apply_async(kwargs={"tag": tag, "x": 1}),
        task.apply_async((tag, 1, 5)),
        task.apply_async((tag,), {"x": 1, "y": 5}),
    ]
    values = [r.get(timeout=TIMEOUT) for r in calls]

    assert values == [values[0]] * 4
    assert values[0]["sum"] == 6
    assert count(cidem, "with_defaults", tag) == 1
    other = task.apply_async((tag, 1, 6)).get(timeout=TIMEOUT)
    assert other["sum"] == 7
    assert count(cidem, "with_defaults", tag) == 2


# --------------------------------------------------------------------------- 9. serialization


def test_replay_delivers_what_the_first_execution_delivered(
    cidem: ModuleType, workers: WorkerGroup, tag: str, redis_client: Any
) -> None:
    task = cidem.pair
    first = task.apply_async((tag, 1, {"a": (2, 3)})).get(timeout=TIMEOUT)
    replay = task.apply_async((tag, 1, {"a": (2, 3)})).get(timeout=TIMEOUT)

    assert first == [1, {"a": [2, 3]}]  # JSON: tuples arrive as lists
    assert replay == first
    assert count(cidem, "pair", tag) == 1
    _, record = redis_names(task, key_of(task, tag, 1, {"a": (2, 3)}))
    stored = decode_record(redis_client.get(record), record)
    assert stored.serializer == "json"
    assert stored.data == b'[1, {"a": [2, 3]}]'


def test_a_planted_pickle_record_is_refused_as_a_task_failure(
    cidem: ModuleType, workers: WorkerGroup, tag: str, redis_client: Any
) -> None:
    task = cidem.pair
    key = key_of(task, tag, "x", "y")
    _, record = redis_names(task, key)
    planter = RedisIdempotencyStore(redis_client, serializer="pickle", accept=["pickle"])
    planter.set(
        record,
        IdempotencyRecord(result=("planted",), fingerprint=None, created_at=time.time()),
        ttl=60,
    )

    result = task.apply_async((tag, "x", "y"))
    with pytest.raises(RecordDecodeError) as caught:
        result.get(timeout=TIMEOUT)

    assert caught.value.content_type == "application/x-python-serialize"
    assert caught.value.key == key
    assert result.state == "FAILURE"
    assert count(cidem, "pair", tag) == 0


# --------------------------------------------------------------------------- 10. signals


def test_committed_and_replayed_signals_fire_once_per_event(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.work
    key = key_of(task, tag, "s", 0.0)
    first = task.apply_async((tag, "s", 0.0))
    first.get(timeout=TIMEOUT)
    second = task.apply_async((tag, "s", 0.0))
    second.get(timeout=TIMEOUT)
    wait_for(lambda: settled(cidem, key, 2), what="both deliveries settled")
    time.sleep(0.3)  # nothing fires late

    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "replayed", key) == 1
    assert signal_count(cidem, "contended", key) == 0
    assert signal_count(cidem, "lease_lost", key) == 0
    (committed,) = signal_data(cidem, "committed", key)
    (replayed,) = signal_data(cidem, "replayed", key)
    for data, result in ((committed, first), (replayed, second)):
        assert data["sender"] == task.name
        assert data["task_id"] == result.id
        assert data["key"] == key
        assert isinstance(data["elapsed"], float)
        assert data["elapsed"] >= 0
        assert data["pid"] in workers.child_pids()
    assert committed["fencing_token"] == replayed["fencing_token"]
    assert isinstance(committed["fencing_token"], int)


def test_contended_signal_fires_once_per_failed_attempt(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    task = cidem.contend  # on_locked="raise", idempotency_retry_count=2: three attempts
    first = _start_long(cidem, task, tag, 2.0)
    duplicate = task.apply_async((tag, 2.0))
    with pytest.raises(LockAcquisitionError) as caught:
        duplicate.get(timeout=TIMEOUT)
    first.get(timeout=TIMEOUT)

    key = key_of(task, tag, 2.0)
    assert caught.value.attempts == 3
    assert signal_count(cidem, "contended", key) == 3
    data = signal_data(cidem, "contended", key)
    assert [d["attempt"] for d in data] == [1, 2, 3]
    assert {d["task_id"] for d in data} == {duplicate.id}
    elapsed = [d["elapsed"] for d in data]
    assert elapsed == sorted(elapsed)
    assert signal_count(cidem, "committed", key) == 1


def test_lease_lost_signal_fires_once_and_nothing_is_committed(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    result = cidem.steal.apply_async((tag,))
    with pytest.raises(LockLostError) as caught:
        result.get(timeout=TIMEOUT)

    key = key_of(cidem.steal, tag)
    assert caught.value.key == key
    assert isinstance(caught.value.result, str)  # what the body returned, for compensation
    wait_for(lambda: signal_count(cidem, "lease_lost", key) == 1, what="lease_lost")
    time.sleep(0.2)
    assert signal_count(cidem, "lease_lost", key) == 1
    assert signal_count(cidem, "committed", key) == 0
    (data,) = signal_data(cidem, "lease_lost", key)
    assert data["task_id"] == result.id
    assert data["sender"] == cidem.steal.name


def test_a_receiver_that_raises_does_not_break_the_task(
    cidem: ModuleType, workers: WorkerGroup, tag: str
) -> None:
    first = cidem.boom.apply_async((tag,)).get(timeout=TIMEOUT)
    second = cidem.boom.apply_async((tag,)).get(timeout=TIMEOUT)

    assert second == first
    assert count(cidem, "boom", tag) == 1
    key = key_of(cidem.boom, tag)
    assert signal_count(cidem, "committed", key) == 1
    wait_for(lambda: signal_count(cidem, "replayed", key) == 1, what="replayed")
    assert "a receiver that fails" in workers.logs()
