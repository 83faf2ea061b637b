"""Fixtures of the ``celery idempotency`` CLI suite.

Records are made the way production makes them: eager ``apply()`` of the tasks of
``cliadmin_app`` (``make_app`` on the session's Redis, under the test's ``key_prefix``), or
:class:`DistributedIdempotencyGuard` executions on the Redis backends with task-namespaced keys.
The CLI is run through click's ``CliRunner`` (``run_cli``) and as a real
``python -m celery -A cliadmin_app idempotency ...`` subprocess (``celery_cli``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from celery.bin.base import CLIContext
from cliadmin_app import GATES, STARTED, make_app
from click.testing import CliRunner, Result

from celery_idempotent import (
    DistributedIdempotencyGuard,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.cli import idempotency

if TYPE_CHECKING:
    import redis
    from celery import Celery

CLI_DIR = Path(__file__).resolve().parent


@pytest.fixture
def cli_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """``cliadmin_app.make_app`` on the test Redis, under the test's key prefix."""
    reset_backends()  # clients and guards are cached per (pid, id(app)): start clean
    app = make_app(redis_url, key_prefix)
    try:
        yield app
    finally:
        reset_backends()


@pytest.fixture
def run_cli(cli_app: Celery) -> Callable[..., Result]:
    """``run_cli("inspect", "k", "--task", "t", input=None)``: the group through CliRunner."""

    def run(*args: str, input: str | None = None, app: Any = None) -> Result:
        obj = CLIContext(app=app or cli_app, no_color=True, workdir=None)
        return CliRunner().invoke(idempotency, list(args), obj=obj, input=input)

    return run


@pytest.fixture
def celery_cli(redis_url: str, key_prefix: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``celery_cli("stats", "--json", input=None)``: ``python -m celery -A cliadmin_app
    idempotency ...`` in a subprocess, on the test Redis and prefix."""

    def run(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        path = [str(CLI_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(path),
            "CLIADMIN_REDIS_URL": redis_url,
            "CLIADMIN_PREFIX": key_prefix,
        }
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "cliadmin_app", "idempotency", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )

    return run


@dataclass
class Holder:
    """A ``cliadmin.hold`` delivery running in a thread: its body waits for ``release()``."""

    gate: str
    thread: threading.Thread
    outcome: list[Any]

    def release(self) -> Any:
        """Let the body return; the EagerResult of the delivery."""
        GATES[self.gate].set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.outcome[0]


@pytest.fixture
def hold(cli_app: Celery) -> Iterator[Callable[[], Holder]]:
    """``hold()`` starts a delivery that holds its key (a live, renewed lease) until released."""
    holders: list[Holder] = []

    def start() -> Holder:
        gate = uuid.uuid4().hex
        GATES[gate] = threading.Event()
        STARTED[gate] = threading.Event()
        outcome: list[Any] = []
        task = cli_app.tasks["cliadmin.hold"]
        thread = threading.Thread(target=lambda: outcome.append(task.apply((gate,))))
        thread.start()
        assert STARTED[gate].wait(10), "the held body never started"
        holder = Holder(gate, thread, outcome)
        holders.append(holder)
        return holder

    yield start
    for holder in holders:
        with contextlib.suppress(AssertionError):
            holder.release()


@pytest.fixture
def guard(redis_client: redis.Redis, key_prefix: str) -> DistributedIdempotencyGuard:
    """A guard on the Redis backends under the test's prefix (the path ``IdempotentTask`` takes)."""
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client),
        lock_provider=RedisLockProvider(redis_client, key_prefix=key_prefix),
        key_prefix=key_prefix,
    )
