"""Switching from celery-once, celery-singleton and sidekiq-unique-jobs (issue 24): the peers'
documented scenarios, from their READMEs and their own test suites, run with the mapping of
``docs/recipes/migrating.md`` against a real Redis broker and a real prefork worker under
Celery's defaults (``apps/migrate_app.py``).

Each test is named for the peer's scenario (``test_once_*``: celery-once's README and
``tests/``; ``test_singleton_*``: celery-singleton's; ``test_sidekiq_*``: sidekiq-unique-jobs'
lock types) and says in its docstring what the peer does and what we do. Where we differ on
purpose, the test asserts our behaviour and the docs' table says so. The real-worker tests of
the two modes of SPEC §8 (``idempotency_ttl=0``, ``idempotency_publish_until="started"``) are
here too, as the peers' scenarios they serve.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult, EagerResult

from celery_idempotent import DuplicatePublishError, IdempotencyMismatchError, IdempotentTask
from celery_idempotent import settings as idem_settings
from celery_idempotent.admin import forget_all
from celery_idempotent.celery.task import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup, start_workers

pytestmark = pytest.mark.redis

APPS_DIR = Path(__file__).resolve().parent / "apps"
TIMEOUT = 30


@pytest.fixture(scope="module")
def mig_env(redis_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:10]
    env = {
        "MIG_REDIS_URL": redis_url,
        "MIG_PREFIX": f"test:mig-{session}:",
        "MIG_QUEUE": f"mig-{session}",
    }
    yield env
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, env["MIG_PREFIX"])
    finally:
        client.close()


@pytest.fixture(scope="module")
def mig(mig_env: dict[str, str]) -> Iterator[ModuleType]:
    saved = {name: os.environ.get(name) for name in mig_env}
    os.environ.update(mig_env)
    sys.path.insert(0, str(APPS_DIR))
    sys.modules.pop("migrate_app", None)
    try:
        import migrate_app

        idem_settings.clear_cache()
        reset_backends()
        yield migrate_app
        migrate_app.app.close()
    finally:
        sys.modules.pop("migrate_app", None)
        sys.path.remove(str(APPS_DIR))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        idem_settings.clear_cache()
        reset_backends()


@pytest.fixture(scope="module")
def worker(mig_env: dict[str, str]) -> Iterator[WorkerGroup]:
    """One prefork worker with two children: a duplicate can be delivered while a body runs."""
    group = start_workers(
        1,
        "migrate_app",
        env=mig_env,
        pythonpath=[APPS_DIR],
        pool="prefork",
        concurrency=2,
        queues=[mig_env["MIG_QUEUE"]],
    )
    yield group
    group.stop()
    for each in group:
        each.remove_log()


def tag() -> str:
    return uuid.uuid4().hex[:10]


def idle(mig: ModuleType) -> str:
    """A queue no worker consumes: calls stay queued."""
    return f"{mig.QUEUE}-idle"


def waiting(mig: ModuleType, queue: str) -> int:
    return int(mig.client().llen(f"{mig.PREFIX}kombu:{queue}"))


def started(mig: ModuleType, *parts: Any, runs: int = 1) -> None:
    """Wait until the body ``parts`` names has started ``runs`` times."""
    wait_for(lambda: mig.count(*parts) >= runs, timeout=TIMEOUT)


def no_overlap(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:]))


# =========================================================================== celery-once


def test_once_second_delay_raises_already_queued_with_when_it_frees(mig: ModuleType) -> None:
    """celery-once README: ``example.delay(10)`` twice raises ``AlreadyQueued`` (which says
    "expires in N s"). Ours: ``idempotency_on_duplicate_publish="raise"`` raises
    ``DuplicatePublishError`` with ``.task_id``, ``.state`` and ``.ttl_left`` (the queued
    marker's: ``idempotency_publish_ttl``)."""
    t = tag()
    first = mig.once.apply_async((t,), queue=idle(mig))
    with pytest.raises(DuplicatePublishError) as caught:
        mig.once.apply_async((t,), queue=idle(mig))
    error = caught.value
    assert error.task_id == first.id
    assert error.state == "queued"
    assert error.ttl_left is not None
    assert 3590 < error.ttl_left <= 3600
    assert "frees in" in str(error)
    assert waiting(mig, idle(mig)) >= 1


def test_once_state_running_and_completed_in_the_error(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """AlreadyQueued's "expires in" for a running call, and for a completed one under our
    default ``idempotency_ttl`` (celery-once has no completed state: it forgets)."""
    t = tag()
    first = mig.once.delay(t, 1.5)
    started(mig, "once", t)
    with pytest.raises(DuplicatePublishError) as caught:
        mig.once.delay(t, 1.5)
    assert (caught.value.state, caught.value.task_id) == ("running", first.id)
    first.get(timeout=TIMEOUT)
    done = mig.default.delay(t)
    done.get(timeout=TIMEOUT)
    with pytest.raises(DuplicatePublishError) as caught:
        mig.default.apply_async((t,), idempotency_on_duplicate_publish="raise")
    assert caught.value.state == "completed"
    assert caught.value.task_id == done.id
    assert caught.value.ttl_left is not None
    assert 86_300 < caught.value.ttl_left <= 86_400


def test_once_graceful_returns_instead_of_raising(mig: ModuleType, worker: WorkerGroup) -> None:
    """celery-once ``graceful=True``: the duplicate publish returns ``None`` (a result whose
    ``.result`` is None). Ours (the default ``"existing"``): the first call's ``AsyncResult``,
    whose value the caller can wait for (a documented difference)."""
    t = tag()
    first = mig.graceful.delay(t, 0.5)
    second = mig.graceful.delay(t, 0.5)
    assert isinstance(second, AsyncResult)
    assert second.id == first.id
    assert second.get(timeout=TIMEOUT) == first.get(timeout=TIMEOUT) == {"tag": t, "run": 1}
    assert mig.count("graceful", t) == 1


def test_once_lock_clears_when_the_task_completes(mig: ModuleType, worker: WorkerGroup) -> None:
    """celery-once: "Once the task completes the lock will clear": the same call runs again.
    Ours with ``idempotency_ttl=0``; with the default TTL the result is replayed instead."""
    t = tag()
    assert mig.once.delay(t).get(timeout=TIMEOUT)["run"] == 1
    assert mig.once.delay(t).get(timeout=TIMEOUT)["run"] == 2
    assert mig.count("once", t) == 2
    # The default (no mapping): remembered, replayed at publish, not run again.
    assert mig.default.delay(t).get(timeout=TIMEOUT)["run"] == 1
    again = mig.default.delay(t)
    assert isinstance(again, EagerResult)
    assert again.get() == {"tag": t, "run": 1}
    assert mig.count("default", t) == 1


def test_once_lock_clears_when_the_task_raises(mig: ModuleType, worker: WorkerGroup) -> None:
    """celery-once: the lock clears when the task "ends due to an exception"."""
    t = tag()
    for _ in range(2):
        with pytest.raises(ValueError, match="failed"):
            mig.fails.delay(t).get(timeout=TIMEOUT)
    assert mig.count("fails", t) == 2


def test_once_different_arguments_different_locks(mig: ModuleType) -> None:
    """celery-once README: ``slow_add(1, 1)`` and ``slow_add(1, 2)`` check different locks."""
    t = tag()
    a = mig.once.apply_async((t,), queue=idle(mig))
    b = mig.once.apply_async((t + "-other",), queue=idle(mig))
    assert a.id != b.id


def test_once_keys_subset(mig: ModuleType) -> None:
    """celery-once ``keys=["a"]``: ``delay(1, 1)`` then ``delay(1, 2)`` raises AlreadyQueued,
    ``delay(2, 2)`` goes. Ours: ``idempotency_key="a:{a}"`` with ``idempotency_fingerprint=None``
    (without it, the same key with another ``b`` is an ``IdempotencyMismatchError``)."""
    a = int(uuid.uuid4().int % 10**9)
    first = mig.keys_a.apply_async((a, 1), queue=idle(mig))
    with pytest.raises(DuplicatePublishError) as caught:
        mig.keys_a.apply_async((a, 2), queue=idle(mig))
    assert caught.value.task_id == first.id
    other = mig.keys_a.apply_async((a + 1, 2), queue=idle(mig))
    assert other.id != first.id


def test_once_keys_subset_without_the_fingerprint_mapping_is_a_mismatch(
    mig: ModuleType,
) -> None:
    """The difference the guide names: a key from some arguments keeps checking the others
    unless ``idempotency_fingerprint`` says otherwise."""
    t = tag()
    strict = type(mig.app.tasks["mig.unique_on_user"])
    strict.idempotency_fingerprint = "args"
    idem_settings.clear_cache()
    try:
        mig.unique_on_user.apply_async((t, 1), queue=idle(mig))
        with pytest.raises(IdempotencyMismatchError):
            mig.unique_on_user.apply_async((t, 2), queue=idle(mig))
    finally:
        strict.idempotency_fingerprint = None
        idem_settings.clear_cache()


def test_once_keys_empty_one_call_whatever_the_arguments(mig: ModuleType) -> None:
    """celery-once ``keys=[]``: "only one task can run, no matter what arguments". Ours: a
    constant ``idempotency_key`` and ``idempotency_fingerprint=None``."""
    forget_all(mig.app)  # the constant key may be left queued by an earlier run
    first = mig.keys_none.apply_async((1, 1), queue=idle(mig))
    with pytest.raises(DuplicatePublishError) as caught:
        mig.keys_none.apply_async((2, 2), queue=idle(mig))
    assert caught.value.task_id == first.id
    mig.keys_none.idempotency_forget(key="the-only-one", force=True)


def test_once_timeout_is_publish_ttl_for_a_call_never_run(mig: ModuleType) -> None:
    """celery-once ``timeout`` (and celery-singleton ``lock_expiry``): how long a *queued*
    call blocks its key when it never runs. Ours: ``idempotency_publish_ttl`` (not
    ``idempotency_lock_ttl``, a running body's renewed lease). The issue's scenario: a second
    publish 2.5 s later goes through once the marker's time is up."""
    t = tag()
    once = type(mig.app.tasks["mig.once"])
    once.idempotency_publish_ttl = 1.5
    idem_settings.clear_cache()
    try:
        lost = mig.once.apply_async((t,), queue=idle(mig))
        with pytest.raises(DuplicatePublishError) as caught:
            mig.once.apply_async((t,), queue=idle(mig))
        assert caught.value.ttl_left is not None
        assert caught.value.ttl_left <= 1.5
        time.sleep(2.5)
        again = mig.once.apply_async((t,), queue=idle(mig))
        assert again.id != lost.id
    finally:
        once.idempotency_publish_ttl = None
        idem_settings.clear_cache()


def test_once_unlock_before_run_one_running_one_queued(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """celery-once ``unlock_before_run=True`` (its issues #26, #114: one call running plus one
    queued). Ours: ``idempotency_publish_until="started"`` with ``idempotency_ttl=0``. While
    the first runs, a publish queues one more; a third is stopped (the second's result); the
    second runs after the first (never both at once), and a publish after both runs again."""
    t = tag()
    first = mig.unlock_before_run.delay(t, 1.5)
    started(mig, "ubr", t)
    second = mig.unlock_before_run.delay(t, 1.5)
    assert second.id != first.id  # published: the first has started
    third = mig.unlock_before_run.delay(t, 1.5)
    assert third.id == second.id  # stopped: the second is queued
    # The status names both (it read the queued call's task id as the running one's).
    status = mig.unlock_before_run.idempotency_status((t, 1.5))
    assert (status.state, status.task_id, status.queued_task_id) == (
        "running",
        first.id,
        second.id,
    )
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert second.get(timeout=TIMEOUT)["run"] == 2
    assert mig.count("ubr", t) == 2
    assert no_overlap(mig.runs("ubr", t))
    assert mig.unlock_before_run.delay(t, 1.5).get(timeout=TIMEOUT)["run"] == 3


def test_once_unlock_before_run_with_a_ttl_replays_the_queued_one(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """``idempotency_publish_until="started"`` composed with the default ``idempotency_ttl``:
    the call queued while the first ran is delivered after the first committed, so it gets
    the first's stored result (it does not run), and so does every later publish (each
    published: the key is no longer queued)."""
    t = tag()
    first = mig.started_remembers.delay(t, 1.0)
    started(mig, "sr", t)
    second = mig.started_remembers.delay(t, 1.0)
    assert second.id != first.id
    assert first.get(timeout=TIMEOUT) == second.get(timeout=TIMEOUT) == {"tag": t, "run": 1}
    later = mig.started_remembers.delay(t, 1.0)
    assert not isinstance(later, EagerResult)  # published: a completed key does not stop it
    assert later.get(timeout=TIMEOUT) == {"tag": t, "run": 1}
    assert mig.count("sr", t) == 1


def test_once_retry_keeps_the_key(mig: ModuleType, worker: WorkerGroup) -> None:
    """celery-once ``test_retry``: the lock is taken at publish and cleared only when the
    retried task ends. Ours: a retry keeps the key queued (same task id): a publish while the
    task waits for its retry is stopped; once it ended, the call runs again (ttl=0)."""
    t = tag()
    first = mig.retrying.delay(t)
    started(mig, "retrying", t)
    with pytest.raises(DuplicatePublishError) as caught:
        mig.retrying.delay(t)
    assert caught.value.task_id == first.id
    assert first.get(timeout=TIMEOUT) == f"{t} after 1 retry"
    assert mig.count("retrying", t) == 2
    assert mig.retrying.delay(t).get(timeout=TIMEOUT) == f"{t} after 0 retry"


def test_once_direct_call_is_not_affected(mig: ModuleType) -> None:
    """celery-once README: "It does not affect calling the tasks directly"."""
    t = tag()
    assert mig.once(t)["run"] == 1
    assert mig.once(t)["run"] == 2


def test_once_file_backend_to_memory_has_no_publish_side(mig: ModuleType) -> None:
    """celery-once's File backend mapped to ``memory://``: locks inside one process, and no
    publish-side check at all: two publishes are two messages (each worker process guards
    its own deliveries only). The guide says to use Redis for more than one process."""
    t = tag()
    before = waiting(mig, idle(mig))
    a = mig.in_memory.apply_async((t,), queue=idle(mig))
    b = mig.in_memory.apply_async((t,), queue=idle(mig))
    assert a.id != b.id
    assert waiting(mig, idle(mig)) == before + 2


def test_once_duplicate_delivery_never_runs_at_the_same_time(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """What ``idempotency_ttl=0`` means for a duplicate *delivery* (one that bypassed the
    publish side: ``send_task``, a broker redelivery): while the body runs it waits (re-queued
    by the library), after the body ended it runs again: never twice at the same time."""
    t = tag()
    first = mig.once.delay(t, 1.0)
    started(mig, "once", t)
    during = mig.app.send_task("mig.once", (t, 1.0))  # the same call, past the publish side
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert during.get(timeout=TIMEOUT)["run"] == 2  # ran after the first, not beside it
    after = mig.app.send_task("mig.once", (t, 1.0))
    assert after.get(timeout=TIMEOUT)["run"] == 3  # nothing remembered
    assert no_overlap(mig.runs("once", t))


# =========================================================================== celery-singleton


def test_singleton_queue_duplicates_same_id(mig: ModuleType) -> None:
    """celery-singleton ``test__queue_duplicates__same_id`` (and README's ``a == b``)."""
    t = tag()
    a = mig.singleton.apply_async((t, 2, 3), {"a": "b"}, queue=idle(mig))
    b = mig.singleton.apply_async((t, 2, 3), {"a": "b"}, queue=idle(mig))
    assert a == b
    assert a.id == b.id


def test_singleton_queue_multiple_uniques_different_ids(mig: ModuleType) -> None:
    """celery-singleton ``test__queue_multiple_uniques__different_ids``."""
    t = tag()
    a = mig.singleton.apply_async((t, 1), queue=idle(mig))
    c = mig.singleton.apply_async((t, 4, 5, 6), queue=idle(mig))
    assert a.id != c.id


def test_singleton_duplicate_after_success_and_after_error(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """celery-singleton ``test__queue_duplicate_after_success__different_ids`` and
    ``..._after_error__...``: once the first ended, a duplicate is a new task. Ours with
    ``idempotency_ttl=0`` (a failure frees the key whatever the TTL)."""
    t = tag()
    a = mig.singleton.delay(t, hold=0.3)
    assert a.get(timeout=TIMEOUT) == "I just woke up"
    d = mig.singleton.delay(t, hold=0.3)
    assert d.id != a.id
    d.get(timeout=TIMEOUT)
    assert mig.count("singleton", repr((t,)), repr([("hold", 0.3)])) == 2
    with pytest.raises(ValueError):
        mig.fails.delay(t).get(timeout=TIMEOUT)
    assert mig.fails.delay(t).id is not None
    wait_for(lambda: mig.count("fails", t) == 2, timeout=TIMEOUT)


def test_singleton_get_existing_task_id_while_running(mig: ModuleType, worker: WorkerGroup) -> None:
    """celery-singleton ``test__get_existing_task_id``: a duplicate of a running task gets
    the running task's ``AsyncResult``."""
    t = tag()
    first = mig.singleton.delay(t, hold=1.0)
    started(mig, "singleton", repr((t,)), repr([("hold", 1.0)]))
    again = mig.singleton.delay(t, hold=1.0)
    assert again.id == first.id
    assert again.get(timeout=TIMEOUT) == "I just woke up"


def test_singleton_apply_async_fails_lock_cleared_and_reraised(
    mig: ModuleType, redis_url: str
) -> None:
    """celery-singleton ``test__apply_async_fails__lock_cleared`` and ``..._exception_reraised``:
    a publish that fails leaves no lock behind and raises. Ours: a broker nobody listens on,
    the check on the idempotency Redis; the marker is removed and kombu's error raised."""
    app = Celery("failpub", broker="redis://127.0.0.1:9/0", set_as_current=False)
    app.conf.update(
        task_publish_retry=False,
        broker_connection_timeout=1,
        broker_connection_retry=False,
        idempotency_url=redis_url,
        idempotency_key_prefix=f"{mig.PREFIX}idem:",
    )

    @app.task(base=IdempotentTask, shared=False, name="failpub.task", idempotency_ttl=0)
    def task(tag: str) -> str:
        return tag

    t = tag()
    try:
        with pytest.raises(Exception) as caught:
            task.apply_async((t,))
        assert not isinstance(caught.value, DuplicatePublishError)
        assert task.idempotency_status((t,)).state == "absent"  # no marker left behind
        with pytest.raises(Exception) as again:
            task.apply_async((t,))  # not stopped as a duplicate: the publish fails again
        assert not isinstance(again.value, DuplicatePublishError)
    finally:
        app.close()


def test_singleton_raise_on_duplicate(mig: ModuleType) -> None:
    """celery-singleton ``test__raise_on_duplicate__raises_duplicate_error``:
    ``DuplicateTaskError`` with ``e.task_id``. Ours: ``DuplicatePublishError.task_id``."""
    t = tag()
    first = mig.singleton_raise.apply_async((t,), queue=idle(mig))
    with pytest.raises(DuplicatePublishError) as caught:
        mig.singleton_raise.apply_async((t,), queue=idle(mig))
    assert caught.value.task_id == first.id


def test_singleton_raise_on_duplicate_app_and_task_config(mig: ModuleType) -> None:
    """celery-singleton ``TestRaiseOnDuplicateConfig``: off by default, the app's setting
    when the task sets none, the task's option over the app's."""
    t = tag()
    first = mig.singleton.apply_async((t, "cfg"), queue=idle(mig))
    assert mig.singleton.apply_async((t, "cfg"), queue=idle(mig)).id == first.id  # default
    mig.app.conf.idempotency_on_duplicate_publish = "raise"
    idem_settings.clear_cache()
    try:
        with pytest.raises(DuplicatePublishError):
            mig.singleton.apply_async((t, "cfg"), queue=idle(mig))  # the app's setting
        graceful = type(mig.app.tasks["mig.graceful"])
        graceful.idempotency_on_duplicate_publish = "existing"  # the task's option wins
        idem_settings.clear_cache()
        g = mig.graceful.apply_async((t,), queue=idle(mig))
        assert mig.graceful.apply_async((t,), queue=idle(mig)).id == g.id
    finally:
        mig.app.conf.idempotency_on_duplicate_publish = "existing"
        type(mig.app.tasks["mig.graceful"]).idempotency_on_duplicate_publish = None
        idem_settings.clear_cache()


def test_singleton_clear_locks(mig: ModuleType) -> None:
    """celery-singleton ``test__clear_locks``: ``clear_locks(app)`` removes every lock, so the
    same calls queue again. Ours: ``admin.forget_all(app)`` (CLI: ``forget --all``)."""
    t = tag()
    a = mig.singleton.apply_async((t, "x"), queue=idle(mig))
    b = mig.unique_on_user.apply_async((t,), queue=idle(mig))
    done = forget_all(mig.app)
    assert done.records >= 2
    assert mig.singleton.apply_async((t, "x"), queue=idle(mig)).id != a.id
    assert mig.unique_on_user.apply_async((t,), queue=idle(mig)).id != b.id


def test_singleton_unique_on_positional_and_keyword(mig: ModuleType) -> None:
    """celery-singleton ``test__unique_on_pos_arg__...`` / ``..._kwargs__...`` (README:
    ``do_something.delay(username="bob", otherarg=99)`` and ``otherarg=100`` are one task).
    Ours: ``idempotency_key="user:{username}"``, ``idempotency_fingerprint=None``."""
    t = tag()
    task1 = mig.unique_on_user.apply_async(kwargs={"username": t, "otherarg": 99}, queue=idle(mig))
    task2 = mig.unique_on_user.apply_async(kwargs={"username": t, "otherarg": 100}, queue=idle(mig))
    task3 = mig.unique_on_user.apply_async((t, 101), queue=idle(mig))
    assert task1 == task2 == task3
    other = mig.unique_on_user.apply_async((t + "-2", 99), queue=idle(mig))
    assert other.id != task1.id


def test_singleton_unique_on_empty_is_the_task_name_only(mig: ModuleType) -> None:
    """celery-singleton ``test__unique_on_empty__lock_on_task_name_only``."""
    mig.unique_on_empty.idempotency_forget(key="name-only", force=True)
    first = mig.unique_on_empty.apply_async((1,), queue=idle(mig))
    assert mig.unique_on_empty.apply_async((2,), queue=idle(mig)).id == first.id
    mig.unique_on_empty.idempotency_forget(key="name-only", force=True)


def test_singleton_unique_on_unspecified_default_args(mig: ModuleType) -> None:
    """celery-singleton ``test__unique_on_handles_unspecified_default_args``: a default that
    the call leaves out counts as given (ours: the key is formatted over the bound arguments
    with defaults applied)."""
    a = int(uuid.uuid4().int % 10**9)
    first = mig.unique_on_defaults.apply_async((a,), queue=idle(mig))
    assert mig.unique_on_defaults.apply_async((a, 5), queue=idle(mig)).id == first.id
    assert (
        mig.unique_on_defaults.apply_async((a,), {"b": 5, "c": 1}, queue=idle(mig)).id == first.id
    )
    assert mig.unique_on_defaults.apply_async((a, 6), queue=idle(mig)).id != first.id


def test_singleton_json_arguments_uuid(mig: ModuleType) -> None:
    """celery-singleton ``TestCustomJSONEncoder``: a ``uuid.UUID`` argument needs an encoder
    there. Ours: the key comes from the arguments as the worker receives them (kombu's JSON
    carries a UUID), so two calls with one UUID are one task and no encoder is configured."""
    value = uuid.uuid4()
    first = mig.singleton.apply_async((value,), queue=idle(mig))
    assert mig.singleton.apply_async((value,), queue=idle(mig)).id == first.id
    assert mig.singleton.apply_async((uuid.uuid4(),), queue=idle(mig)).id != first.id


def test_singleton_lock_expiry_as_one_call_per_time_frame(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """celery-singleton ``lock_expiry`` as "a max of one task queued within a given time
    frame". Ours: ``idempotency_window`` (the frame), a grid of slots rounded to the nearest
    boundary rather than a frame that starts at the first call: within one slot one run,
    a publish a whole frame later runs again."""

    def slot(when: float) -> int:
        return int(when / mig.FRAME + 0.5)

    while True:  # a publish whose slot is known: not one that straddled a boundary
        t = tag()
        published = time.time()
        first = mig.time_frame.delay(t)
        if slot(published) == slot(time.time()):
            break
        first.get(timeout=TIMEOUT)
    assert first.get(timeout=TIMEOUT) == 1
    # The end of the first call's slot (slots are rounded to the nearest boundary).
    slot_end = (slot(published) + 0.5) * mig.FRAME
    if slot_end - time.time() > 0.3:  # still inside the first's slot: replayed
        assert mig.time_frame.delay(t).get(timeout=TIMEOUT) == 1
    time.sleep(max(0.0, slot_end - time.time()) + 0.1)
    assert mig.time_frame.delay(t).get(timeout=TIMEOUT) == 2
    assert mig.count("time_frame", t) == 2


# =========================================================================== re-scheduling


def test_reschedule_itself_with_the_same_arguments_is_swallowed(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """celery-singleton issue #53: a task that re-schedules itself from its own body with
    the same arguments. True to idempotency, the call is the running one (its key is taken):
    the publish is stopped and returns the running call's own result object."""
    t = tag()
    first = mig.resched_same.delay(t)
    assert first.get(timeout=TIMEOUT) == 1
    time.sleep(1.0)
    assert mig.count("resched_same", t) == 1
    ids = [i.decode() for i in mig.client().lrange(mig.fx("resched_ids", t), 0, -1)]
    assert ids == [first.id]


def test_reschedule_itself_with_a_step_in_the_key(mig: ModuleType, worker: WorkerGroup) -> None:
    """The pattern: a key with a slot of its own (``idempotency_key="poll:{tag}:{step}"``),
    each re-schedule the next step: three runs, each step at most once."""
    t = tag()
    mig.resched_step.delay(t)
    wait_for(lambda: mig.count("resched_step", t) >= 3, timeout=TIMEOUT)
    time.sleep(0.5)
    assert mig.count("resched_step", t) == 3


def test_reschedule_itself_with_publish_until_started(mig: ModuleType, worker: WorkerGroup) -> None:
    """The pattern with the same arguments: ``idempotency_publish_until="started"`` and
    ``idempotency_ttl=0``: the running call's claim ended its marker, so the call it
    publishes is the one more that may wait, and runs after it."""
    t = tag()
    mig.resched_started.delay(t)
    wait_for(lambda: mig.count("resched_started", t) >= 3, timeout=TIMEOUT)
    time.sleep(0.5)
    assert mig.count("resched_started", t) == 3
    assert no_overlap(mig.runs("resched_started", t))


def test_reschedule_itself_into_the_next_window_slot(mig: ModuleType, worker: WorkerGroup) -> None:
    """The pattern with a window: the body re-schedules itself for one window later and
    stamps the slot of when it is due (``idempotency_slot`` header): one run per slot."""
    t = tag()
    mig.resched_slot.delay(t)
    wait_for(lambda: mig.count("resched_slot", t) >= 3, timeout=TIMEOUT)
    time.sleep(1.5)
    assert mig.count("resched_slot", t) == 3


# =========================================================================== sidekiq-unique-jobs


def test_sidekiq_until_executed_is_the_default_then_replayed(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """sidekiq-unique-jobs ``until_executed``: locked from push until the job has run. Ours
    by default, and longer: the result is replayed for ``idempotency_ttl`` after that."""
    t = tag()
    first = mig.default.delay(t, 0.5)
    assert mig.default.delay(t, 0.5).id == first.id  # queued or running: the same call
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert isinstance(mig.default.delay(t, 0.5), EagerResult)  # executed: replayed at publish


def test_sidekiq_until_executed_with_ttl_zero_frees_after(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """sidekiq-unique-jobs ``until_executed`` exactly (nothing kept after the run):
    ``idempotency_ttl=0``."""
    t = tag()
    first = mig.graceful.delay(t, 0.5)
    assert mig.graceful.delay(t, 0.5).id == first.id
    first.get(timeout=TIMEOUT)
    assert mig.graceful.delay(t, 0.5).get(timeout=TIMEOUT)["run"] == 2


def test_sidekiq_until_and_while_executing_is_publish_until_started(
    mig: ModuleType, worker: WorkerGroup
) -> None:
    """sidekiq-unique-jobs ``until_and_while_executing``: one queued (until it starts) and one
    running. Ours: ``idempotency_publish_until="started"`` (the run-time lock is always
    there); the scenario is celery-once's ``unlock_before_run`` test above, in short."""
    t = tag()
    first = mig.unlock_before_run.delay(t, 1.0)
    started(mig, "ubr", t)
    second = mig.unlock_before_run.delay(t, 1.0)
    assert second.id != first.id
    assert mig.unlock_before_run.delay(t, 1.0).id == second.id
    second.get(timeout=TIMEOUT)
    assert no_overlap(mig.runs("ubr", t))


def test_sidekiq_until_expired_is_idempotency_ttl(mig: ModuleType, worker: WorkerGroup) -> None:
    """sidekiq-unique-jobs ``until_expired`` (``lock_ttl: N``): the lock lives out its TTL
    even after the job ran. Ours: the record lives out ``idempotency_ttl`` (a publish within
    it gets the stored result, not a run), then the call runs again."""
    t = tag()
    assert mig.until_expired.delay(t).get(timeout=TIMEOUT) == 1
    assert mig.until_expired.delay(t).get(timeout=TIMEOUT) == 1  # within its TTL: replayed
    time.sleep(1.7)
    assert mig.until_expired.delay(t).get(timeout=TIMEOUT) == 2
    assert mig.count("until_expired", t) == 2


def test_sidekiq_while_executing(mig: ModuleType, worker: WorkerGroup) -> None:
    """sidekiq-unique-jobs ``while_executing``: every push is enqueued; only one runs at a
    time. Ours: ``idempotency_on_duplicate_publish="publish"`` and ``idempotency_ttl=0``;
    a delivery that finds the key held is re-queued (``on_locked="retry"``: sidekiq's
    ``reschedule``) and runs after the first."""
    t = tag()
    results = [mig.while_executing.delay(t, 0.5) for _ in range(3)]
    assert len({r.id for r in results}) == 3
    assert sorted(r.get(timeout=TIMEOUT) for r in results) == [1, 2, 3]
    assert no_overlap(mig.runs("while_executing", t))


def test_sidekiq_reject_strategy_is_on_locked_reject(mig: ModuleType, worker: WorkerGroup) -> None:
    """sidekiq-unique-jobs ``on_conflict: :reject`` (server side: to the dead set). Ours:
    ``idempotency_on_locked="reject"`` (Celery ``Reject(requeue=False)``: with
    ``task_acks_late`` a dead-letter exchange takes it): the duplicate delivery never runs."""
    t = tag()
    first = mig.reject_duplicate.delay(t, 1.5)
    started(mig, "reject_duplicate", t)
    mig.app.send_task("mig.reject_duplicate", (t, 1.5))  # the same call, past the publish side
    assert first.get(timeout=TIMEOUT) == 1
    time.sleep(1.0)
    assert mig.count("reject_duplicate", t) == 1


def test_sidekiq_uniqueness_is_across_queues(mig: ModuleType) -> None:
    """sidekiq-unique-jobs: a job's digest includes its queue unless
    ``unique_across_queues: true``. Ours: the key never includes the queue, so the same call
    routed to another queue is the same call (a documented difference)."""
    t = tag()
    first = mig.once.apply_async((t,), queue=idle(mig))
    with pytest.raises(DuplicatePublishError) as caught:
        mig.once.apply_async((t,), queue=f"{idle(mig)}-other")
    assert caught.value.task_id == first.id


def test_a_periodic_task_with_ttl_zero_is_not_reported_as_collapsing() -> None:
    """The worker's start-up check of a ``beat_schedule`` entry keyed by its arguments warns
    that its runs collapse into replays for ``idempotency_ttl``; with ``0`` nothing is kept,
    so each run after the last one ended runs: no warning."""
    from celery_idempotent.celery.worker_start import check_beat_schedule

    app = Celery("beatcheck", broker="memory://", set_as_current=False)
    app.conf.idempotency_url = "memory://"
    app.conf.beat_schedule = {
        "kept": {"task": "beatcheck.kept", "schedule": 60.0},
        "forgotten": {"task": "beatcheck.forgotten", "schedule": 60.0},
    }

    @app.task(base=IdempotentTask, shared=False, name="beatcheck.kept")
    def kept() -> None:
        """Remembered for a day: its hourly runs would replay."""

    @app.task(base=IdempotentTask, shared=False, name="beatcheck.forgotten", idempotency_ttl=0)
    def forgotten() -> None:
        """Nothing kept."""

    try:
        messages = check_beat_schedule(app)
    finally:
        app.close()
    assert len(messages) == 1
    assert "beatcheck.kept" in messages[0]


def test_ttl_zero_composes_with_store_errors_and_eager_calls() -> None:
    """``idempotency_ttl=0`` with ``idempotency_store_errors``: a listed failure is raised to
    its delivery and, like a result, not kept: the next call runs the body again (eager
    ``apply()``, the same guard as a worker's)."""
    app = Celery("ttl0compose", broker="memory://", set_as_current=False)
    app.conf.idempotency_url = "memory://"
    runs: list[int] = []

    @app.task(
        base=IdempotentTask,
        shared=False,
        name="ttl0compose.declined",
        idempotency_ttl=0,
        idempotency_store_errors=(LookupError,),
    )
    def declined(order: int) -> None:
        runs.append(order)
        raise LookupError(f"card of order {order} declined")

    reset_backends()
    try:
        for _ in range(2):
            with pytest.raises(LookupError, match="declined"):
                declined.apply((7,)).get()
        assert runs == [7, 7]
        assert declined.idempotency_status((7,)).state == "absent"
    finally:
        reset_backends()
        app.close()


def test_ttl_zero_per_call(mig: ModuleType, worker: WorkerGroup) -> None:
    """``apply_async(..., idempotency_ttl=0)`` (a per-call option, SPEC §8): this call's
    result is not kept, so the same call runs again; the task's own TTL still holds for
    calls without the option."""
    t = tag()
    assert mig.default.apply_async((t, 0.0), idempotency_ttl=0).get(timeout=TIMEOUT)["run"] == 1
    assert mig.default.apply_async((t, 0.0), idempotency_ttl=0).get(timeout=TIMEOUT)["run"] == 2
    assert mig.default.delay(t, 0.0).get(timeout=TIMEOUT)["run"] == 3  # kept this time
    assert isinstance(mig.default.delay(t, 0.0), EagerResult)  # replayed at publish
    assert mig.count("default", t) == 3
