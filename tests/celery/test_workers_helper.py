"""tests/support/workers.py itself: readiness, pool children, ping, and no process left behind."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import ModuleType

import pytest

from celery_idempotent.servers.processes import pid_alive
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis]


@pytest.mark.slow  # the pool replaces a lost child on a ~5 s timer
def test_start_ping_kill_child_and_stop_leave_nothing_behind(
    cidem: ModuleType, worker_factory: Callable[..., WorkerGroup]
) -> None:
    group = worker_factory(1, pool="prefork", concurrency=2)
    (worker,) = group
    children = worker.child_pids()
    assert len(children) == 2
    assert worker.ping(cidem.app, timeout=2.0)
    assert f"{worker.nodename} ready." in worker.log()

    killed = worker.kill_child()
    wait_for(lambda: not pid_alive(killed), 5, what="child gone")
    replacement = worker.child_pids(wait=True)
    assert killed not in replacement
    assert len(replacement) == 2

    main = worker.pid
    group.stop()
    assert not worker.running
    assert worker.returncode is not None
    for pid in [main, *children, *replacement]:
        assert not pid_alive(pid), pid


def test_kill_takes_the_whole_process_group(
    cidem: ModuleType, worker_factory: Callable[..., WorkerGroup]
) -> None:
    group = worker_factory(1, pool="prefork", concurrency=1)
    (worker,) = group
    pids = [worker.pid, *worker.child_pids()]
    worker.kill()
    assert worker.returncode == -signal.SIGKILL
    for pid in pids:
        assert not pid_alive(pid), pid
