"""Real ``celery worker`` subprocesses for the tests.

``CeleryWorker`` starts ``python -m celery -A <module> worker`` with a pool (``prefork``,
``threads``, ``solo``), a concurrency, queues and a hostname, in its own process group and with
the environment the app module reads its configuration from; it returns once the worker logged
``ready.`` (and, for prefork, once its pool children exist). ``child_pids()`` lists the pool
children (read from ``/proc``, no psutil), ``kill_child()`` SIGKILLs one, ``stop()`` sends
SIGTERM, then SIGKILL to the whole process group after a timeout. Every worker still running at
interpreter exit is killed (``atexit``), and on Linux the worker's main process gets
``PR_SET_PDEATHSIG`` so that it dies with the test process even after a ``SIGKILL``.

``start_workers(n, module, ...)`` starts ``n`` of them in parallel (each ``start()`` takes about
1.5-3 s, mostly imports). Typical use, with the app module configured from environment
variables so that the worker and the test process load the same app::

    with start_workers(2, "idem_app", pool="prefork", concurrency=3, queues=[queue],
                       env={"CIDEM_BROKER_URL": url}, pythonpath=[APPS_DIR]) as workers:
        result = task.apply_async(queue=queue)
        ...

Import it from a test as ``from tests.support.workers import CeleryWorker``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from celery_idempotent.servers.processes import spawn
from tests.support.process_tree import children_of, kill_group

__all__ = [
    "CeleryWorker",
    "WorkerError",
    "WorkerGroup",
    "start_workers",
]

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
POOLS = ("prefork", "threads", "solo", "eventlet", "gevent")

_live: set[CeleryWorker] = set()
_live_lock = threading.Lock()


class WorkerError(RuntimeError):
    """A worker did not start, or died; the message carries the tail of its log."""


# --------------------------------------------------------------------------- one worker


class CeleryWorker:
    """One ``celery -A <app_module> worker`` subprocess (see the module doc).

    ``env`` is added to this process's environment (``None`` values remove a variable);
    ``pythonpath`` entries are put in front of ``PYTHONPATH``. ``extra_args`` go after the
    worker's own arguments (``["--prefetch-multiplier", "1"]``, ``["-O", "fair"]``). Gossip,
    mingle and heartbeats are off for a fast start unless ``fast=False``. The log (stdout and
    stderr) is written to :attr:`logfile`; :meth:`log` reads it.
    """

    def __init__(
        self,
        app_module: str,
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        queues: Sequence[str] | str | None = None,
        hostname: str | None = None,
        env: Mapping[str, str | None] | None = None,
        pythonpath: Iterable[str | os.PathLike[str]] = (),
        extra_args: Sequence[str] = (),
        loglevel: str = "INFO",
        fast: bool = True,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
        self.app_module = app_module
        self.pool = pool
        self.concurrency = concurrency
        self.queues = [queues] if isinstance(queues, str) else list(queues or [])
        self.hostname = hostname or f"w{uuid.uuid4().hex[:8]}@%h"
        self.env = dict(env or {})
        self.pythonpath = [str(p) for p in pythonpath]
        self.extra_args = list(extra_args)
        self.loglevel = loglevel
        self.fast = fast
        self.cwd = str(cwd) if cwd is not None else None
        self.logfile: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: Any = None

    # ------------------------------------------------------------------ info

    @property
    def pid(self) -> int:
        """PID of the worker's main process."""
        if self._proc is None:
            raise WorkerError("worker not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the main process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    @property
    def nodename(self) -> str:
        """The node name the worker answers to (``%h`` expanded), e.g. for ``control.ping``."""
        from celery.utils.nodenames import default_nodename, host_format

        return host_format(default_nodename(self.hostname))

    def command(self) -> list[str]:
        """The command line that :meth:`start` runs."""
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app_module,
            "worker",
            "--pool",
            self.pool,
            "--concurrency",
            str(self.concurrency),
            "--hostname",
            self.hostname,
            "--loglevel",
            self.loglevel,
        ]
        if self.queues:
            cmd += ["--queues", ",".join(self.queues)]
        if self.fast:
            cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        return cmd + self.extra_args

    def environ(self) -> dict[str, str]:
        """The environment the worker runs with."""
        env = dict(os.environ)
        for name, value in self.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        paths = [*self.pythonpath]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # pytest's own plugin autoload or strict warnings must not leak into the worker
        env.pop("PYTEST_CURRENT_TEST", None)
        return env

    def ping(self, app: Any, timeout: float = 1.0) -> bool:
        """Whether the worker answers ``app.control.ping`` (``app`` configured like it)."""
        replies = app.control.ping(destination=[self.nodename], timeout=timeout)
        return any(self.nodename in reply for reply in replies or [])

    def log(self) -> str:
        """Everything the worker has logged so far."""
        if self.logfile is None:
            return ""
        try:
            return self.logfile.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def child_pids(self, *, wait: bool = False, timeout: float = 10.0) -> list[int]:
        """PIDs of the pool's child processes (prefork); ``[]`` for other pools.

        ``wait=True`` waits until there are ``concurrency`` of them (after a child was killed,
        until the replacement exists).
        """
        if self.pool != "prefork":
            return []
        deadline = time.monotonic() + timeout
        while True:
            pids = children_of(self.pid)
            if not wait or len(pids) >= self.concurrency:
                return pids
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{self.hostname}: {len(pids)} of {self.concurrency} pool children after "
                    f"{timeout}s\n{self.log_tail()}"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, timeout: float = START_TIMEOUT, wait: bool = True) -> CeleryWorker:
        """Spawn the worker; with ``wait`` return once it is ready (see :meth:`wait_ready`)."""
        if self.running:
            return self
        fd, name = tempfile.mkstemp(prefix="cidem-worker-", suffix=".log")
        os.close(fd)
        self.logfile = Path(name)
        self._log_fh = open(self.logfile, "ab")  # noqa: SIM115 - closed in stop()
        with _live_lock:
            self._proc = spawn(
                self.command(), output=self._log_fh, cwd=self.cwd, env=self.environ()
            )
            _live.add(self)
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop(timeout=2.0)
                raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the worker logged ``<nodename> ready.`` and its pool children exist."""
        deadline = time.monotonic() + timeout
        marker = " ready."
        while True:
            if not self.running:
                raise WorkerError(
                    f"worker {self.hostname} exited with {self.returncode} before it was "
                    f"ready:\n{self.log_tail()}"
                )
            if any(line.rstrip().endswith(marker) for line in self.log().splitlines()):
                break
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"worker {self.hostname} not ready within {timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.child_pids(wait=True, timeout=max(1.0, deadline - time.monotonic()))

    def kill_child(self, pid: int | None = None, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (SIGKILL) to one pool child (the first, or ``pid``); returns its pid."""
        if pid is None:
            pids = self.child_pids()
            if not pids:
                raise WorkerError(f"{self.hostname} has no pool children")
            pid = pids[0]
        os.kill(pid, sig)
        return pid

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the main process."""
        if self.running:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (warm shutdown), then SIGKILL to the process group after ``timeout``.

        Returns the exit code. Safe to call more than once; never leaves the pool behind.
        """
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    kill_group(proc.pid)
                    proc.wait(5.0)
            # pool children left over (a child that ignored the parent's exit)
            kill_group(proc.pid)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        with _live_lock:
            _live.discard(self)
        return None if proc is None else proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once (worker and pool), then reap it."""
        if self._proc is not None:
            kill_group(self._proc.pid)
        self.stop(timeout=5.0)

    def remove_log(self) -> None:
        if self.logfile is not None:
            with contextlib.suppress(OSError):
                self.logfile.unlink()

    def __enter__(self) -> CeleryWorker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.returncode}"
        pid = self._proc.pid if self._proc else None
        return f"<CeleryWorker {self.hostname} {self.pool}x{self.concurrency} pid={pid} {state}>"


# --------------------------------------------------------------------------- several


class WorkerGroup(list):  # type: ignore[type-arg]
    """A list of started :class:`CeleryWorker` s; ``stop()`` stops all, also as a context."""

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        for worker in self:
            with contextlib.suppress(ProcessLookupError):
                worker.signal(signal.SIGTERM)
        for worker in self:
            worker.stop(timeout)

    def child_pids(self) -> list[int]:
        return [pid for worker in self for pid in worker.child_pids()]

    def logs(self) -> str:
        return "\n".join(f"----- {w.hostname}\n{w.log()}" for w in self)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[CeleryWorker]:
        return super().__iter__()


def start_workers(
    n: int,
    app_module: str,
    *,
    hostname_prefix: str | None = None,
    timeout: float = START_TIMEOUT,
    **options: Any,
) -> WorkerGroup:
    """Start ``n`` :class:`CeleryWorker` s in parallel and wait until all are ready.

    ``options`` are :class:`CeleryWorker`'s; hostnames are ``<prefix>-<i>@%h`` (the prefix is
    random unless given). If one fails to start, all are stopped and the error raised.
    """
    prefix = hostname_prefix or f"w{uuid.uuid4().hex[:6]}"
    workers = WorkerGroup(
        CeleryWorker(app_module, hostname=f"{prefix}-{i}@%h", **options) for i in range(n)
    )
    for worker in workers:
        worker.start(wait=False)
    try:
        with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
            for future in [pool.submit(w.wait_ready, timeout) for w in workers]:
                future.result()
    except BaseException:
        workers.stop(timeout=2.0)
        raise
    return workers


@atexit.register
def _kill_leftovers() -> None:  # pragma: no cover - safety net
    with _live_lock:
        left = list(_live)
    for worker in left:
        with contextlib.suppress(Exception):
            worker.kill()
