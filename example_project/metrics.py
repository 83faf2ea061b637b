# Celery ships no type hints: its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""Counters from signals, kept in Redis (``<ns>:world:stats``) where the demo reads them.

A real deployment would send the same signals to StatsD or Prometheus. The receivers run in the
worker processes; a receiver's error is logged by Celery and never breaks a task.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    worker_process_init,
    worker_ready,
)

from celery_idempotent.signals import (
    idempotency_committed,
    idempotency_contended,
    idempotency_lease_lost,
    idempotency_replayed,
)
from example_project.shop import world


@idempotency_replayed.connect
def _on_replay(sender: Any = None, **kwargs: Any) -> None:
    world().count("replays")


@idempotency_contended.connect
def _on_contention(sender: Any = None, **kwargs: Any) -> None:
    world().count("contention")


@idempotency_committed.connect
def _on_commit(sender: Any = None, **kwargs: Any) -> None:
    world().count("committed")


@idempotency_lease_lost.connect
def _on_lease_lost(sender: Any = None, **kwargs: Any) -> None:
    world().count("lease_lost")


@task_prerun.connect
def _on_prerun(sender: Any = None, **kwargs: Any) -> None:
    world().count("deliveries")


@task_postrun.connect
def _on_postrun(sender: Any = None, state: str | None = None, **kwargs: Any) -> None:
    world().count(f"finished:{state}")


@task_failure.connect
def _on_failure(sender: Any = None, exception: BaseException | None = None, **kwargs: Any) -> None:
    name = type(exception).__name__
    world().count(f"failed:{name}")
    world().client.hsetnx(world().key("failure_examples"), name, repr(exception)[:500])


@worker_process_init.connect
def _on_process_init(**kwargs: Any) -> None:
    # Every pool process, including the replacement of a killed one, so that the demo can prove
    # that none is left running when it exits.
    world().client.sadd(world().key("pids"), os.getpid())


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    # The consumer is connected and takes messages from now on.
    world().client.sadd(world().key("ready"), str(getattr(sender, "hostname", sender)))
