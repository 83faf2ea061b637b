"""The thread and solo pools: one process, one task instance shared by every thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from tests.celery.cidem_helpers import count, key_of, signal_count
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis]

TIMEOUT = 30


@pytest.fixture(scope="module", params=[("threads", 4), ("solo", 1)], ids=["threads", "solo"])
def pool_worker(
    request: pytest.FixtureRequest, worker_factory: Callable[..., WorkerGroup]
) -> Iterator[WorkerGroup]:
    pool, concurrency = request.param
    group = worker_factory(1, pool=pool, concurrency=concurrency)
    yield group
    group.stop()


def test_duplicates_run_once(cidem: ModuleType, pool_worker: WorkerGroup, tag: str) -> None:
    results = [cidem.work.apply_async((tag, 1, 0.3)) for _ in range(8)]
    values = [r.get(timeout=TIMEOUT) for r in results]

    assert values == [values[0]] * 8
    assert count(cidem, "work", tag) == 1
    key = key_of(cidem.work, tag, 1, 0.3)
    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "replayed", key) == 7


def test_retry_commits_once(cidem: ModuleType, pool_worker: WorkerGroup, tag: str) -> None:
    value = cidem.flaky.apply_async((tag, 1)).get(timeout=TIMEOUT)

    assert value["attempts"] == 2
    assert cidem.flaky.apply_async((tag, 1)).get(timeout=TIMEOUT) == value
    assert count(cidem, "flaky", tag) == 2
    key = key_of(cidem.flaky, tag, 1)
    assert signal_count(cidem, "committed", key) == 1
    # No "contended" count here: the retry message (countdown 0.05 s) may be delivered to another
    # thread before the first attempt's lease is released, just after Celery published it; it then
    # waits as any duplicate of a held key does (seen once at load 30), and still runs once.
    assert signal_count(cidem, "replayed", key) == 1
