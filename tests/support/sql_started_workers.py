"""``idempotency_publish_until="started"`` on the SQL backends with a real prefork worker
(two children: a duplicate can be delivered while a body runs), a Redis broker, and the
store under test (``tests/support/started_app.py``). Run against PostgreSQL
(``tests/postgres/test_postgres_started_workers.py``) and MySQL / MariaDB
(``tests/mysql/test_mysql_started_workers.py``): each gives a ``started_url`` fixture, the
store's URL with a table of the module's own.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.result import EagerResult

from celery_idempotent import DuplicatePublishError
from celery_idempotent import settings as idem_settings
from celery_idempotent.celery.task import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup, start_workers

HERE = Path(__file__).resolve().parent
TIMEOUT = 60


@pytest.fixture(scope="module")
def st_env(redis_url: str, started_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:10]
    env = {
        "ST_REDIS_URL": redis_url,
        "ST_IDEMPOTENCY_URL": started_url,
        "ST_PREFIX": f"test:st-{session}:",
        "ST_QUEUE": f"st-{session}",
    }
    yield env
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, env["ST_PREFIX"])
    finally:
        client.close()


@pytest.fixture(scope="module")
def st(st_env: dict[str, str]) -> Iterator[ModuleType]:
    saved = {name: os.environ.get(name) for name in st_env}
    os.environ.update(st_env)
    sys.path.insert(0, str(HERE))
    sys.modules.pop("started_app", None)
    try:
        import started_app

        idem_settings.clear_cache()
        reset_backends()
        yield started_app
        started_app.app.close()
    finally:
        sys.modules.pop("started_app", None)
        sys.path.remove(str(HERE))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        idem_settings.clear_cache()
        reset_backends()


@pytest.fixture(scope="module")
def worker(st: ModuleType, st_env: dict[str, str]) -> Iterator[WorkerGroup]:
    group = start_workers(
        1,
        "started_app",
        env=st_env,
        pythonpath=[HERE],
        pool="prefork",
        concurrency=2,
        queues=[st_env["ST_QUEUE"]],
    )
    yield group
    group.stop()
    for each in group:
        each.remove_log()


def tag() -> str:
    return uuid.uuid4().hex[:10]


def started(st: ModuleType, *parts: Any, runs: int = 1) -> None:
    """Wait until the body ``parts`` names has started ``runs`` times."""
    wait_for(lambda: st.count(*parts) >= runs, timeout=TIMEOUT)


def no_overlap(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:]))


def test_one_running_one_queued_a_third_refused(st: ModuleType, worker: WorkerGroup) -> None:
    """While the first runs, a publish queues one more; a third is refused (the second is
    queued); the status names both; the second runs after the first, never beside it; once
    the second has started, the next publish queues again."""
    t = tag()
    task = st.once_at_a_time
    first = task.delay(t, 2.0)
    started(st, "ubr", t)
    second = task.delay(t, 2.0)
    assert second.id != first.id  # published: the first has started
    with pytest.raises(DuplicatePublishError) as caught:
        task.apply_async((t, 2.0), idempotency_on_duplicate_publish="raise")
    assert (caught.value.task_id, caught.value.state) == (second.id, "queued")
    assert caught.value.ttl_left is not None
    assert caught.value.ttl_left > 0
    assert task.delay(t, 2.0).id == second.id  # the default answer: the queued call's result
    status = task.idempotency_status((t, 2.0))
    if status.state == "running":  # the second's delivery may already wait in a child
        assert (status.task_id, status.queued_task_id) == (first.id, second.id)
    assert first.get(timeout=TIMEOUT)["run"] == 1
    started(st, "ubr", t, runs=2)  # the second's body started: its marker ended
    third = task.delay(t, 2.0)
    assert third.id not in (first.id, second.id)
    assert second.get(timeout=TIMEOUT)["run"] == 2
    assert third.get(timeout=TIMEOUT)["run"] == 3
    assert st.count("ubr", t) == 3
    assert no_overlap(st.runs("ubr", t))


def test_status_names_the_running_call_and_the_queued_one(
    st: ModuleType, worker: WorkerGroup
) -> None:
    """``idempotency_status`` while one runs and one is queued: ``running``, the running
    call's task id, and the queued call's in ``queued_task_id`` (sampled until the second's
    delivery is re-queued or not yet received: the state stays the same throughout)."""
    t = tag()
    task = st.once_at_a_time
    first = task.delay(t, 3.0)
    started(st, "ubr", t)
    assert task.idempotency_status((t, 3.0)).task_id == first.id
    second = task.delay(t, 3.0)
    status = task.idempotency_status((t, 3.0))
    assert (status.state, status.task_id, status.queued_task_id) == (
        "running",
        first.id,
        second.id,
    )
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert second.get(timeout=TIMEOUT)["run"] == 2
    wait_for(lambda: task.idempotency_status((t, 3.0)).state == "absent", timeout=TIMEOUT)


def test_with_a_ttl_the_queued_call_replays_the_first(st: ModuleType, worker: WorkerGroup) -> None:
    """With the default ``idempotency_ttl``: the call queued while the first ran is
    delivered after the first committed and gets its stored result (it does not run); a
    later publish goes through (the key is no longer queued) and replays it too."""
    t = tag()
    task = st.remembers
    first = task.delay(t, 1.5)
    started(st, "sr", t)
    second = task.delay(t, 1.5)
    assert second.id != first.id
    assert first.get(timeout=TIMEOUT) == second.get(timeout=TIMEOUT) == {"tag": t, "run": 1}
    later = task.delay(t, 1.5)
    assert not isinstance(later, EagerResult)  # published: a completed key does not stop it
    assert later.get(timeout=TIMEOUT) == {"tag": t, "run": 1}
    assert st.count("sr", t) == 1


def test_publish_ttl_and_forget_free_a_queued_key(st: ModuleType) -> None:
    """A queued call (on a queue no worker reads) stops a publish until its marker's
    ``idempotency_publish_ttl`` runs out, or until it is forgotten."""
    t = tag()
    task = st.once_at_a_time
    idle = f"{st.QUEUE}-idle"
    first = task.apply_async((t,), queue=idle, idempotency_publish_ttl=1.0)
    assert task.apply_async((t,), queue=idle).id == first.id
    status = task.idempotency_status((t,))
    assert (status.state, status.task_id) == ("queued", first.id)
    wait_for(lambda: task.apply_async((t,), queue=idle).id != first.id, timeout=10)
    queued = task.idempotency_status((t,))
    assert queued.state == "queued"
    assert queued.task_id != first.id
    forgotten = task.idempotency_forget((t,))
    assert forgotten.state == "queued"
    assert task.idempotency_status((t,)).state == "absent"
    assert task.apply_async((t,), queue=idle).id not in (first.id, queued.task_id)


def test_a_window_keys_the_mode_by_slot(st: ModuleType, worker: WorkerGroup) -> None:
    """With ``idempotency_window``: one running and one queued per schedule slot, as
    without it (the slot is stamped at publish and part of the key)."""
    t = tag()
    task = st.windowed
    first = task.delay(t, 1.5)
    started(st, "win", t)
    second = task.delay(t, 1.5)
    assert second.id != first.id
    assert task.delay(t, 1.5).id == second.id
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert second.get(timeout=TIMEOUT)["run"] == 2
    assert no_overlap(st.runs("win", t))
