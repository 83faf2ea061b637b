"""At worker start, every IdempotentTask's settings are resolved: one INFO line says where the
keys live, and a misconfigured task is reported in the log then, not at its first call."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.celery.task import check_app_at_worker_start
from celery_idempotent.settings import clear_cache
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup


def test_the_check_reports_each_misconfigured_task_and_sums_up_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery(f"start-{uuid.uuid4().hex[:8]}", broker="amqp://guest@localhost//")
    app.conf.update(idempotency_url="redis://:secret@127.0.0.1:6379/4")
    try:

        @app.task(base=IdempotentTask, shared=False, name="start.good")
        def good() -> int:
            return 1

        @app.task(base=IdempotentTask, shared=False, name="start.off", idempotency_enabled=False)
        def off() -> int:
            return 2

        @app.task(base=IdempotentTask, shared=False, name="start.bad", idempotency_ttl=-5)
        def bad() -> int:
            return 3

        @app.task(shared=False, name="start.plain")
        def plain() -> int:
            return 4

        app.finalize(auto=True)
        # Finalizing also adds the shared tasks other test modules defined in this process:
        # count the app's idempotent tasks rather than assume there are only these.
        ours = [n for n, t in app.tasks.items() if isinstance(t, IdempotentTask)]
        with caplog.at_level(logging.INFO, logger="celery_idempotent"):
            errors = check_app_at_worker_start(app)
    finally:
        clear_cache(app)
        app.close()

    mine = [e for e in errors if e.startswith("task start.")]
    assert len(mine) == 1
    assert "task start.bad is misconfigured" in mine[0]
    assert "idempotency_ttl" in mine[0]
    assert "start.good" not in " ".join(errors)
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("ERROR", f"celery-idempotent: {mine[0]}") in records
    summary = [m for level, m in records if level == "INFO"]
    assert len(summary) == 1
    # Only the tasks' own errors count against the summary: whether the probe of the URL's
    # Redis adds one depends on the machine (is something on 6379?) and on redis-py (4.6
    # reports the server's refusal of the URL's password; 8.x does not).
    healthy = len(ours) - len(mine)
    assert summary[0].startswith(f"celery-idempotent: {healthy} idempotent task(s): ")
    assert " at redis://:***@127.0.0.1:6379/4" in summary[0]
    assert "1 at disabled (idempotency_enabled=False)" in summary[0]
    assert "secret" not in caplog.text


@pytest.mark.worker
def test_a_real_worker_logs_its_idempotent_tasks_and_a_bad_setting_at_start(
    cidem: ModuleType, worker_factory: Callable[..., WorkerGroup], tag: str
) -> None:
    # The worker loads cidem_app only: shared tasks other suites' modules registered in this
    # process (``@shared_task``) are not the worker's.
    names = [
        n
        for n, t in cidem.app.tasks.items()
        if isinstance(t, IdempotentTask) and t.__module__ == cidem.__name__
    ]
    good = worker_factory(1, pool="solo", queues=[f"start-good-{tag}"])
    bad = worker_factory(
        1,
        pool="solo",
        queues=[f"start-bad-{tag}"],
        env={"CIDEM_IDEMPOTENCY_URL": "http://not-redis:6379/0"},
    )
    try:
        wait_for(lambda: "idempotent task(s)" in good[0].log(), what="the start-up summary")
        line = next(ln for ln in good[0].log().splitlines() if "idempotent task(s)" in ln)
        assert f"celery-idempotent: {len(names)} idempotent task(s): " in line
        assert f"{len(names)} at redis://" in line, "every task's keys on the broker's Redis"
        assert "misconfigured" not in good[0].log()

        wait_for(lambda: "misconfigured" in bad[0].log(), what="the start-up error")
        log = bad[0].log()
        for name in names:
            assert f"task {name} is misconfigured: idempotency_url" in log, name
        assert "http://not-redis" in log
        assert "ERROR" in log
    finally:
        good.stop()
        bad.stop()


def test_wait_replicas_is_checked_against_the_replicas_the_master_has(
    redis_server_factory: Callable[..., Any],
) -> None:
    """More replicas waited for than the master has: every claim would be given back (an
    ERROR at start); fewer than it has: a failover can lose commits (a WARNING naming the
    value to set); as many: nothing to say."""
    from celery_idempotent.celery.worker_start import StartupError, check_replicas
    from celery_idempotent.settings import resolve

    master = redis_server_factory()
    replicas: list[Any] = []

    def found(wait: int) -> list[str]:
        app = Celery(f"replicas-{uuid.uuid4().hex[:8]}", broker="memory://")
        app.conf.update(idempotency_url=master.url, idempotency_wait_replicas=wait)
        try:

            @app.task(base=IdempotentTask, shared=False, name="replicas.charge")
            def charge() -> int:
                return 1

            return check_replicas(app, [("replicas.charge", charge, resolve(app, charge))])
        finally:
            clear_cache(app)
            app.close()

    def attach() -> None:
        replica = redis_server_factory(extra_config=[f"replicaof {master.host} {master.port}"])
        replicas.append(replica)
        client = master.client()
        assert wait_for(
            lambda: int(client.info("replication")["connected_slaves"]) == len(replicas), 30
        )

    attach()
    assert found(1) == []
    (error,) = found(2)
    assert isinstance(error, StartupError)
    assert "has 1 replica(s) connected: every claim is given back" in error
    attach()
    (warning,) = found(1)
    assert not isinstance(warning, StartupError)
    assert "idempotency_wait_replicas=1 (tasks replicas.charge)" in warning
    assert "set it to 2 to lose none" in warning
    assert found(2) == []
    assert found(0) == []
